"""Parsing and picking cost of a 2 KB chat request, for two checkouts in one run, alternating.

The picker runs in-process (default config: queue + kv-cache + approximate prefix, 16
endpoints, no scraping) and its ext_proc service is handed the request headers and a 2 KB chat
body (4 messages, a shared system prompt, a user turn that differs per request), then a small
JSON response. Each round runs the same measurement once under each Python (each with its own
checkout installed), in alternating order, and keeps the CPU µs per request (minimum over
batches). The report is the median over rounds and the ratio of the second to the first.

    python bench/parse_pick_cost.py --baseline /path/base/.venv/bin/python --candidate .venv/bin/python
    python bench/parse_pick_cost.py --worker --requests 2000      # one measurement, this Python's checkout
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

BATCHES = 10
SYSTEM = ("You are a careful assistant of the support team. Answer in short sentences, quote the manual "
          "where you can, and say when you do not know. ") * 6


def _chat_body(i: int) -> bytes:
    """A chat request of about 2 KB: system prompt, one exchange, then a question that differs per request."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "How do I reset the router to its factory settings?"},
                {"role": "assistant", "content": "Hold the reset button for ten seconds while it is powered."},
                {"role": "user", "content": f"And after that, question {i}: which lights should be on? " * 3}]
    body = json.dumps({"model": "m", "messages": messages, "max_tokens": 64}).encode()
    return body


async def _measure(n: int) -> float:
    from envoy.config.core.v3 import base_pb2
    from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from epp.datalayer.registry import parse_endpoint_list
    from epp.request.parsing import RequestParser
    from epp.server.extproc import ExtProcService, _Stream
    from epp.server.runner import EppServer, ServeOptions

    def headers(pairs: list[tuple[str, str]]) -> base_pb2.HeaderMap:
        return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])

    first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers(
        [(":method", "POST"), (":path", "/v1/chat/completions"), ("content-type", "application/json"),
         ("x-request-id", "r")])))
    first.protocol_config.request_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED
    first.protocol_config.response_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED
    bodies = [pb.ProcessingRequest(request_body=pb.HttpBody(body=_chat_body(i), end_of_stream=True))
              for i in range(64)]
    response = [pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=headers(
                    [(":status", "200"), ("content-type", "application/json")]))),
                pb.ProcessingRequest(response_body=pb.HttpBody(
                    body=b'{"usage":{"prompt_tokens":500,"completion_tokens":1}}', end_of_stream=True))]
    options = ServeOptions(grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
                           endpoints=parse_endpoint_list(",".join(f"127.0.0.1:{8000 + i}" for i in range(16))),
                           scrape_metrics=False)
    server = EppServer(options)
    await server.start()
    try:
        service = ExtProcService(server.director, RequestParser(), server.metrics)
        clock = time.process_time
        count = 0

        async def one() -> None:
            nonlocal count
            stream = _Stream(service)
            await service._dispatch(stream, first)
            await service._dispatch(stream, bodies[count % len(bodies)])
            for msg in response:
                await service._dispatch(stream, msg)
            count += 1
            stream.on_close()
            stream.life.complete(aborted=True)

        for _ in range(300):  # warm-up
            await one()
        per_batch = max(1, n // BATCHES)
        best = float("inf")
        for _ in range(BATCHES):
            t0 = clock()
            for _ in range(per_batch):
                await one()
            best = min(best, clock() - t0)
        return best / per_batch * 1e6
    finally:
        await server.stop(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help="measure once with this Python and print µs")
    parser.add_argument("--baseline", help="Python of the baseline checkout")
    parser.add_argument("--candidate", default=sys.executable, help="Python of the candidate checkout")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=2000, help="timed requests per measurement")
    args = parser.parse_args()
    if args.worker:
        print(f"{asyncio.run(_measure(args.requests)):.2f}")
        return 0
    if not args.baseline:
        parser.error("--baseline is required (or --worker)")
    runs: dict[str, list[float]] = {"baseline": [], "candidate": []}
    for r in range(args.rounds):
        order = [("baseline", args.baseline), ("candidate", args.candidate)]
        for label, python in order if r % 2 == 0 else order[::-1]:
            out = subprocess.run([python, __file__, "--worker", "--requests", str(args.requests)],
                                 capture_output=True, text=True, check=True)
            runs[label].append(float(out.stdout.strip().splitlines()[-1]))
    base, cand = statistics.median(runs["baseline"]), statistics.median(runs["candidate"])
    print(f"2 KB chat, parse + pick + response, CPU µs/request (median of {args.rounds} rounds, min batch each)")
    print(f"baseline  {base:8.1f}  {runs['baseline']}")
    print(f"candidate {cand:8.1f}  {runs['candidate']}")
    print(f"ratio candidate/baseline {cand / base:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
