"""A test KV-event publisher speaking vLLM's wire protocol: PUB `[topic, seq8, payload]` plus a
replay ROUTER answering `[id, b"", start8]` with `[id, b"", topic, seq8, payload]`... and the end
marker `[id, b"", b"", 0xFF*8, b""]`. It can hold back live messages (to make gaps), restart
(sequence back to 0, buffer emptied) and keep only the last N batches (to make repair fail)."""

from __future__ import annotations

import asyncio
from collections import deque

import zmq
import zmq.asyncio

from tests.kvevents import wire

END_SEQ = b"\xff" * 8


class FakePublisher:
    def __init__(self, topic: str, *, replay: bool = True, buffer_steps: int = 10_000,
                 connect_to: str | None = None) -> None:
        self.topic = topic.encode()
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if connect_to:  # centralized mode: the replica dials the EPP
            self.pub.connect(connect_to)
            self.port = None
        else:
            self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = None
        self.replay_port = None
        self.replay_requests = 0
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self._task = asyncio.ensure_future(self._serve_replay()) if replay else None

    async def publish(self, events, *, send: bool = True) -> int:
        """Publish one batch (or only buffer it when `send` is False, to make a gap)."""
        seq = self.seq
        self.seq += 1
        payload = wire.encode_batch(list(events))
        self.buffer.append((seq, payload))
        if send:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    async def heartbeat_until(self, condition, timeout: float = 5.0) -> None:
        """Send empty batches until `condition()` holds (ZMQ subscriptions join late)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not condition():
            if loop.time() > deadline:
                raise TimeoutError("subscriber never saw the publisher")
            await self.publish([])
            await asyncio.sleep(0.02)

    def restart(self) -> None:
        self.seq = 0
        self.buffer.clear()

    async def _serve_replay(self) -> None:
        while True:
            ident, _empty, start = await self.router.recv_multipart()
            self.replay_requests += 1
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first:
                    await self.router.send_multipart([ident, b"", self.topic, seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([ident, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.ctx.destroy(linger=0)
