"""ZMQ subscriber for vLLM KV events: in-order application per endpoint, gap and restart repair.

Modes:
- centralized: the EPP binds one SUB socket; every replica's publisher connects to it. The
  endpoint of a message comes from its topic `kv@<ip:port>@<model>` (an IP-only pod id is
  resolved when exactly one endpoint of the pool has that address). A SUB socket cannot tell
  which publisher sent a message, so vLLM's default empty topic `""` cannot work here: such
  messages are dropped, counted in `epp_kv_events_unresolved_topics_total` and named in a
  warning (set each replica's `--kv-events-config` topic to `kv@<ip:port>@<model>`, or use
  per-endpoint mode).
- per-endpoint: the EPP dials `tcp://<endpoint address>:<events port>` for every endpoint of
  the registry, following its listener callbacks as endpoints come and go. The socket it
  dialled names the endpoint, so any topic works, vLLM's default `""` included (the model
  then comes from `default_model`).

Ordering: each publisher's sequence numbers must be contiguous. When an endpoint appears (also
at the picker's start, so a restarted picker rebuilds its view without waiting for traffic), on
first contact, on a gap and on a restart (sequence goes back) the subscriber asks the replica's
replay socket (ROUTER) for the missed batches with a DEALER (`[b"", start_seq]` → `[b"", topic, seq, payload]`... until the
end marker), holding live messages meanwhile. A gap that cannot be repaired (no replay socket,
timeout, the cooldown after a failed replay, or the publisher no longer buffers the missing batches) drops that
endpoint's entries, counted in `epp_kv_events_endpoint_resets_total`.
Per-endpoint event ports come from the endpoint labels `kv-events-port` / `kv-replay-port`
when present (several replicas on one host), else from the configured ports; with `rankPortBase`
(data-parallel ranks served on consecutive ports, vLLM's external load balancing) the endpoint of
rank r (port rankPortBase + r, r < ranksPerHost) uses the configured ports + r, as vLLM offsets them.

A replica may have a second publisher: the disk-tier manager (engine/disk_tier) publishes the
BlockRemoved events of the disk files it deletes, on the replica's topic but with sequence
numbers of its own. In per-endpoint mode the label `kv-disk-events-port` makes the subscriber
dial it too, as a secondary stream of that endpoint: ordered on its own, and its gaps or
restarts never clear what the engine's stream built (a lost removal only leaves a disk entry
stale until the engine reports the block again or it ages out).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import xxhash
import zmq
import zmq.asyncio

from epp.kvevents.backend import KVIndexBackend
from epp.kvevents.decoding import (
    KVEventDecodeError,
    Topic,
    decode_batch,
    parse_topic,
    pod_endpoint_name,
    pod_host,
)
from epp.kvevents.index import DEFAULT_POOL
from epp.kvevents.metrics import KVSubscriberMetrics

if TYPE_CHECKING:  # pragma: no cover
    from epp.datalayer.registry import EndpointRegistry
    from epp.framework.types import Endpoint

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8
LABEL_EVENTS_PORT = "kv-events-port"
LABEL_REPLAY_PORT = "kv-replay-port"
LABEL_DISK_EVENTS_PORT = "kv-disk-events-port"
# The P/D role label (llm-d's): the index files an endpoint's blocks under this pool.
LABEL_ROLE = "llm-d.ai/role"
SECONDARY_SUFFIX = "|disk"
MODES = ("centralized", "per-endpoint")


@dataclass
class SubscriberConfig:
    """How to reach the publishers, and the limits of repair."""

    mode: str = "per-endpoint"
    bind_endpoint: str = "tcp://*:5557"  # centralized mode
    events_port: int = 5557  # per-endpoint mode
    replay_port: int | None = None  # replay ROUTER port on every replica; None: no repair
    topic_filter: str = ""
    default_model: str | None = None  # model of events whose topic names none
    replay_timeout_s: float = 10.0
    replay_cooldown_s: float = 30.0
    max_pending_messages: int = 10_000
    max_replay_messages: int = 20_000
    apply_budget_s: float = 0.005  # yield the event loop after this much work

    # Data-parallel ranks served on consecutive ports (vLLM external load balancing): the endpoint on
    # port rank_port_base + r publishes on events_port + r (and replays on replay_port + r), as vLLM
    # offsets its KV-event sockets by the rank. None: every endpoint uses the ports as given.
    rank_port_base: int | None = None
    ranks_per_host: int = 1

    shard: int = 0  # with a shared (Redis) index: apply only the endpoints of this shard...
    shards: int = 1  # ...of this many (by a hash of the endpoint name); 1: every endpoint

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not 0 <= self.shard < self.shards:
            raise ValueError(f"shard must be in [0, {self.shards}), got {self.shard}")

    def rank_offset(self, endpoint: Endpoint) -> int:
        """The endpoint's data-parallel rank on its host (0 without rank ports, or outside their range)."""
        if self.rank_port_base is None:
            return 0
        rank = endpoint.port - self.rank_port_base
        return rank if 0 <= rank < self.ranks_per_host else 0

    def owns(self, endpoint: str) -> bool:
        """Whether this subscriber applies `endpoint`'s events (its shard of the pool)."""
        return self.shards == 1 or xxhash.xxh64_intdigest(endpoint.encode()) % self.shards == self.shard


def _endpoint_of(stream_key: str) -> str:
    """The endpoint a stream key belongs to (a secondary stream's key carries a suffix)."""
    return stream_key.split(SECONDARY_SUFFIX, 1)[0]


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _label_port(endpoint: Endpoint | None, label: str, default: int | None) -> int | None:
    if endpoint is not None:
        value = endpoint.labels.get(label)
        if value and value.isdigit():
            return int(value)
    return default


@dataclass
class _Stream:
    """One publisher's ordering state."""

    endpoint: str
    replay_address: str | None
    key: str = ""  # the stream's own name: the endpoint, or endpoint + SECONDARY_SUFFIX
    primary: bool = True  # the engine's own publisher (its restart means an empty cache)
    last_seq: int | None = None
    repairing: bool = False
    pending: list[tuple[int, bytes, bytes]] = field(default_factory=list)
    last_failed_replay_at: float = float("-inf")
    warned_no_model: bool = False

    def __post_init__(self) -> None:
        self.key = self.key or self.endpoint


class _Listener:
    """One SUB socket read from the event loop's reader callback.

    Not `await sock.recv_multipart()`: every awaited receive builds and resolves a Future, and a replica
    publishes a message per engine step (a 1k-token answer alone is 62 of them); reading what is there
    in the reader callback costs about 30 % less CPU a message (bench/notes/2026-12-round4-measurements.md).
    """

    def __init__(self, sock: zmq.asyncio.Socket, loop: asyncio.AbstractEventLoop, budget_s: float,
                 on_message: Callable[[list[bytes]], None]) -> None:
        self.sock = sock
        self._ready = zmq.Socket.shadow(sock.underlying)  # plain non-blocking reads of the same socket
        self.fd: int = self._ready.getsockopt(zmq.FD)
        self._loop = loop
        self._budget_s = budget_s
        self._on_message = on_message
        self.closed = False

    def drain(self) -> None:
        """Apply every message waiting, yielding the loop after `budget_s` of work (the rest is read next)."""
        deadline = time.perf_counter() + self._budget_s
        ready = self._ready
        while not self.closed:
            try:  # asked first: a failed non-blocking read raises, which costs more than asking
                if not ready.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    return
                frames = ready.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                if not self.closed:
                    log.warning("KV event socket error: %s", exc)
                    self._loop.call_later(0.1, self.drain)
                return
            self._on_message(frames)
            if time.perf_counter() > deadline:
                self._loop.call_soon(self.drain)  # the FD will not signal what is already waiting
                return

    def close(self) -> None:
        """Stop reading and close the socket (the reader goes first: a closed FD's number is reused)."""
        if not self.closed:
            self.closed = True
            self._loop.remove_reader(self.fd)
            self.sock.close(linger=0)


class KVEventSubscriber:
    """Receives KV-event batches over ZMQ and applies them, in order, to a KV index backend."""

    def __init__(self, index: KVIndexBackend, config: SubscriberConfig,
                 endpoints: EndpointRegistry | None = None,
                 metrics: KVSubscriberMetrics | None = None) -> None:
        self.index = index
        self.config = config
        self.registry = endpoints
        self.metrics = metrics or KVSubscriberMetrics(None)
        self._live_messages = self.metrics.messages.labels("live")  # counted per message: the child kept
        self._ctx: zmq.asyncio.Context | None = None
        self._streams: dict[str, _Stream] = {}
        self._sockets: dict[str, _Listener] = {}
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False
        self._last_yield = time.perf_counter()
        self.bound_address: str | None = None  # centralized mode: the resolved bind address
        self._warned_topics: set[bytes] = set()  # unresolvable topics already logged (bounded)

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the sockets and follow the endpoint registry."""
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.asyncio.Context()
        self._running = True
        if self.config.mode == "centralized":
            sock = self._sub_socket()
            sock.bind(self.config.bind_endpoint)
            self.bound_address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._sockets[""] = self._listen(sock, None)
            self.metrics.subscriptions.set(1)
        if self.registry is not None:
            self.registry.add_listener(self._on_endpoints_changed)
        self._reconcile()

    async def stop(self) -> None:
        """Close every socket and cancel every task."""
        self._running = False
        for listener in self._sockets.values():
            listener.close()
        self._sockets.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        self.metrics.subscriptions.set(0)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _sub_socket(self) -> zmq.asyncio.Socket:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt_string(zmq.SUBSCRIBE, self.config.topic_filter)
        return sock

    # ---- endpoints -----------------------------------------------------------------------------
    def _on_endpoints_changed(self, added: Iterable[Endpoint], removed: Iterable[Endpoint]) -> None:
        if self._running and self._loop is not None:
            self._loop.call_soon_threadsafe(self._reconcile)

    def _reconcile(self) -> None:
        """Match subscriptions and index state to the registry's current endpoints."""
        if not self._running or self.registry is None or not getattr(self.registry, "synced", True):
            return
        current = {ep.name: ep for ep in self.registry.snapshot()}
        for name in [n for n in self._streams if n not in current]:
            self._forget(name)
        for name in [n for n in self.index.endpoints() if n not in current]:
            self.index.remove_endpoint(name)
        for name, ep in current.items():
            self.index.set_pool(name, ep.labels.get(LABEL_ROLE, DEFAULT_POOL))
        current = {name: ep for name, ep in current.items() if self.config.owns(name)}
        if self.config.mode == "per-endpoint":
            for key in [k for k in self._sockets if _endpoint_of(k) not in current]:
                self._forget(_endpoint_of(key))
            for name, ep in current.items():
                self._dial(name, _label_port(ep, LABEL_EVENTS_PORT,
                                             self.config.events_port + self.config.rank_offset(ep)), ep)
                disk_port = _label_port(ep, LABEL_DISK_EVENTS_PORT, None)
                if disk_port is not None:
                    self._dial(name + SECONDARY_SUFFIX, disk_port, ep)
            self.metrics.subscriptions.set(len(self._sockets))
        for name in current:
            if name not in self._streams:
                self._catch_up(name)

    def _dial(self, key: str, port: int | None, ep: Endpoint) -> None:
        """Connect one SUB socket to a publisher of `ep`, once per stream key."""
        if key in self._sockets or port is None:
            return
        sock = self._sub_socket()
        sock.connect(_tcp(ep.address, port))
        self._sockets[key] = self._listen(sock, key)

    def _catch_up(self, name: str) -> None:
        """Replay a newly known endpoint's buffered history now, not at its next event.

        A picker that starts (or restarts) while the replicas are idle would otherwise know
        nothing of their caches until each happens to publish again.
        """
        replay_address = self._replay_address(name, None)
        if replay_address is None:
            return
        stream = self._streams[name] = _Stream(name, replay_address)
        stream.repairing = True
        self._spawn(self._repair(stream, 0, "startup"))

    def _forget(self, name: str) -> None:
        for key in (name, name + SECONDARY_SUFFIX):
            listener = self._sockets.pop(key, None)
            if listener is not None:
                listener.close()
            self._streams.pop(key, None)
        self.index.remove_endpoint(name)

    def _resolve(self, pod: str | None) -> str | None:
        """The endpoint name a centralized-mode topic's pod id stands for."""
        if pod is None:
            return None
        if Topic(pod, None).has_port:
            return pod_endpoint_name(pod)
        if self.registry is not None:
            host = pod_host(pod)
            names = [ep.name for ep in self.registry.snapshot() if ep.address == host]
            if len(names) == 1:
                return names[0]
        return None

    def _replay_address(self, endpoint: str, pod: str | None) -> str | None:
        ep = self.registry.get(endpoint) if self.registry is not None else None
        replay = self.config.replay_port
        if replay is not None and ep is not None:
            replay += self.config.rank_offset(ep)
        port = _label_port(ep, LABEL_REPLAY_PORT, replay)
        if port is None:
            return None
        host = ep.address if ep is not None else pod_host(pod or endpoint.rsplit(":", 1)[0])
        return _tcp(host, port)

    # ---- receiving -----------------------------------------------------------------------------
    def _listen(self, sock: zmq.asyncio.Socket, endpoint: str | None) -> _Listener:
        """Apply `sock`'s messages as they arrive; `endpoint`: its stream key (None: centralized, by topic)."""
        assert self._loop is not None
        listener = _Listener(sock, self._loop, self.config.apply_budget_s, self._on_message(endpoint))
        self._loop.add_reader(listener.fd, listener.drain)
        self._loop.call_soon(listener.drain)  # what arrived before the reader was added: the FD signals changes only
        return listener

    def _on_message(self, endpoint: str | None) -> Callable[[list[bytes]], None]:
        """What a listener calls with each message of the stream `endpoint` (None: centralized, by topic)."""
        def on_message(frames: list[bytes]) -> None:
            try:
                self.handle_message(frames, endpoint)
            except Exception:  # one bad message must not end the subscription
                self.metrics.decode_errors.inc()
                log.exception("KV event message from %s could not be applied", endpoint or "centralized socket")
        return on_message

    async def _maybe_yield(self) -> None:
        now = time.perf_counter()
        if now - self._last_yield > self.config.apply_budget_s:
            await asyncio.sleep(0)
            self._last_yield = time.perf_counter()

    def handle_message(self, frames: list[bytes], endpoint: str | None = None) -> None:
        """One live message `[topic, seq, payload]`; `endpoint` (a stream key) is known in per-endpoint mode."""
        if len(frames) != 3 or len(frames[1]) < 8:
            self.metrics.decode_errors.inc()
            return
        topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes[:8], "big")
        if endpoint is None:
            pod = parse_topic(topic).pod
            endpoint = self._resolve(pod)
            if endpoint is None:
                self.metrics.unresolved.inc()
                self._warn_unresolved(topic, pod)
                return
            if not self.config.owns(endpoint):
                return  # another shard's subscriber applies it
        else:
            pod = None
        stream = self._streams.get(endpoint)
        if stream is None:
            name = _endpoint_of(endpoint)
            primary = name == endpoint
            replay = self._replay_address(name, pod) if primary else None
            stream = self._streams[endpoint] = _Stream(name, replay, key=endpoint, primary=primary)
        self._live_messages.inc()
        self._on_live(stream, seq, topic, payload)

    def _warn_unresolved(self, topic: bytes, pod: str | None) -> None:
        """Say once per topic (at most 16) why centralized mode drops its messages."""
        if topic in self._warned_topics or len(self._warned_topics) >= 16:
            return
        self._warned_topics.add(topic)
        if pod is None:
            log.warning("centralized KV events on topic %r dropped: the topic does not say which replica sent "
                        "them (vLLM's default topic is empty); publish on kv@<ip:port>@<model> "
                        "(vllm serve --kv-events-config '{\"topic\": \"kv@<ip:port>@<model>\", ...}') or use "
                        "mode: per-endpoint, which knows the replica from the socket it dials", topic)
        else:
            log.warning("centralized KV events on topic %r dropped: %r is no endpoint of the pool", topic, pod)

    def _on_live(self, stream: _Stream, seq: int, topic: bytes, payload: bytes) -> None:
        if stream.repairing:
            stream.pending.append((seq, topic, payload))
            if len(stream.pending) > self.config.max_pending_messages:
                # Repair is too slow to keep up: give up on this endpoint's history.
                stream.pending.clear()
                self._reset(stream, "pending_overflow")
            return
        last = stream.last_seq
        if last is None:
            if self._can_replay(stream):
                self._start_repair(stream, 0, "initial", (seq, topic, payload))
                return
        elif seq <= last:
            self.metrics.restarts.inc()
            stream.last_seq = None
            if not stream.primary:  # a restarted disk manager says nothing about the engine's cache
                self._apply(stream, seq, topic, payload)
                return
            self.index.clear_endpoint(stream.endpoint)  # a restarted engine starts with an empty cache
            if self._can_replay(stream):
                self._start_repair(stream, 0, "restart", (seq, topic, payload))
                return
        elif seq != last + 1:
            self.metrics.gaps.inc()
            if not stream.primary:  # lost removals leave stale disk entries; never drop the engine's view
                self._apply(stream, seq, topic, payload)
                return
            if self._can_replay(stream):
                self._start_repair(stream, last + 1, "gap", (seq, topic, payload))
                return
            self._reset(stream, "gap_unrepairable")
        self._apply(stream, seq, topic, payload)

    def _apply(self, stream: _Stream, seq: int, topic: bytes, payload: bytes) -> None:
        stream.last_seq = seq
        try:
            batch = decode_batch(payload)
        except KVEventDecodeError as exc:
            self.metrics.decode_errors.inc()
            log.debug("undecodable KV event batch from %s: %s", stream.endpoint, exc)
            return
        model = parse_topic(topic).model or self.config.default_model
        if model is None and not stream.warned_no_model:
            # Request keys are seeded by the model name; without one nothing will ever match.
            stream.warned_no_model = True
            log.warning("KV events of %s name no model (topic %r) and no default model is configured: "
                        "use a kv@<ip:port>@<model> topic or set defaultModel", stream.endpoint, topic)
        self.index.apply_batch(stream.endpoint, batch, model)

    def _reset(self, stream: _Stream, reason: str) -> None:
        self.metrics.resets.labels(reason).inc()
        self.index.clear_endpoint(stream.endpoint)
        stream.last_seq = None
        log.warning("KV events of %s could not be repaired (%s): entries dropped", stream.endpoint, reason)

    # ---- repair --------------------------------------------------------------------------------
    def _can_replay(self, stream: _Stream) -> bool:
        return (stream.replay_address is not None
                and time.monotonic() - stream.last_failed_replay_at >= self.config.replay_cooldown_s)

    def _start_repair(self, stream: _Stream, start: int, kind: str, held: tuple[int, bytes, bytes]) -> None:
        stream.repairing = True
        stream.pending = [held]
        self._spawn(self._repair(stream, start, kind))

    async def _repair(self, stream: _Stream, start: int, kind: str) -> None:
        try:
            replayed = await asyncio.wait_for(self.fetch_replay(stream.replay_address, start),
                                              self.config.replay_timeout_s)
        except asyncio.CancelledError:
            raise
        except (TimeoutError, zmq.ZMQError, OSError) as exc:
            log.warning("KV event replay from %s failed: %r", stream.replay_address, exc)
            replayed = None
        if self._streams.get(stream.key) is not stream:
            return  # the endpoint left meanwhile
        ok = replayed is not None and (kind != "gap" or (replayed and replayed[0][0] == start))
        if not ok:
            self.metrics.replays.labels("failed").inc()
            if kind != "startup":
                # No second try until the cooldown ends. (A replica not reachable at discovery gets
                # its ordinary first-contact replay once its events flow.)
                stream.last_failed_replay_at = time.monotonic()
            if kind == "gap":
                self._reset(stream, "gap_unrepairable")
        else:
            expected = start if kind == "gap" else None
            for seq, topic, payload in replayed:
                if expected is not None and seq != expected:
                    self._reset(stream, "replay_incomplete")
                    break
                self.metrics.messages.labels("replay").inc()
                self._apply(stream, seq, topic, payload)
                expected = seq + 1
                await self._maybe_yield()
            # Counted once applied (the loop may yield): a reader of the counter sees the repaired index.
            self.metrics.replays.labels("ok").inc()
        pending, stream.pending = stream.pending, []
        stream.repairing = False
        for seq, topic, payload in pending:
            if stream.last_seq is not None and seq <= stream.last_seq and not stream.repairing:
                continue  # already applied from the replay
            self._on_live(stream, seq, topic, payload)

    async def fetch_replay(self, address: str, start: int) -> list[tuple[int, bytes, bytes]]:
        """Ask a replay ROUTER for every buffered batch with seq >= `start`, until the end marker."""
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes, bytes]] = []
        try:
            sock.connect(address)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while len(out) < self.config.max_replay_messages:
                frames = await sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3:
                    topic, seq_bytes, payload = frames
                elif len(frames) == 2:  # vLLM before #45177 sent no topic frame
                    topic, (seq_bytes, payload) = b"", frames
                else:
                    continue
                if seq_bytes == END_SEQ:
                    break
                if len(seq_bytes) < 8:
                    continue
                out.append((int.from_bytes(seq_bytes[:8], "big"), topic, payload))
        finally:
            sock.close(linger=0)
        out.sort(key=lambda m: m[0])
        return out
