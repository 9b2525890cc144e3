"""Start N simulated replicas on loopback, in this process or spread over worker processes.

Python API::

    async with SimFleet(FleetConfig(replicas=8, processes=2)) as fleet:
        fleet.endpoints_arg        # "127.0.0.1:p0,127.0.0.1:p1,..." for `epp serve --endpoints`
        fleet.info                 # one dict per replica: endpoint, KV-event endpoints, topic, ...

With ``processes=0`` (the default) the replicas share the caller's event loop, one aiohttp app
per port, and are reachable as ``fleet.replicas`` for white-box checks; ``processes=K`` spreads
them round-robin over K worker processes (``python -m epp.engine.sim worker``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Self

from epp.engine.sim.engine import EngineConfig
from epp.engine.sim.kvcache import TierConfig
from epp.engine.sim.pd import ROLE_LABEL
from epp.engine.sim.profiles import get_profile
from epp.engine.sim.replica_config import ReplicaConfig
from epp.engine.sim.server import SimReplica
from epp.engine.sim.tokenizer import SimTokenizer


@dataclass
class FleetConfig:
    """What a fleet of simulated replicas looks like (JSON-serialisable)."""

    replicas: int = 4
    host: str = "127.0.0.1"
    base_port: int = 0
    model: str = "sim-model"
    tokenizer_dir: str | None = None
    profile: str = "fast"
    profiles: list[str] | None = None
    time_scale: float = 1.0
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    hash_seed: str | None = None
    cpu_blocks: int = 0
    disk_blocks: int = 0
    disk_high_watermark: float = 0.85
    disk_low_watermark: float = 0.50
    disk_write_through: bool = True
    self_describing_tier_events: bool = True
    kv_events: bool = True
    kv_events_base_port: int = 0
    kv_events_connect: str | None = None
    kv_replay: bool = True
    kv_topic: str | None = None  # None: kv@<ip:port>@<model>; "" is vLLM's default (names nothing)
    legacy_array_events: bool = False
    processes: int = 0
    name_prefix: str = "sim"
    lora_modules: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    # On, as `epp engine serve` starts vLLM (vLLM's own default, and a lone replica's, is off).
    enable_prompt_tokens_details: bool = True
    enable_scale_out: bool = False  # vLLM's --enable-scale-out (the /render routes; off: they answer 403)
    # P/D: role of replica i (label llm-d.ai/role: prefill, decode or both), cycling; None: no label.
    roles: list[str] | None = None
    kv_transfer_window: float = 30.0
    # OpenAI Responses each replica keeps for previous_response_id (least recently used dropped past it).
    max_stored_responses: int = 4096

    def replica_config(self, i: int, tokenizer_dir: str) -> ReplicaConfig:
        """The configuration of replica `i` (profiles cycle over `profiles` when given)."""
        profile_name = self.profiles[i % len(self.profiles)] if self.profiles else self.profile
        profile = get_profile(profile_name)
        engine = EngineConfig(
            profile=profile, num_gpu_blocks=self.num_gpu_blocks, block_size=self.block_size,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            tiers=TierConfig(cpu_blocks=self.cpu_blocks, disk_blocks=self.disk_blocks,
                             disk_high_watermark=self.disk_high_watermark,
                             disk_low_watermark=self.disk_low_watermark,
                             disk_write_through=self.disk_write_through,
                             self_describing_events=self.self_describing_tier_events),
            time_scale=self.time_scale, hash_seed=self.hash_seed,
        )
        kv_pub = kv_replay = None
        if self.kv_events_base_port:
            kv_pub = f"tcp://{self.host}:{self.kv_events_base_port + 2 * i}"
            kv_replay = f"tcp://{self.host}:{self.kv_events_base_port + 2 * i + 1}"
        if self.kv_events_connect:
            kv_pub = self.kv_events_connect  # centralized mode: every PUB dials one bound SUB
        labels = {"replica": f"{self.name_prefix}-{i}", "profile": profile.name, **self.labels}
        if self.roles:
            labels[ROLE_LABEL] = self.roles[i % len(self.roles)]
        return ReplicaConfig(
            name=f"{self.name_prefix}-{i}", model=self.model, tokenizer_dir=tokenizer_dir, host=self.host,
            port=self.base_port + i if self.base_port else 0, engine=engine, kv_events=self.kv_events,
            kv_events_endpoint=kv_pub, kv_replay_endpoint=kv_replay, kv_replay=self.kv_replay, kv_topic=self.kv_topic,
            legacy_array_events=self.legacy_array_events, lora_modules=dict(self.lora_modules), labels=labels,
            enable_prompt_tokens_details=self.enable_prompt_tokens_details,
            enable_scale_out=self.enable_scale_out,
            kv_events_bind=None if self.kv_events_connect else True,
            kv_transfer_window=self.kv_transfer_window, max_stored_responses=self.max_stored_responses,
        )


def default_tokenizer_dir(seed: int = 0) -> str:
    """A cached tiny-model tokenizer (engine/tinymodel.py) shared by every replica on this host."""
    dest = Path(tempfile.gettempdir()) / f"epp-sim-tokenizer-{seed}"
    if (dest / "tokenizer.json").exists() and (dest / "tokenizer_config.json").exists():
        return str(dest)
    from epp.engine.tinymodel import write_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="epp-sim-tok-"))
    write_tiny_model(tmp, seed=seed, weights=False)
    tmp.chmod(0o755)  # mkdtemp makes it 0700: other users of this host must be able to read the shared copy
    try:
        os.replace(tmp, dest)  # atomic: concurrent writers race harmlessly
    except OSError:
        pass
    return str(dest)


async def start_replicas(config: FleetConfig, indices: list[int]) -> list[SimReplica]:
    """Start the replicas `indices` of `config` on the running loop."""
    tok_dir = config.tokenizer_dir or default_tokenizer_dir()
    tokenizer = SimTokenizer(tok_dir)
    replicas = []
    try:
        for i in indices:
            rep = SimReplica(config.replica_config(i, tok_dir), tokenizer)
            await rep.start()
            replicas.append(rep)
    except BaseException:
        for rep in replicas:
            await rep.stop()
        raise
    return replicas


class SimFleet:
    """N simulated vLLM replicas; use ``async with`` or ``await start()`` / ``await stop()``."""

    def __init__(self, config: FleetConfig | None = None, **overrides: Any) -> None:
        config = config or FleetConfig()
        self.config = FleetConfig(**{**asdict(config), **overrides})
        self.replicas: list[SimReplica] = []
        self.info: list[dict[str, Any]] = []
        self._procs: list[asyncio.subprocess.Process] = []

    @property
    def endpoints(self) -> list[str]:
        """``ip:port`` of every replica, in replica order."""
        return [d["endpoint"] for d in self.info]

    @property
    def endpoints_arg(self) -> str:
        """The comma-joined endpoints, the exact string `epp serve --endpoints` takes."""
        return ",".join(self.endpoints)

    async def start(self) -> Self:
        """Start every replica; returns self once all of them serve."""
        c = self.config
        nproc = min(c.processes, c.replicas)
        if nproc <= 0:
            self.replicas = await start_replicas(c, list(range(c.replicas)))
            self.info = [r.describe() for r in self.replicas]
            return self
        if c.tokenizer_dir is None:
            c.tokenizer_dir = default_tokenizer_dir()
        groups = [list(range(p, c.replicas, nproc)) for p in range(nproc)]
        info: dict[int, dict[str, Any]] = {}
        try:
            for group in groups:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "epp.engine.sim", "worker", "--config", json.dumps(asdict(c)),
                    "--indices", ",".join(map(str, group)),
                    stdout=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL)
                self._procs.append(proc)
            for proc, _group in zip(self._procs, groups):
                assert proc.stdout is not None
                while True:
                    line = await asyncio.wait_for(proc.stdout.readline(), 60)
                    if not line:
                        raise RuntimeError(f"simulator worker exited with {await proc.wait()} before it was ready")
                    msg = json.loads(line)
                    if msg.get("ready"):
                        break
                    info[msg["index"]] = msg["replica"]
        except BaseException:
            await self.stop()
            raise
        self.info = [info[i] for i in range(c.replicas)]
        return self

    async def stop(self) -> None:
        """Stop every replica and worker process."""
        for rep in self.replicas:
            await rep.stop()
        self.replicas = []
        for proc in self._procs:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self._procs:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        self._procs = []

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def start_fleet(config: FleetConfig | None = None, **overrides: Any) -> SimFleet:
    """Start a fleet and return it (the caller must ``await fleet.stop()``)."""
    return await SimFleet(config, **overrides).start()


async def run_worker(config: FleetConfig, indices: list[int]) -> None:
    """Worker process body: start replicas, report them as JSON lines, serve until SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    replicas = await start_replicas(config, indices)
    for i, rep in zip(indices, replicas):
        print(json.dumps({"index": i, "replica": rep.describe()}), flush=True)
    print(json.dumps({"ready": True}), flush=True)
    try:
        await stop.wait()
    finally:
        for rep in replicas:
            await rep.stop()
