"""`epp engine disk-manager`: keep a vLLM fs KV tier within budget, publish BlockRemoved events."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web

from epp.engine.disk_tier.access_watch import AccessWatcher
from epp.engine.disk_tier.http import build_app
from epp.engine.disk_tier.manager import DiskTierConfig, DiskTierManager
from epp.engine.disk_tier.membership import ChunkMembership, follow_vllm_events
from epp.engine.disk_tier.metrics import DiskTierMetrics
from epp.engine.kv_publisher import KVEventPublisher
from epp.engine.vllm.launcher import parse_size


def build_parser() -> argparse.ArgumentParser:
    """The argparse of `epp engine disk-manager`."""
    p = argparse.ArgumentParser(
        prog="epp engine disk-manager",
        description="Evict least-recently-accessed block files of vLLM's fs KV tier between watermarks "
        "and publish BlockRemoved (medium STORAGE) events on the replica's KV-event topic.",
    )
    p.add_argument("--root", required=True, type=Path, help="root_dir of the fs tier")
    p.add_argument("--budget-bytes", required=True, type=parse_size, help="disk budget, e.g. 200GiB")
    p.add_argument("--high-watermark", type=float, default=0.85)
    p.add_argument("--low-watermark", type=float, default=0.50)
    p.add_argument("--interval", type=float, default=5.0, help="seconds between scans")
    p.add_argument("--min-age", type=float, default=5.0, help="never delete a block accessed this recently")
    p.add_argument("--stale-temp", type=float, default=600.0, help="age after which a .tmp file is an orphan")
    p.add_argument("--access-clock", choices=["auto", "mtime"], default="auto",
                   help="auto: max(atime, mtime); mtime: ignore atime (filesystems with unreliable atime)")
    p.add_argument("--no-access-watch", dest="access_watch", action="store_false",
                   help="do not watch block-file opens with inotify (one watch per tier directory); "
                   "order by atime/mtime only")
    p.add_argument("--topic", default="", help="the replica's KV-event topic kv@<ip:port>@<model>")
    p.add_argument("--events-endpoint", default=None,
                   help="ZMQ PUB endpoint: tcp://*:PORT binds, tcp://HOST:PORT connects (to a central EPP)")
    p.add_argument("--replay-endpoint", default=None, help="ZMQ replay ROUTER endpoint (binds)")
    p.add_argument("--vllm-events-endpoint", default=None,
                   help="the replica's own KV-event PUB (tcp://127.0.0.1:5557): learns which blocks each "
                   "chunk file holds, so removals fan out like vLLM's (needed with --offload-block-size)")
    p.add_argument("--vllm-replay-endpoint", default=None, help="the replica's replay ROUTER, read once at start")
    p.add_argument("--bytes-hashes", action="store_true",
                   help="publish raw digest bytes (vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)")
    p.add_argument("--http-host", default="0.0.0.0")
    p.add_argument("--http-port", type=int, default=9400, help="/metrics, /ready, /status")
    p.add_argument("--log-level", default="INFO")
    return p


async def serve(args: argparse.Namespace, stop: asyncio.Event | None = None) -> None:
    """Run manager + HTTP server until `stop` is set (or SIGTERM/SIGINT)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    handled = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread, or no signal support: the caller's `stop` still works
    config = DiskTierConfig(
        root=args.root, budget_bytes=args.budget_bytes, high_watermark=args.high_watermark,
        low_watermark=args.low_watermark, interval_s=args.interval, min_age_s=args.min_age,
        stale_temp_s=args.stale_temp, access_clock=args.access_clock, int_hashes=not args.bytes_hashes,
    )
    publisher = None
    if args.events_endpoint:
        publisher = KVEventPublisher(args.events_endpoint, replay_endpoint=args.replay_endpoint, topic=args.topic)
    metrics = DiskTierMetrics()
    membership = ChunkMembership(registry=metrics.registry) if args.vllm_events_endpoint else None
    watcher = None
    if args.access_watch:
        # Every open of a block file (vLLM loading it) is an access, whatever the mount's atime policy.
        watcher = AccessWatcher(config.root, lambda relpath: manager.record_access(relpath))
        if not watcher.start():
            watcher = None
    manager = DiskTierManager(config, publisher, metrics=metrics, membership=membership, watcher=watcher)
    follower = None
    if membership is not None:
        follower = asyncio.create_task(follow_vllm_events(
            membership, args.vllm_events_endpoint, stop, topic=args.topic,
            replay_endpoint=args.vllm_replay_endpoint))
    runner = web.AppRunner(build_app(manager), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.http_host, args.http_port).start()
    logging.getLogger(__name__).info(
        "disk manager on %s: budget %d bytes, events %s, http %s:%d", config.root, config.budget_bytes,
        publisher.bound_endpoint if publisher else "off", args.http_host, args.http_port)
    try:
        await manager.run(stop)
    finally:
        if follower is not None:
            await follower
        await runner.cleanup()
        if watcher is not None:
            watcher.close()
        if publisher is not None:
            publisher.close()
        for sig in handled:
            loop.remove_signal_handler(sig)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `epp engine disk-manager`."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        DiskTierConfig(root=args.root, budget_bytes=args.budget_bytes, high_watermark=args.high_watermark,
                       low_watermark=args.low_watermark)
    except ValueError as exc:
        print(f"epp engine disk-manager: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
