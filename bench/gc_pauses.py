"""Garbage-collector pauses in the picker while its approximate-prefix index fills.

A full (generation 2) collection stops the event loop while it walks every container object
that survived since start-up, so its pause grows with what the picker keeps. This starts the
picker in-process (`EppServer`, default config: approximate prefix, 16 endpoints, no scraping),
freezes the start-up heap as `epp serve` does, and feeds it distinct 4 KB prompts through its
ext_proc service one request after another (as `bench/extproc_inproc.py` does, with a new prompt
each time, so every request adds its blocks to the index). Every collection is timed through
`gc.callbacks`. Per window of requests: the index's entries, the container objects a full
collection walks, collections by generation and the longest pause of each; at the end, how long
one full collection takes.

    python bench/gc_pauses.py --requests 40000
    python bench/gc_pauses.py --requests 40000 --epp-config bench/random-picker.yaml
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import time
from pathlib import Path

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from extproc_cpu import _messages  # noqa: E402
from extproc_inproc import picker_service  # noqa: E402

from epp.server.extproc import _Stream  # noqa: E402
from epp.server.runner import freeze_startup_heap  # noqa: E402

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


class CollectionTimer:
    """Counts and times every collection, per generation, through `gc.callbacks`."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.longest = [0.0, 0.0, 0.0]
        self.total = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        generation = info["generation"]
        self.count[generation] += 1
        self.longest[generation] = max(self.longest[generation], pause)
        self.total += pause

    def reset(self) -> None:
        self.count, self.longest, self.total = [0, 0, 0], [0.0, 0.0, 0.0], 0.0


def _prompt_body(rng: random.Random) -> bytes:
    prompt = " ".join(rng.choices(WORDS, k=900))[:4096]
    return json.dumps({"model": "m", "prompt": prompt}).encode()


async def run(requests: int, window: int, config_file: str | None) -> None:
    async with picker_service(config_file) as (server, service):
        (headers, _body), response = _messages("headers")
        rng = random.Random(7)
        freeze_startup_heap()
        timer = CollectionTimer()
        gc.callbacks.append(timer)
        print("| requests | index entries | objects a full collection walks | collections gen 0 / 1 / 2 "
              "| longest pause gen 0 / 1 / 2 (ms) | GC time per request (µs) |")
        print("|---:|---:|---:|---|---|---:|")
        longest_full = 0.0
        for done in range(1, requests + 1):
            body = pb.ProcessingRequest(request_body=pb.HttpBody(body=_prompt_body(rng), end_of_stream=True))
            stream = _Stream(service)
            for req in (headers, body, *response):
                await service._dispatch(stream, req)
            stream.on_close()
            stream.life.complete(aborted=True)
            await asyncio.sleep(0)  # the loop runs between requests, as in a server (it purges cancelled timers)
            if done % window == 0:
                gc.callbacks.remove(timer)  # counting the objects is no pause of the picker's
                walked = len(gc.get_objects(2)) + len(gc.get_objects(1)) + len(gc.get_objects(0))
                entries = server.metrics.registry.get_sample_value("inference_extension_prefix_indexer_size")
                longest_full = max(longest_full, timer.longest[2])
                print(f"| {done:,} | {int(entries or 0):,} | {walked:,} | {' / '.join(map(str, timer.count))} "
                      f"| {' / '.join(f'{p * 1e3:.2f}' for p in timer.longest)} | {timer.total / window * 1e6:.1f} |",
                      flush=True)
                timer.reset()
                gc.callbacks.append(timer)
        gc.callbacks.remove(timer)
        started = time.perf_counter()
        gc.collect()
        forced = time.perf_counter() - started
        print(f"\nlongest full collection: {longest_full * 1e3:.1f} ms; one forced at the end: {forced * 1e3:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=40000)
    parser.add_argument("--window", type=int, default=5000, help="requests per table row")
    parser.add_argument("--epp-config", help="the picker's config file (default: GIE's default pipeline)")
    args = parser.parse_args()
    print(f"\n{args.requests:,} distinct 4 KB prompts, 16 endpoints, config: {args.epp_config or 'default'}\n")
    asyncio.run(run(args.requests, args.window, args.epp_config))


if __name__ == "__main__":
    main()
