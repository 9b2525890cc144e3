"""Fixtures for the simulator tests: the tiny model's tokenizer and KV-event subscribers."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

from epp.engine.sim.fleet import default_tokenizer_dir
from epp.engine.sim.tokenizer import SimTokenizer


@pytest.fixture(scope="session")
def tokenizer_dir() -> str:
    return default_tokenizer_dir()


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir) -> SimTokenizer:
    return SimTokenizer(tokenizer_dir)


class EventSubscriber:
    """A plain pyzmq SUB + msgspec decoder, independent of the publisher's own types."""

    def __init__(self, endpoint: str, topic: str = "") -> None:
        self.ctx = zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sock.connect(endpoint)
        self.messages: list[tuple[str, int, list]] = []  # (topic, seq, batch)

    async def ready(self, timeout: float = 5.0) -> None:
        """Wait until the connection is up and the subscription had time to reach the PUB.

        A PUB drops what it sends before a subscriber joined (ZMQ's slow joiner), and on this
        machine a loopback connection can take several hundred milliseconds.
        """
        from zmq.utils.monitor import parse_monitor_message

        msg = parse_monitor_message(await asyncio.wait_for(self._monitor.recv_multipart(), timeout))
        assert msg["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        # A ZMQ socket attaches a new connection (and sends its subscription) only when the
        # application calls into it; poll once, then give the PUB time to apply it.
        await self.sock.poll(50)
        await asyncio.sleep(0.15)

    async def recv(self, timeout: float = 2.0) -> tuple[str, int, list]:
        frames = await asyncio.wait_for(self.sock.recv_multipart(), timeout)
        assert len(frames) == 3, frames
        topic, seq, payload = frames
        assert len(seq) == 8
        msg = (topic.decode(), int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload))
        self.messages.append(msg)
        return msg

    async def drain(self, quiet: float = 0.3) -> list[tuple[str, int, list]]:
        """Receive until nothing arrives for `quiet` seconds."""
        out = []
        while True:
            try:
                out.append(await self.recv(quiet))
            except TimeoutError:
                return out

    def events(self) -> list[dict]:
        return [ev for _, _, batch in self.messages for ev in batch[1]]

    def close(self) -> None:
        self.sock.disable_monitor()
        self._monitor.close(0)
        self.sock.close(0)


@pytest.fixture
def subscriber_factory():
    subs: list[EventSubscriber] = []

    def make(endpoint: str, topic: str = "") -> EventSubscriber:
        s = EventSubscriber(endpoint, topic)
        subs.append(s)
        return s

    yield make
    for s in subs:
        s.close()
