"""``python -m epp.engine.sim fleet ...``: run simulated vLLM replicas until SIGINT/SIGTERM.

The first line on stdout is the endpoints list ``ip:port,ip:port,...`` (the exact string
``epp serve --endpoints`` takes); replica details go to stderr as JSON lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

from epp.engine.sim.fleet import FleetConfig, SimFleet, run_worker
from epp.engine.sim.profiles import PROFILES


def _pairs(values: list[str], what: str) -> dict[str, str]:
    out = {}
    for v in values:
        k, sep, val = v.partition("=")
        if not sep:
            raise SystemExit(f"--{what} expects KEY=VALUE, got {v!r}")
        out[k] = val
    return out


FLEET_DESCRIPTION = """\
Run N simulated vLLM replicas on this host until SIGINT/SIGTERM. Each speaks vLLM's HTTP API
(OpenAI completions, chat, Responses, embeddings; Anthropic messages and count_tokens; SGLang's
/generate; vLLM's /inference/v1/generate with --enable-scale-out, as vLLM), /metrics, sleep/wake
and KV events over ZMQ, from a latency model of continuous batching with a prefix cache.

The first line on stdout is the endpoints list ip:port,ip:port,... (what `epp serve --endpoints`
takes); each replica's details (endpoint, KV-event sockets, topic, labels) follow on stderr as
JSON lines."""


def _fleet_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("fleet", help="start N simulated replicas on loopback", description=FLEET_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    fleet = p.add_argument_group("replicas")
    fleet.add_argument("--replicas", type=int, default=4, help="how many replicas to start (default: 4)")
    fleet.add_argument("--host", default="127.0.0.1", help="address every replica binds (default: 127.0.0.1)")
    fleet.add_argument("--base-port", type=int, default=0,
                       help="HTTP port of the first replica, the next ones counting up (default: 0, free ports)")
    fleet.add_argument("--model", default="sim-model", help="served model name (default: sim-model)")
    fleet.add_argument("--tokenizer-dir", default=None,
                       help="folder with tokenizer.json and tokenizer_config.json (default: the tiny test model's "
                            "tokenizer, made on first use)")
    fleet.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                       help="a LoRA adapter every replica serves (repeatable; default: none)")
    fleet.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                       help="a label of every replica, in the endpoints list (repeatable; default: none)")
    fleet.add_argument("--roles", default=None,
                       help="P/D roles by replica, cycling, e.g. prefill,decode,decode: label llm-d.ai/role "
                            "(default: no role)")
    fleet.add_argument("--name-prefix", default="sim",
                       help="replica names are PREFIX-0, PREFIX-1, ... (the x-sim-replica header; default: sim)")
    fleet.add_argument("--processes", type=int, default=0,
                       help="worker processes hosting the replicas (default: 0, all in this process)")
    timing = p.add_argument_group("speed and capacity")
    timing.add_argument("--profile", default="fast",
                        help=f"latency profile: {', '.join(PROFILES)}; NAME*F makes it F times slower "
                             "(default: fast)")
    timing.add_argument("--profiles", default=None,
                        help="comma list of profiles cycled over the replicas (a mixed fleet), e.g. fast,fast*2 "
                             "(default: --profile for all)")
    timing.add_argument("--time-scale", type=float, default=1.0,
                        help="wall seconds per simulated second (default: 1.0)")
    timing.add_argument("--num-gpu-blocks", type=int, default=None,
                        help="KV blocks on the GPU per replica (default: the profile's; fast: 4096)")
    timing.add_argument("--block-size", type=int, default=None,
                        help="tokens per KV block (default: the profile's; fast: 16)")
    timing.add_argument("--max-num-seqs", type=int, default=None,
                        help="most requests running at once per replica (default: the profile's; fast: 256)")
    timing.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="token budget of one engine step (default: the profile's; fast: 8192)")
    timing.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt plus output in tokens (default: the profile's; fast: 8192)")
    timing.add_argument("--kv-transfer-window", type=float, default=30.0,
                        help="P/D: simulated seconds a prefill keeps its KV for the decoder to pull (default: 30)")
    tiers = p.add_argument_group("KV offload tiers")
    tiers.add_argument("--cpu-blocks", type=int, default=0, help="CPU offload tier capacity in blocks (default: 0, off)")
    tiers.add_argument("--disk-blocks", type=int, default=0,
                       help="disk offload tier capacity in blocks (default: 0, off)")
    tiers.add_argument("--disk-high-watermark", type=float, default=0.85,
                       help="disk tier fill that starts an eviction run (default: 0.85)")
    tiers.add_argument("--disk-low-watermark", type=float, default=0.50,
                       help="disk tier fill an eviction run stops at (default: 0.50)")
    tiers.add_argument("--disk-on-cpu-eviction", action="store_true",
                       help="write blocks to disk when the CPU tier evicts them (default: off, write-through)")
    events = p.add_argument_group("KV events")
    events.add_argument("--no-kv-events", action="store_true",
                        help="publish no KV events (default: off, every replica publishes them)")
    events.add_argument("--kv-events-base-port", type=int, default=0,
                        help="PUB of replica i on BASE+2i, its replay ROUTER on BASE+2i+1 (default: 0, free ports)")
    events.add_argument("--kv-events-connect", default=None,
                        help="centralized mode: every replica's PUB connects to this endpoint, where one SUB binds "
                             "(default: each PUB binds its own)")
    events.add_argument("--kv-topic", default=None,
                        help='KV-event topic; "" is what vLLM publishes on by default (default: kv@<ip:port>@<model>)')
    events.add_argument("--hash-seed", default=None,
                        help="NONE_HASH seed of the block hashes (default: $PYTHONHASHSEED if set, else vLLM's "
                             "'vllm-none-hash')")
    events.add_argument("--placeholder-tier-events", action="store_true",
                        help="CPU/disk BlockStored events as vLLM's default placeholders, hash only (default: off, "
                             "self-describing events)")
    events.add_argument("--legacy-array-events", action="store_true",
                        help="events as positional msgpack arrays, vLLM's form before 2026 (default: off, maps)")
    timing.add_argument("--max-stored-responses", type=int, default=4096,
                        help="OpenAI Responses each replica keeps for previous_response_id, least recently used "
                             "dropped past it (default: 4096)")
    api = p.add_argument_group("vLLM flags")
    api.add_argument("--enable-prompt-tokens-details", action="store_true",
                     help="vLLM's flag: usage.prompt_tokens_details.cached_tokens in responses (Anthropic's: "
                          "cache_read_input_tokens and cache_creation_input_tokens) (default: off, as vLLM's)")
    api.add_argument("--enable-scale-out", action="store_true",
                     help="vLLM's flag: serve /v1/completions/render, /v1/chat/completions/render and "
                          "/inference/v1/generate (default: off, they answer 403)")
    return p


def _config(args: argparse.Namespace) -> FleetConfig:
    return FleetConfig(
        replicas=args.replicas, host=args.host, base_port=args.base_port, model=args.model,
        tokenizer_dir=args.tokenizer_dir, profile=args.profile,
        profiles=args.profiles.split(",") if args.profiles else None, time_scale=args.time_scale,
        num_gpu_blocks=args.num_gpu_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        hash_seed=args.hash_seed, cpu_blocks=args.cpu_blocks, disk_blocks=args.disk_blocks,
        disk_high_watermark=args.disk_high_watermark, disk_low_watermark=args.disk_low_watermark,
        disk_write_through=not args.disk_on_cpu_eviction,
        self_describing_tier_events=not args.placeholder_tier_events, kv_events=not args.no_kv_events,
        kv_events_base_port=args.kv_events_base_port, kv_events_connect=args.kv_events_connect,
        kv_topic=args.kv_topic,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details, enable_scale_out=args.enable_scale_out,
        legacy_array_events=args.legacy_array_events,
        processes=args.processes, name_prefix=args.name_prefix, lora_modules=_pairs(args.lora, "lora"),
        labels=_pairs(args.label, "label"),
        roles=_roles(args.roles), kv_transfer_window=args.kv_transfer_window,
        max_stored_responses=args.max_stored_responses,
    )


def _roles(text: str | None) -> list[str] | None:
    if not text:
        return None
    roles = [r.strip() for r in text.split(",")]
    bad = [r for r in roles if r not in ("prefill", "decode", "both")]
    if bad:
        raise SystemExit(f"--roles: {bad} are not roles; use prefill, decode or both")
    return roles


async def _run_fleet(config: FleetConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with SimFleet(config) as fleet:
        print(fleet.endpoints_arg, flush=True)
        for d in fleet.info:
            print(json.dumps(d), file=sys.stderr, flush=True)
        await stop.wait()


def _run_worker(argv: list[str]) -> None:
    """``worker``: a process SimFleet starts to host some of its replicas (internal, not in --help)."""
    parser = argparse.ArgumentParser(prog="python -m epp.engine.sim worker")
    parser.add_argument("--config", required=True, help="the FleetConfig as JSON")
    parser.add_argument("--indices", required=True, help="comma list of the replica indices to host")
    args = parser.parse_args(argv)
    config = FleetConfig(**json.loads(args.config))
    asyncio.run(run_worker(config, [int(i) for i in args.indices.split(",")]))


def main(argv: list[str] | None = None, prog: str = "python -m epp.engine.sim") -> None:
    """Entry point of ``python -m epp.engine.sim`` (and of ``epp sim``, which passes its `prog`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        _run_worker(argv[1:])
        return
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The vLLM simulator: replicas that speak vLLM's HTTP API, /metrics and KV events.\n\n"
                    f"`{prog} fleet` runs them until SIGINT/SIGTERM; the first line on stdout is the endpoints\n"
                    "list ip:port,ip:port,... (what `epp serve --endpoints` takes); replica details go to\n"
                    "stderr as JSON lines.")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    _fleet_parser(sub)
    args = parser.parse_args(argv)
    try:
        asyncio.run(_run_fleet(_config(args)))
    except OSError as e:  # a port in use, an address not on this host: one line, not a traceback
        raise SystemExit(f"{prog} fleet: {e}") from None


if __name__ == "__main__":
    main()
