"""The request path of one agentic turn, per pipeline config: picker CPU and the time to the routing decision.

Each config is loaded into an in-process picker (`EppServer`, two endpoints, no scraping: every
endpoint looks idle, so the numbers are the pipeline's own work) and its ext_proc service is handed
what Envoy sends for a chat turn of a coding-agent session (`x-claude-code-session-id`): the request
headers, the body in one message, then the response headers and a first streamed chunk, and the
stream's end. Twelve sessions take turns; each turn adds a tool result to its session's history and
the answer after it, so prompts grow as agent sessions do (a 1.4k-character system prompt, then
about 300 characters a turn). The first `--warmup` turns are not counted. Per config: CPU per turn
(the process's, the tokenizer threads' included) and the wall time from the request headers to the
routing reply, p50 and p90.

    python bench/agentic_pick_path.py --configs examples/configs/agentic.yaml,bench/agentic/configs/llmd-agentic.yaml
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.agentic_turn_cost import FIRST_CHUNK, ProcessingMode, _headers, pb  # noqa: E402
from epp.datalayer.registry import parse_endpoint_list  # noqa: E402
from epp.request.parsing import RequestParser  # noqa: E402
from epp.server.extproc import ExtProcService, _Stream  # noqa: E402
from epp.server.runner import EppServer, ServeOptions  # noqa: E402

SESSIONS = 12


def turn_messages(body: bytes, session: str, turn: int) -> tuple[list[pb.ProcessingRequest], list[pb.ProcessingRequest]]:
    """What Envoy sends for one turn: up to the routing decision, then the response up to its first token."""
    first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=_headers(
        [(":method", "POST"), (":path", "/v1/chat/completions"), ("content-type", "application/json"),
         ("x-request-id", f"{session}-{turn}"), ("x-claude-code-session-id", session)])))
    first.protocol_config.request_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED
    first.protocol_config.response_body_mode = ProcessingMode.STREAMED
    request = [first, pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))]
    response = [pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=_headers(
                    [(":status", "200"), ("content-type", "text/event-stream")]))),
                pb.ProcessingRequest(response_body=pb.HttpBody(body=FIRST_CHUNK))]
    return request, response


async def measure(config: Path, turns: int, warmup: int) -> dict[str, float]:
    """CPU per turn and the wall time to the routing reply (p50, p90), milliseconds, for one config."""
    server = EppServer(ServeOptions(grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
                                    endpoints=parse_endpoint_list("127.0.0.1:20000,127.0.0.1:20001"),
                                    scrape_metrics=False, config_text=config.read_text()))
    await server.start()
    try:
        assert server.director is not None
        service = ExtProcService(server.director, RequestParser(), server.metrics)
        history = {f"session-{k}": [{"role": "system", "content": "You are a coding agent. " * 60}]
                   for k in range(SESSIONS)}
        cpu: list[float] = []
        wall: list[float] = []
        for i in range(warmup + turns):
            session = f"session-{i % SESSIONS}"
            history[session].append({"role": "user", "content": f"tool result {i} " * 40})
            body = json.dumps({"model": "m", "messages": history[session], "stream": True,
                               "max_tokens": 16}).encode()
            request, response = turn_messages(body, session, i)
            stream = _Stream(service)
            c0, w0 = time.process_time(), time.perf_counter()
            for msg in request:
                await service._dispatch(stream, msg)
            routed = time.perf_counter() - w0
            if stream.life.target is None:
                raise RuntimeError(f"{config}: turn {i} was not routed")
            for msg in response:
                await service._dispatch(stream, msg)
            stream.on_stream_end()
            if i >= warmup:
                cpu.append(time.process_time() - c0)
                wall.append(routed)
            history[session].append({"role": "assistant", "content": f"answer {i} " * 20})
            await asyncio.sleep(0.002)  # lets the turn's completion callbacks run, as between real turns
    finally:
        await server.stop()
    wall.sort()
    return {"cpu_ms": statistics.fmean(cpu) * 1e3, "route_p50_ms": wall[len(wall) // 2] * 1e3,
            "route_p90_ms": wall[int(0.9 * len(wall))] * 1e3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", required=True, help="comma-separated EndpointPickerConfig files")
    p.add_argument("--turns", type=int, default=400, help="measured turns per config")
    p.add_argument("--warmup", type=int, default=50, help="turns not counted at the start")
    args = p.parse_args()
    print("| config | CPU per turn (ms) | to the routing reply, p50 / p90 (ms) |\n|---|---:|---|")
    for config in args.configs.split(","):
        m = asyncio.run(measure(Path(config), args.turns, args.warmup))
        print(f"| {config} | {m['cpu_ms']:.3f} | {m['route_p50_ms']:.3f} / {m['route_p90_ms']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
