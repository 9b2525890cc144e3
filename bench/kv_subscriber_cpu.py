"""The picker's CPU per KV-event message it receives, at the pace replicas publish them.

vLLM publishes one message per engine step that has events (a decode step that fills a block: one
BlockStored of one block), so a fleet's message rate, not its event count, can set what the
subscriber costs. This publishes `--messages` such messages from `--endpoints` publishers (in a
separate process, vLLM's wire format, `epp.engine.kv_publisher`) at `--rate` messages a second in
all, and reads the subscribing process's CPU time (`KVEventSubscriber`, per-endpoint mode, into a
`KVBlockIndex`) from the first message to the last: CPU µs per message, everything in the process
included (ZMQ's I/O thread, the event loop, decoding, applying).

    python bench/kv_subscriber_cpu.py --messages 8000 --rate 1000 --endpoints 1,20 --rounds 2
    python bench/kv_subscriber_cpu.py --compare-with REF   # the subscriber at git REF (before) against now

With `--compare-with` the subscriber side runs the whole `epp` package of REF (extracted from git)
and of the working tree, alternating in fresh processes; the publisher is always the working tree's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def publish(n: int, rate: float, endpoints: int) -> None:
    """The publisher process: bind `endpoints` publishers, print their ports, wait for "go", send `n` messages."""
    sys.path.insert(0, str(ROOT))
    from epp.engine.kv_publisher import BlockStored, KVEventPublisher

    pubs = [KVEventPublisher("tcp://127.0.0.1:*", topic=f"kv@127.0.0.1:{9000 + i}@m") for i in range(endpoints)]
    print(json.dumps([int(p.bound_endpoint.rsplit(":", 1)[1]) for p in pubs]), flush=True)
    sys.stdin.readline()
    parents: list[int | None] = [None] * endpoints
    t0 = time.perf_counter()
    for k in range(n):
        i = k % endpoints
        pubs[i].publish([BlockStored(block_hashes=[k + 1], parent_block_hash=parents[i],
                                     token_ids=list(range(16 * k, 16 * k + 16)), block_size=16, lora_id=None,
                                     medium="GPU", lora_name=None, group_idx=0)])
        parents[i] = k + 1
        delay = t0 + (k + 1) / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
    sys.stdin.readline()  # until the subscriber has read them all
    for p in pubs:
        p.close()


async def subscribe(n: int, rate: float, endpoints: int) -> dict[str, float]:
    """The measuring process: subscribe to a fresh publisher process, return CPU µs per message."""
    from prometheus_client import CollectorRegistry

    from epp.datalayer.registry import EndpointRegistry, EndpointSpec
    from epp.kvevents.index import KVBlockIndex
    from epp.kvevents.metrics import KVIndexMetrics, KVSubscriberMetrics
    from epp.kvevents.subscriber import KVEventSubscriber, SubscriberConfig

    pub = subprocess.Popen([sys.executable, __file__, "--publish", str(n), str(rate), str(endpoints)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert pub.stdin is not None and pub.stdout is not None
    ports = json.loads(pub.stdout.readline())
    registry = CollectorRegistry()
    index = KVBlockIndex(16, 1_000_000, metrics=KVIndexMetrics(registry))
    fleet = EndpointRegistry()
    fleet.set_endpoints([EndpointSpec("127.0.0.1", 9000 + i, {"kv-events-port": str(port)})
                         for i, port in enumerate(ports)])
    sub = KVEventSubscriber(index, SubscriberConfig(mode="per-endpoint"), fleet, KVSubscriberMetrics(registry))

    def received() -> float:
        return registry.get_sample_value("epp_kv_events_messages_total", {"source": "live"}) or 0.0

    await sub.start()
    await asyncio.sleep(0.5)  # the SUB sockets connect (a PUB drops what it sends before)
    pub.stdin.write("go\n")
    pub.stdin.flush()
    try:
        while received() == 0:
            await asyncio.sleep(0.001)
        first, c0, t0 = received(), time.process_time(), time.perf_counter()
        deadline = t0 + n / rate + 30
        while received() < n and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
        got, cpu_s = received() - first, time.process_time() - c0
    finally:
        pub.stdin.write("done\n")
        pub.stdin.flush()
        pub.wait(timeout=30)
        await sub.stop()
    # Costed from the first message seen on (a few may have come before the loop looked).
    return {"received": received(), "messages": got, "us_per_message": cpu_s / max(got, 1) * 1e6,
            "seconds": time.perf_counter() - t0}


def _measure(source: str | None, n: int, rate: float, endpoints: int) -> dict[str, float]:
    """One measurement in a fresh process whose `epp` is the working tree's or the one under `source`."""
    args = [sys.executable, __file__, "--subscribe", str(n), str(rate), str(endpoints)]
    if source:
        args += ["--source", source]
    out = subprocess.run(args, check=True, capture_output=True, text=True, timeout=n / rate + 120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=8000)
    p.add_argument("--rate", type=float, default=1000.0, help="messages a second, all publishers together")
    p.add_argument("--endpoints", default="1,20", help="publishers (replicas), comma-separated")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (medians)")
    p.add_argument("--compare-with", metavar="REF", help="the subscriber at this git ref (before) against now")
    p.add_argument("--publish", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--subscribe", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--source", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.publish:
        publish(int(args.publish[0]), float(args.publish[1]), int(args.publish[2]))
        return
    if args.subscribe:
        sys.path.insert(0, args.source or str(ROOT))
        import uvloop

        result = uvloop.run(subscribe(int(args.subscribe[0]), float(args.subscribe[1]), int(args.subscribe[2])))
        print(json.dumps(result))
        return
    with tempfile.TemporaryDirectory() as tmp:
        sources: list[tuple[str, str | None]] = [("now", None)]
        if args.compare_with:
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.compare_with, "epp"], check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            sources = [(args.compare_with, tmp), ("now", None)]
        print(f"## CPU per KV-event message received ({args.messages:,} one-block messages at {args.rate:g}/s, "
              f"medians of {args.rounds})\n")
        print("| publishers | " + " | ".join(f"µs/message, {label}" for label, _ in sources)
              + (" | ratio |" if len(sources) == 2 else " |"))
        print("|---:|" + "---:|" * (len(sources) + (len(sources) == 2)))
        for endpoints in [int(x) for x in args.endpoints.split(",")]:
            runs: dict[str, list[float]] = {label: [] for label, _ in sources}
            for r in range(args.rounds):
                for label, source in sources:
                    result = _measure(source, args.messages, args.rate, endpoints)
                    runs[label].append(result["us_per_message"])
                    print(f"  round {r + 1}, {endpoints} publishers, {label}: {result['us_per_message']:.1f} µs "
                          f"({result['messages']:.0f} messages)", file=sys.stderr, flush=True)
            medians = [statistics.median(runs[label]) for label, _ in sources]
            cells = [f"{m:.1f}" for m in medians] + ([f"{medians[1] / medians[0]:.2f}x"] if len(medians) == 2 else [])
            print(f"| {endpoints} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
