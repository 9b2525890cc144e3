"""A picker's peer link: publishes its decisions to every subscribed peer and applies theirs.

Full mesh over the protocol in `proto/epp/peer/v1/peer.proto`: every picker serves
`PickerPeers` and subscribes to each peer it is told of, so no picker is special and any may die.
Publishing costs the hot path one tuple appended per subscriber; a sender task per subscriber
batches them into messages. Staleness is bounded by the event loop and the network: decisions are
sent as soon as the loop runs the sender, at most one batch per `flush_interval_s` (1 ms) so a burst
is batched while a decision after a quiet interval is not held back; a subscriber that cannot keep
up loses the oldest (`epp_peer_decisions_dropped_total`; it sees the gap in sequence numbers),
never blocking the publisher or growing its memory. Each batch carries
when its oldest decision was made, and the receiver records how old it was on arrival
(`epp_peer_decision_staleness_seconds`): the measured bound on how far a peer's view lags. A
picker that starts late subscribes first, then asks one peer for a snapshot, applies it, then the
decisions that arrived meanwhile.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import xxhash
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from epp.framework.sharing import (
    ClaimLearner,
    DecisionSharing,
    LoadLearner,
    PrefixLearner,
    PrefixSnapshotter,
    PromptTokensLearner,
)
from epp.framework.types import EndpointMetrics
from epp.peer.ledger import SharedInflightLedger
from epp.peer.v1 import peer_pb2 as pb
from epp.peer.v1 import peer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
_BATCH = 512  # decisions per message at most
_SNAPSHOT_CHUNK = 32_768  # hashes per snapshot message at most (256 KiB)
# A peer that is down now is retried within seconds: gRPC's own reconnect backoff (up to 120 s) and
# its process-wide subchannel sharing would otherwise keep a restarted peer unheard for minutes.
_CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1), ("grpc.initial_reconnect_backoff_ms", 200),
                    ("grpc.min_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000),
                    ("grpc.max_receive_message_length", 16 * 1024 * 1024)]


# A decision as the hot path records it: its protobuf message is built by the sender task, off the
# request's path (one tuple per decision, shared by every subscriber's outbox).
_Pending = tuple[int, Any, Any, Any]  # (kind, a, b, c)
_ROUTED, _BOOKED, _RELEASED, _CLAIMED, _COUNTED, _LOADED = 0, 1, 2, 3, 4, 5
# The `Decision.kind` cases, as the protocol names them (the received counter's label values).
_DECISION_KINDS = tuple(field.name for field in pb.Decision.DESCRIPTOR.oneofs_by_name["kind"].fields)


def _decision(pending: _Pending) -> pb.Decision:
    kind, a, b, c = pending
    if kind == _ROUTED:
        return pb.Decision(prefix_routed=pb.PrefixRouted(endpoint=a, block_hashes=b, capacity=c))
    if kind == _BOOKED:
        return pb.Decision(booked=pb.Booked(ticket=a, endpoint=b, uncached_tokens=c))
    if kind == _CLAIMED:
        return pb.Decision(prefix_claimed=pb.PrefixClaimed(endpoint=a, block_keys=b))
    if kind == _COUNTED:
        return pb.Decision(prompt_tokens_counted=pb.PromptTokensCounted(characters=a, tokens=b))
    if kind == _LOADED:
        m: EndpointMetrics = b
        return pb.Decision(endpoint_load=pb.EndpointLoad(
            endpoint=a, scraped_unix_nanos=c, waiting_requests=m.waiting_queue_size,
            running_requests=m.running_requests_size, kv_cache_usage=m.kv_cache_usage,
            active_models=sorted(m.active_models), waiting_models=sorted(m.waiting_models),
            max_active_models=m.max_active_models, cache_block_size=m.cache_block_size,
            cache_num_blocks=m.cache_num_blocks, prefix_cache_queries=m.prefix_cache_queries,
            prefix_cache_hits=m.prefix_cache_hits, sleeping=m.sleeping))
    return pb.Decision(released=pb.Released(ticket=a, prefill_only=b))


def _endpoint_metrics(load: pb.EndpointLoad) -> EndpointMetrics:
    """A peer's scrape as this picker's snapshot; `update_time` is set by whoever applies it."""
    return EndpointMetrics(
        waiting_queue_size=load.waiting_requests, running_requests_size=load.running_requests,
        kv_cache_usage=load.kv_cache_usage, active_models=frozenset(load.active_models),
        waiting_models=frozenset(load.waiting_models), max_active_models=load.max_active_models,
        cache_block_size=load.cache_block_size, cache_num_blocks=load.cache_num_blocks,
        prefix_cache_queries=load.prefix_cache_queries, prefix_cache_hits=load.prefix_cache_hits,
        sleeping=load.sleeping)


class _Outbox:
    """One subscriber's queue of decisions: bounded, oldest dropped first."""

    __slots__ = ("items", "wake", "dropped", "subscriber", "last_sent")

    def __init__(self, limit: int, subscriber: str) -> None:
        self.items: deque[tuple[int, _Pending, int]] = deque(maxlen=limit)  # (sequence, decision, made at ns)
        self.wake = asyncio.Event()
        self.dropped = 0
        self.subscriber = subscriber
        self.last_sent = float("-inf")  # loop time of the last batch sent


class PeerMetrics:
    """The peer link's series."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        r = registry or CollectorRegistry()
        self.sent = Counter("epp_peer_decisions_sent", "Decisions sent to subscribed peers.", registry=r)
        self.received = Counter("epp_peer_decisions_received", "Peers' decisions applied, by kind.", ["kind"],
                                registry=r)
        self.received_by_kind = {kind: self.received.labels(kind)
                                 for kind in _DECISION_KINDS}
        self.dropped = Counter("epp_peer_decisions_dropped",
                               "Decisions dropped for a subscriber that fell behind (oldest first).", registry=r)
        self.lost = Counter("epp_peer_decisions_lost", "Gaps seen in a peer's decision sequence.", registry=r)
        self.subscribers = Gauge("epp_peer_subscribers", "Peers subscribed to this picker now.", registry=r)
        self.following = Gauge("epp_peer_following", "Peers this picker receives decisions from now.",
                               registry=r)
        self.staleness = Histogram(
            "epp_peer_decision_staleness_seconds",
            "From a peer's decision to its arrival here, for the oldest decision of each batch (the peer's "
            "wall clock against this one's: across hosts it includes their clock offset).",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0), registry=r)
        self.snapshot_blocks = Gauge("epp_peer_snapshot_blocks",
                                     "Prefix blocks learned from a peer's snapshot at start.", registry=r)


class PeerNode(DecisionSharing, pb_grpc.PickerPeersServicer):
    """Serves this picker's decisions on `port` and follows the pickers at `peers` (host:port)."""

    def __init__(self, *, host: str, port: int, peers: Sequence[str], picker_id: str | None = None,
                 outbox_limit: int = 20_000, catch_up_timeout_s: float = 3.0, flush_interval_s: float = 0.001,
                 metrics_registry: CollectorRegistry | None = None) -> None:
        self.host = host
        self.port = port
        self.peers = [p for p in peers if p]
        self.picker_id = picker_id or f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.outbox_limit = outbox_limit
        self.catch_up_timeout_s = catch_up_timeout_s
        # Decisions made within this long go out in one message: a gRPC message costs far more CPU
        # than the decisions in it, and this (plus the network) bounds how stale a peer's view is.
        self.flush_interval_s = flush_interval_s
        self.metrics = PeerMetrics(metrics_registry)
        self.caught_up = asyncio.Event()
        self._outboxes: list[_Outbox] = []
        self._sequence = itertools.count(1)
        self._learner: PrefixLearner | None = None
        self._snapshotter: PrefixSnapshotter | None = None
        self._claim_learner: ClaimLearner | None = None
        self._tokens_learner: PromptTokensLearner | None = None
        self._load_learner: LoadLearner | None = None
        self._following: dict[str, str] = {}  # peer address -> its picker id, while its stream is up
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._pending: deque[tuple[str, pb.Decision]] = deque(maxlen=outbox_limit)
        self.ledger: SharedInflightLedger | None = None
        self._expected: dict[str, int] = {}
        self._subscribed: dict[str, asyncio.Event] = {peer: asyncio.Event() for peer in self.peers}
        self.snapshot_source: str | None = None

    # -- DecisionSharing (called by plugins) -------------------------------------------------

    @property
    def has_peers(self) -> bool:
        # Configured peers count before they subscribe: plugins read this once, at start-up.
        return bool(self.peers or self._outboxes)

    def share_prefixes(self, learner: PrefixLearner, snapshotter: PrefixSnapshotter) -> None:
        self._learner, self._snapshotter = learner, snapshotter

    def publish_prefix(self, endpoint: str, hashes: Sequence[int], capacity: int) -> None:
        if not self._outboxes:
            return
        self._publish((_ROUTED, endpoint, hashes, capacity))

    def share_claims(self, learner: ClaimLearner) -> None:
        self._claim_learner = learner

    def publish_claim(self, endpoint: str, keys: Sequence[int]) -> None:
        if self._outboxes:
            self._publish((_CLAIMED, endpoint, keys, None))

    def share_prompt_tokens(self, learner: PromptTokensLearner) -> None:
        self._tokens_learner = learner

    def publish_prompt_tokens(self, characters: int, tokens: int) -> None:
        if self._outboxes:
            self._publish((_COUNTED, characters, tokens, None))

    def scrapes(self, endpoint: str) -> bool:
        # Rendezvous over the pickers this one hears from: a picker that dies or is cut off drops out
        # of every view it was in, and its endpoints move to the next highest rank.
        def rank(picker: str) -> tuple[int, str]:
            return xxhash.xxh64_intdigest(f"{picker}\0{endpoint}".encode()), picker

        own = rank(self.picker_id)
        return all(rank(peer) < own for peer in self._following.values())

    def publish_load(self, endpoint: str, metrics: EndpointMetrics) -> None:
        if self._outboxes:
            self._publish((_LOADED, endpoint, metrics, time.time_ns()))

    def share_loads(self, learner: LoadLearner) -> None:
        self._load_learner = learner

    def publish_booked(self, ticket: int, endpoint: str, uncached_tokens: int) -> None:
        """The own ledger booked a pick (SharedInflightLedger calls this)."""
        if self._outboxes:
            self._publish((_BOOKED, ticket, endpoint, uncached_tokens))

    def publish_released(self, ticket: int, prefill_only: bool) -> None:
        """A booking of the own ledger ended its prefill or ended."""
        if self._outboxes:
            self._publish((_RELEASED, ticket, prefill_only, None))

    def shared_ledger(self, **kwargs: Any) -> SharedInflightLedger:
        """The in-flight ledger for this picker's PluginContext: its bookings go to the peers and theirs come in."""
        self.ledger = SharedInflightLedger(self, **kwargs)
        return self.ledger

    def _publish(self, decision: _Pending) -> None:
        seq = next(self._sequence)
        made_at = time.time_ns()
        for box in self._outboxes:
            if len(box.items) == box.items.maxlen:
                box.dropped += 1
                self.metrics.dropped.inc()
            box.items.append((seq, decision, made_at))
            box.wake.set()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Serve the peer port, follow every peer, and catch up from one of them."""
        self._server = grpc.aio.server(options=[("grpc.max_send_message_length", 16 * 1024 * 1024)])
        pb_grpc.add_PickerPeersServicer_to_server(self, self._server)
        bound = self._server.add_insecure_port(f"{self.host}:{self.port}")
        if bound == 0:
            raise OSError(f"cannot listen on {self.host}:{self.port} (--peer-port)")
        self.port = bound
        await self._server.start()
        for peer in self.peers:
            self._tasks.append(asyncio.create_task(self._follow(peer)))
        self._tasks.append(asyncio.create_task(self._catch_up()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        if self._server is not None:
            await self._server.stop(0)

    # -- serving peers -----------------------------------------------------------------------

    async def Subscribe(self, request: pb.SubscribeRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[pb.DecisionBatch]:
        if request.protocol_version != PROTOCOL_VERSION:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"peer protocol version {request.protocol_version} is not {PROTOCOL_VERSION}")
        box = _Outbox(self.outbox_limit, request.subscriber_id)
        self._outboxes.append(box)
        self.metrics.subscribers.set(len(self._outboxes))
        try:
            # An empty first batch tells the subscriber it is subscribed (it may ask for a snapshot now).
            yield pb.DecisionBatch(protocol_version=PROTOCOL_VERSION, picker_id=self.picker_id,
                                   first_sequence=0)
            loop = asyncio.get_running_loop()
            while True:
                await box.wake.wait()
                # A decision after a quiet interval goes out at once (the peers' view lags by the loop
                # and the network only); within a burst, one batch per interval carries the rest.
                hold = box.last_sent + self.flush_interval_s - loop.time()
                if hold > 0:
                    await asyncio.sleep(hold)
                box.wake.clear()
                box.last_sent = loop.time()
                # Only what is queued now: decisions made while these are written wait for the next turn.
                due = len(box.items)
                while due > 0 and box.items:
                    count = min(_BATCH, due, len(box.items))
                    due -= count
                    first, _, oldest = box.items[0]
                    decisions = [_decision(box.items.popleft()[1]) for _ in range(count)]
                    self.metrics.sent.inc(count)
                    yield pb.DecisionBatch(protocol_version=PROTOCOL_VERSION, picker_id=self.picker_id,
                                           first_sequence=first, decisions=decisions,
                                           oldest_decision_unix_nanos=oldest)
        finally:
            self._outboxes.remove(box)
            self.metrics.subscribers.set(len(self._outboxes))

    async def Snapshot(self, request: pb.SnapshotRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[pb.PrefixSnapshot]:
        if request.protocol_version != PROTOCOL_VERSION:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"peer protocol version {request.protocol_version} is not {PROTOCOL_VERSION}")
        if self._snapshotter is None:
            return
        # Copied before the first yield, so routes made while it streams do not change it under us.
        entries = [(ep, list(hashes), capacity) for ep, hashes, capacity in self._snapshotter()]
        for endpoint, hashes, capacity in entries:
            for start in range(0, max(1, len(hashes)), _SNAPSHOT_CHUNK):
                yield pb.PrefixSnapshot(endpoints=[pb.PrefixRouted(
                    endpoint=endpoint, block_hashes=hashes[start:start + _SNAPSHOT_CHUNK], capacity=capacity)])
                await asyncio.sleep(0)  # a large snapshot must not hold the loop (the hot path shares it)

    # -- following peers ---------------------------------------------------------------------

    async def _follow(self, address: str) -> None:
        """Receive a peer's decisions for as long as this picker runs; reconnect with backoff."""
        backoff = 0.1
        while True:
            following = False
            publisher = ""
            try:
                async with grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS) as channel:
                    stub = pb_grpc.PickerPeersStub(channel)
                    call = stub.Subscribe(pb.SubscribeRequest(protocol_version=PROTOCOL_VERSION,
                                                              subscriber_id=self.picker_id))
                    async for batch in call:
                        if not following:
                            following = True
                            self._following[address] = batch.picker_id
                            self._subscribed[address].set()
                            backoff = 0.1
                            self.metrics.following.inc()
                        publisher = batch.picker_id
                        self._receive(batch)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    log.error("peer %s speaks another protocol version: %s", address, exc.details())
            except Exception:  # a bad message or a bug must not end the link for good
                log.exception("following peer %s failed; reconnecting", address)
            finally:
                self._following.pop(address, None)
                if following:
                    self.metrics.following.dec()
                if publisher and self.ledger is not None:
                    self.ledger.forget_peer(publisher)
            await asyncio.sleep(backoff)
            backoff = min(2.0, backoff * 2)

    def _receive(self, batch: pb.DecisionBatch) -> None:
        if batch.oldest_decision_unix_nanos:
            self.metrics.staleness.observe(max(0, time.time_ns() - batch.oldest_decision_unix_nanos) / 1e9)
        if batch.first_sequence:
            expected = self._expected.get(batch.picker_id)
            if expected is not None and batch.first_sequence != expected:
                self.metrics.lost.inc(max(0, batch.first_sequence - expected))
            self._expected[batch.picker_id] = batch.first_sequence + len(batch.decisions)
        if not self.caught_up.is_set():
            self._pending.extend((batch.picker_id, d) for d in batch.decisions)
            return
        self._apply(batch.picker_id, batch.decisions)

    def _apply(self, picker: str, decisions: Sequence[pb.Decision]) -> None:
        learner, ledger = self._learner, self.ledger
        for decision in decisions:
            kind = decision.WhichOneof("kind")
            counter = self.metrics.received_by_kind.get(kind or "")
            if counter is not None:
                counter.inc()
            if kind == "prefix_routed":
                if learner is not None:
                    route = decision.prefix_routed
                    learner(route.endpoint, route.block_hashes, route.capacity)
            elif kind == "booked":
                if ledger is not None:
                    booked = decision.booked
                    ledger.peer_booked(picker, booked.ticket, booked.endpoint, booked.uncached_tokens)
            elif kind == "released":
                if ledger is not None:
                    ledger.peer_released(picker, decision.released.ticket, decision.released.prefill_only)
            elif kind == "prefix_claimed" and self._claim_learner is not None:
                claim = decision.prefix_claimed
                self._claim_learner(claim.endpoint, claim.block_keys)
            elif kind == "prompt_tokens_counted" and self._tokens_learner is not None:
                counted = decision.prompt_tokens_counted
                self._tokens_learner(counted.characters, counted.tokens)
            elif kind == "endpoint_load" and self._load_learner is not None:
                load = decision.endpoint_load
                self._load_learner(load.endpoint, _endpoint_metrics(load),
                                   max(0, time.time_ns() - load.scraped_unix_nanos) / 1e9)

    async def _catch_up(self) -> None:
        """Apply one peer's snapshot (the first that answers), then what arrived meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.catch_up_timeout_s  # for all peers together: a pool's first picker waits once
        try:
            for address in self.peers:
                try:
                    # Subscribed first: what the peer decides after its snapshot reaches us live.
                    await asyncio.wait_for(self._subscribed[address].wait(), max(0.0, deadline - loop.time()))
                    blocks = await asyncio.wait_for(self._load_snapshot(address), self.catch_up_timeout_s)
                except (grpc.aio.AioRpcError, TimeoutError) as exc:
                    log.info("no snapshot from peer %s: %s", address, exc)
                    continue
                self.snapshot_source = address
                self.metrics.snapshot_blocks.set(blocks)
                log.info("caught up from peer %s: %d prefix blocks", address, blocks)
                break
        finally:
            pending, self._pending = list(self._pending), deque(maxlen=self.outbox_limit)
            for picker, decision in pending:
                self._apply(picker, [decision])
            self.caught_up.set()

    async def _load_snapshot(self, address: str) -> int:
        blocks = 0
        async with grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS) as channel:
            stub = pb_grpc.PickerPeersStub(channel)
            async for chunk in stub.Snapshot(pb.SnapshotRequest(protocol_version=PROTOCOL_VERSION)):
                if self._learner is None:
                    continue
                for route in chunk.endpoints:
                    self._learner(route.endpoint, route.block_hashes, route.capacity)
                    blocks += len(route.block_hashes)
        return blocks
