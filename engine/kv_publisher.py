"""KV-cache events in vLLM's exact wire format: a ZMQ PUB publisher with a ROUTER replay socket.

Wire format (vLLM 0.33 `vllm/distributed/kv_events.py`):
- live messages are 3 frames: topic, 8-byte big-endian sequence number (from 0), msgpack payload;
- the payload is the batch array ``[ts, [events], dp_rank]``;
- each event is a msgpack map tagged under ``"type"`` (``BlockStored`` / ``BlockRemoved`` /
  ``AllBlocksCleared``); ``legacy_array_events=True`` emits the older tagged-array form instead;
- a DEALER that sends ``[b"", start_seq(8B)]`` to the replay ROUTER receives
  ``[b"", topic, seq, payload]`` for every buffered batch with ``seq >= start`` and then the end
  marker ``[b"", b"", 0xFF*8, b""]``.

All socket work happens on one dedicated thread (ZMQ sockets are not thread-safe), woken by a
pipe, so ``publish`` never blocks the caller's event loop and may be called from any thread.
"""

from __future__ import annotations

import collections
import errno
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

log = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
# vLLM's filesystem / object secondary tiers report this medium (MEDIUM_STORAGE).
MEDIUM_STORAGE = "STORAGE"

END_SEQ = (-1).to_bytes(8, "big", signed=True)

ExternalBlockHash = bytes | int


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Full blocks newly cached on `medium`; the first seven fields are always encoded."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks evicted from `medium`."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Every block of the publisher is gone (prefix-cache reset, sleep level >= 1)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The positional batch envelope ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


_LEGACY_FIELDS = {
    "BlockStored": [
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    ],
    "BlockRemoved": ["block_hashes", "medium", "group_idx"],
    "AllBlocksCleared": [],
}


def legacy_array_form(event: KVEvent) -> list[Any]:
    """The pre-2026 tagged-array encoding: ``[tag, field1, field2, ...]`` in declaration order."""
    tag = type(event).__name__
    values = [getattr(event, name) for name in _LEGACY_FIELDS[tag]]
    while values and values[-1] is None and len(values) > _required_len(tag):
        values.pop()
    return [tag, *values]


def _required_len(tag: str) -> int:
    return {"BlockStored": 7, "BlockRemoved": 2, "AllBlocksCleared": 0}[tag]


def kv_topic(host: str, port: int, model: str) -> str:
    """The llm-d topic convention ``kv@<ip:port>@<model>`` that names the serving endpoint."""
    return f"kv@{host}:{port}@{model}"


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's heuristic: bind for wildcards and ipc/inproc endpoints, connect otherwise."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _bind(sock: zmq.Socket, endpoint: str, wait_s: float = 2.0) -> None:
    """Bind, waiting out a socket on the same address that is still closing (a restarted publisher).

    ZMQ closes sockets on its I/O thread after `close()` returns, so a publisher that replaces
    one on the same port can find the port still taken for a few milliseconds.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise
            time.sleep(0.02)


class KVEventPublisher:
    """Publishes KV-event batches on ZMQ PUB (+ optional ROUTER replay), from a worker thread.

    `endpoint` binds or connects like vLLM (``tcp://127.0.0.1:*`` binds an ephemeral port; see
    `bound_endpoint`) unless `bind` forces the choice. The replay socket, when given, always binds. `buffer_steps` bounds the
    in-memory replay buffer (in batches); `max_queue_size` bounds pending batches (extra ones are
    dropped and counted in `dropped`).
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        data_parallel_rank: int = 0,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        legacy_array_events: bool = False,
        bind: bool | None = None,
    ) -> None:
        self.topic = topic
        self._topic_bytes = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self.legacy_array_events = legacy_array_events
        self._encoder = msgspec.msgpack.Encoder()
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._seq = itertools.count()
        self.published = 0
        self.dropped = 0
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if is_bind_endpoint(endpoint) if bind is None else bind:
            _bind(self._pub, endpoint)
            self.bound_endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._pub.connect(endpoint)
            self.bound_endpoint = endpoint
        self._router: zmq.Socket | None = None
        self.replay_bound_endpoint: str | None = None
        if replay_endpoint is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
            _bind(self._router, replay_endpoint)
            self.replay_bound_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        """The TCP port of the PUB socket (bound endpoints only)."""
        return int(self.bound_endpoint.rsplit(":", 1)[1])

    @property
    def replay_port(self) -> int | None:
        """The TCP port of the replay ROUTER, if any."""
        return None if self.replay_bound_endpoint is None else int(self.replay_bound_endpoint.rsplit(":", 1)[1])

    def encode(self, events: Sequence[KVEvent], ts: float | None = None) -> bytes:
        """Encode one batch payload exactly as vLLM does."""
        evs: list[Any] = [legacy_array_form(e) for e in events] if self.legacy_array_events else list(events)
        batch = KVEventBatch(ts=time.time() if ts is None else ts, events=evs,
                             data_parallel_rank=self.data_parallel_rank)
        return self._encoder.encode(batch)

    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> None:
        """Queue one batch for sending; never blocks (drops and counts when the queue is full)."""
        if not events or self._closing:
            return
        payload = self.encode(events, ts)
        try:
            self._queue.put_nowait(payload)
        except queue.Full:
            self.dropped += 1
            return
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already: the thread will drain the queue

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, stop the thread and close the sockets."""
        if self._closing:
            return
        self._closing = True
        self._queue.put(None)
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass
        self._thread.join(timeout)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- worker thread ---------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(1000))
                if self._wake_r in ready:
                    try:
                        os.read(self._wake_r, 65536)
                    except BlockingIOError:
                        pass
                if not self._drain_queue():
                    return
                if self._router is not None and self._router in ready:
                    self._serve_replay()
        except Exception:  # pragma: no cover - a dead publisher must be visible in logs
            log.exception("KV event publisher thread failed")
        finally:
            self._pub.close(0)
            if self._router is not None:
                self._router.close(0)

    def _drain_queue(self) -> bool:
        while True:
            try:
                payload = self._queue.get_nowait()
            except queue.Empty:
                return True
            if payload is None:
                return False
            seq = next(self._seq)
            seq_bytes = seq.to_bytes(8, "big")
            self._pub.send_multipart((self._topic_bytes, seq_bytes, payload), copy=False)
            self._buffer.append((seq, payload))
            self.published += 1

    def _serve_replay(self) -> None:
        assert self._router is not None
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("ignoring malformed KV replay request with %d frames", len(frames))
                continue
            client_id, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._router.send_multipart(
                        (client_id, b"", self._topic_bytes, seq.to_bytes(8, "big"), payload))
            self._router.send_multipart((client_id, b"", b"", END_SEQ, b""))
