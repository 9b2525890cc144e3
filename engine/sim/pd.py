"""P/D roles of a simulated replica: vLLM's `kv_transfer_params` and a NIXL-like KV transfer.

- Prefill leg: a request whose `kv_transfer_params` has `do_remote_decode: true` is prefilled as
  usual (the sidecar asks for one token); its blocks stay held for `transfer_window` simulated
  seconds, and the answer carries the parameters a decoder needs (`do_remote_prefill: true`,
  `remote_engine_id`, `remote_block_ids`, `remote_host`, `remote_port`, `remote_request_id`,
  `tp_size`), as vLLM's NixlConnector returns them.
- Decode leg: `do_remote_prefill: true` with those parameters. The replica waits the modelled
  transfer time of the prompt tokens it does not hold itself (`LatencyProfile.kv_transfer_time`,
  no compute used, like an RDMA read), then tells the prefiller the read is done
  (`POST /sim/kv_transfer` on `remote_host:remote_port`, which frees the blocks there), loads
  the KV (published as `BlockStored`) and computes only the last prompt token. If the prefiller
  no longer holds the blocks or cannot be reached, the prompt is recomputed locally (vLLM's
  `kv_load_failure_policy: recompute`) and the failure is counted.
Simplification: a decoder reserves its blocks when the request is admitted after the transfer,
not while the transfer runs.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
from aiohttp import web

from epp.engine.sim.engine import EngineError, SimEngine, SimRequest
from epp.engine.sim.replica_config import ReplicaConfig

TRANSFER_ROUTE = "/sim/kv_transfer"
ROLE_LABEL = "llm-d.ai/role"
PULL_TIMEOUT_S = 5.0


@dataclass
class PDStats:
    """Counters of one replica's P/D work (exported as `sim:pd_*{role}` on /metrics)."""

    prefill_legs: int = 0          # requests prefilled for a remote decoder
    transfers_pulled: int = 0      # of those, blocks a decoder pulled within the window
    decode_legs: int = 0           # requests decoded with KV from a remote prefiller
    remote_tokens: int = 0         # prompt tokens received instead of computed
    transfer_seconds: float = 0.0  # modelled transfer time, summed
    load_failures: int = 0         # decode legs that recomputed because the pull failed


class PDSupport:
    """The prefill and decode sides of one simulated replica."""

    def __init__(self, config: ReplicaConfig, engine: SimEngine) -> None:
        self.config = config
        self.engine = engine
        self.role = config.labels.get(ROLE_LABEL, "both")
        self.stats = PDStats()
        self.port = config.port  # the HTTP port, set once bound
        self._remote: dict[str, dict[str, Any]] = {}
        self._session: aiohttp.ClientSession | None = None

    # -- request side -----------------------------------------------------------------------
    def accept(self, r: SimRequest, body: dict[str, Any]) -> None:
        """Read a request's `kv_transfer_params`; raises EngineError (400) when they are malformed."""
        params = body.get("kv_transfer_params")
        if params is None:
            return
        if not isinstance(params, dict):
            raise EngineError("'kv_transfer_params' must be an object.")
        if params.get("do_remote_decode"):
            r.hold_for_transfer = self.config.kv_transfer_window
        elif params.get("do_remote_prefill"):
            missing = [k for k in ("remote_host", "remote_port", "remote_request_id") if params.get(k) in (None, "")]
            if missing:
                raise EngineError(f"'kv_transfer_params' with do_remote_prefill needs {', '.join(missing)}.")
            self._remote[r.request_id] = params

    async def before_submit(self, r: SimRequest) -> None:
        """Decode leg: receive the prompt's KV from the prefiller (or fall back to computing it)."""
        params = self._remote.pop(r.request_id, None)
        if params is None:
            return
        bs = self.engine.block_size
        wanted = len(r.prompt_ids) - 1  # the last prompt token is computed here, to sample from
        local = self.engine.cache.lookup(r.hashes[: wanted // bs]).num_blocks * bs
        seconds = self.engine.profile.kv_transfer_time(max(0, wanted - local))
        if seconds:
            await asyncio.sleep(seconds * self.engine.config.time_scale)
        if await self._pull(params):
            r.remote_tokens = wanted
            self.stats.decode_legs += 1
            self.stats.remote_tokens += max(0, wanted - local)
            self.stats.transfer_seconds += seconds
        else:
            self.stats.load_failures += 1

    async def _pull(self, params: dict[str, Any]) -> bool:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PULL_TIMEOUT_S))
        url = f"http://{params['remote_host']}:{params['remote_port']}{TRANSFER_ROUTE}"
        try:
            async with self._session.post(url, json={"remote_request_id": params["remote_request_id"],
                                                     "remote_block_ids": params.get("remote_block_ids")}) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return False

    def response_params(self, r: SimRequest) -> dict[str, Any] | None:
        """Prefill leg: what the decoder needs to pull this request's KV (None otherwise)."""
        kept = self.engine.transfers.get(r.request_id)
        if not r.hold_for_transfer or kept is None:
            return None
        self.stats.prefill_legs += 1
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.config.name,
            "remote_block_ids": [int.from_bytes(b.digest[:4], "big") for b in kept[0]],
            "remote_host": self.config.host,
            "remote_port": self.port,
            "remote_request_id": r.request_id,
            "tp_size": 1,
        }

    # -- the prefiller's side channel -------------------------------------------------------------
    async def handle_pull(self, request: web.Request) -> web.Response:
        """POST /sim/kv_transfer: a decoder finished reading a request's blocks; free them."""
        try:
            body = await request.json()
            request_id = body["remote_request_id"]
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": "expected {remote_request_id}"}, status=400)
        if not self.engine.release_transfer(str(request_id)):
            return web.json_response({"error": f"no KV held for {request_id} (window over?)"}, status=404)
        self.stats.transfers_pulled += 1
        return web.json_response({"ok": True})

    # -- reporting -----------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Role, counters and transfers still held, for /sim/state."""
        return {"role": self.role, "held_transfers": len(self.engine.transfers), **asdict(self.stats)}

    def render_metrics(self) -> str:
        """Prometheus lines of the P/D counters, labelled with the replica's role."""
        role = f'{{role="{self.role}"}}'
        s = self.stats
        rows = [
            ("sim:pd_prefill_legs_total", "Requests prefilled for a remote decoder.", s.prefill_legs),
            ("sim:pd_transfers_pulled_total", "Prefilled KV pulled by a decoder within the window.",
             s.transfers_pulled),
            ("sim:pd_decode_legs_total", "Requests decoded with KV received from a prefiller.", s.decode_legs),
            ("sim:pd_remote_tokens_total", "Prompt tokens received from prefillers instead of computed.",
             s.remote_tokens),
            ("sim:pd_transfer_seconds_total", "Modelled KV transfer time, summed.", s.transfer_seconds),
            ("sim:pd_load_failures_total", "Decode legs that recomputed the prompt after a failed pull.",
             s.load_failures),
        ]
        lines = []
        for name, help_, value in rows:
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name}{role} {float(value)}"]
        lines += ["# HELP sim:pd_held_transfers Finished prefills whose blocks wait for a decoder.",
                  "# TYPE sim:pd_held_transfers gauge", f"sim:pd_held_transfers{role} {len(self.engine.transfers)}"]
        return "\n".join(lines) + "\n"

    async def close(self) -> None:
        """Close the client session of the pulls."""
        if self._session is not None:
            await self._session.close()
            self._session = None
