"""Async load generator: open-loop at a target rate or closed-loop at a concurrency, streaming.

Every request is sent with `stream: true` and read as server-sent events; per request it records
the time to the first generated token (TTFT), the gaps between token chunks (ITL), the
end-to-end latency, the output tokens (from the usage chunk, else counted chunks), the replica
that served it (`x-sim-replica`, when the router passes it back) and the error, if any.
Runs are bounded in time: a stage issues for `duration` seconds, then waits at most `drain`
seconds for stragglers and cancels the rest (counted as errors). In a continuous ramp the
stages do not wait: requests still in flight when a stage ends run on into the next one (as in
llm-d's 3 -> 60 QPS ramp), and only the last stage drains.
Arrivals: `poisson` or `constant` at the stage's rate, or `trace`: each request at its own
offset `BenchRequest.at` from the stage's start (a timed replay; the stage ends when the trace
does or at `duration`).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp
import msgspec
from tqdm import tqdm

from bench.routing.objectives import Objectives
from bench.routing.workloads import BenchRequest

_decode = msgspec.json.Decoder().decode


@dataclass(frozen=True, slots=True)
class Stage:
    """One load stage: `rate` requests/s (open loop) or `concurrency` clients (closed loop)."""

    duration: float
    rate: float = 0.0
    arrivals: str = "poisson"  # "poisson" | "constant" | "trace"
    concurrency: int = 0

    @property
    def label(self) -> str:
        if self.concurrency:
            return f"{self.concurrency} clients"
        return f"trace, {self.rate:.2f} req/s" if self.arrivals == "trace" else f"{self.rate:g} req/s"


def ramp(start: float, stop: float, steps: int, duration: float, arrivals: str = "poisson") -> list[Stage]:
    """`steps` stages of equal length from `start` to `stop` requests/s (a linear ramp)."""
    if steps == 1:
        return [Stage(duration, start, arrivals)]
    return [Stage(duration, start + (stop - start) * i / (steps - 1), arrivals) for i in range(steps)]


@dataclass(slots=True)
class RequestRecord:
    """What one request measured (times in wall seconds)."""

    stage: int
    group: str
    sent: float
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    replica: str | None = None
    status: int | None = None
    error: str | None = None
    slo_ttft_ms: float | None = None  # the objectives it was sent with (bench/routing/goodput.py)
    slo_tpot_ms: float | None = None
    sensitive: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


async def send(session: aiohttp.ClientSession, base_url: str, req: BenchRequest, record: RequestRecord,
               timeout: float, headers: dict[str, str] | None = None) -> None:
    """Send one streaming request (with `headers`) and fill `record` (never raises)."""
    t0 = time.perf_counter()
    record.sent = t0
    last = None
    chunks = 0
    try:
        async with asyncio.timeout(timeout):
            async with session.post(base_url + req.path, json=req.body, headers=headers) as resp:
                record.status = resp.status
                record.replica = resp.headers.get("x-sim-replica")
                if resp.status != 200:
                    record.error = f"HTTP {resp.status}"
                    await resp.read()
                    return
                async for raw in resp.content:
                    if not raw.startswith(b"data: "):
                        continue
                    payload = raw[6:].strip()
                    if payload == b"[DONE]":
                        break
                    now = time.perf_counter()
                    msg = _decode(payload)
                    usage = msg.get("usage")
                    if usage:
                        record.output_tokens = usage.get("completion_tokens", 0) or 0
                        record.prompt_tokens = usage.get("prompt_tokens")
                        details = usage.get("prompt_tokens_details") or {}
                        record.cached_tokens = details.get("cached_tokens")
                    choices = msg.get("choices") or ()
                    if not choices:
                        continue
                    choice = choices[0]
                    text = choice.get("text")
                    if text is None:
                        text = (choice.get("delta") or {}).get("content")
                    if not text:
                        continue
                    chunks += 1
                    if last is None:
                        record.ttft = now - t0
                    else:
                        record.itl.append(now - last)
                    last = now
        record.e2e = time.perf_counter() - t0
        if not record.output_tokens:
            record.output_tokens = chunks
        if record.ttft is None:
            record.error = "no tokens"
    except TimeoutError:
        record.error = "timeout"
    except (aiohttp.ClientError, msgspec.DecodeError, OSError) as exc:
        record.error = type(exc).__name__


def send_times(stage: Stage, index: int, seed: int = 0) -> list[float]:
    """When an open-loop stage (poisson or constant) sends, in seconds after its start."""
    rng = random.Random(seed * 1000 + index)
    times: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(stage.rate) if stage.arrivals == "poisson" else 1.0 / stage.rate
        if t >= stage.duration:
            return times
        times.append(t)


def build_ahead(requests: Iterator[BenchRequest], stages: list[Stage], seed: int = 0) -> Iterator[BenchRequest]:
    """`requests` with those the open-loop and trace stages will send built now, before any clock starts.

    Building a prompt can take tens of milliseconds (no-sharing: ~22 ms of random text and
    tokenizing). Built in the send loop it holds up every send and stream read behind it: the
    sends of a Poisson stage came up to 70 ms late and in bunches (21 of 173 gaps under 2 ms,
    where the arrival process has 2). A closed-loop stage stops the look-ahead (its count is
    not known in advance); a trace is finite and is built whole.
    """
    count = 0
    for index, stage in enumerate(stages):
        if stage.concurrency:
            break
        if stage.arrivals == "trace":
            return iter(list(requests))
        count += len(send_times(stage, index, seed))
    return itertools.chain(list(itertools.islice(requests, count)), requests)


@dataclass
class StageResult:
    """The records of one stage and its wall-clock bounds."""

    stage: Stage
    records: list[RequestRecord]
    started: float
    issued_until: float
    finished: float


async def run_stage(session: aiohttp.ClientSession, base_url: str, requests: Iterator[BenchRequest],
                    stage: Stage, index: int, *, seed: int = 0, drain: float = 30.0,
                    request_timeout: float = 120.0, progress: bool = True,
                    issued: list[BenchRequest] | None = None,
                    inflight: set[asyncio.Task] | None = None,
                    objectives: Objectives | None = None) -> StageResult:
    """Run one stage against `base_url`; `issued` collects the requests sent, in order.

    `objectives`: each request is sent with its group's latency-objective headers, recorded with it.

    With `inflight` (a continuous ramp) the stage returns as soon as it has issued its requests,
    leaving the ones still running in that set for `drain_inflight`.
    """
    records: list[RequestRecord] = []
    tasks: set[asyncio.Task] = inflight if inflight is not None else set()
    expected = stage.concurrency * 10 if stage.concurrency else int(stage.rate * stage.duration)
    bar = tqdm(total=max(expected, 1), desc=f"  stage {index} {stage.label:>12}", unit="req", leave=False,
               disable=not progress, mininterval=1.0)

    def launch(req: BenchRequest) -> asyncio.Task:
        rec = RequestRecord(stage=index, group=req.group, sent=0.0)
        headers = None
        if objectives is not None:
            rec.slo_ttft_ms, rec.slo_tpot_ms, rec.sensitive = objectives.of(req.group)
            headers = objectives.headers(req.group)
        records.append(rec)
        if issued is not None:
            issued.append(req)
        task = asyncio.ensure_future(send(session, base_url, req, rec, request_timeout, headers))
        tasks.add(task)
        task.add_done_callback(lambda t: (tasks.discard(t), bar.update(1)))
        return task

    started = time.perf_counter()
    end = started + stage.duration
    if stage.concurrency:
        async def client() -> None:
            while time.perf_counter() < end:
                await launch(next(requests))

        await asyncio.gather(*(client() for _ in range(stage.concurrency)))
    elif stage.arrivals == "trace":
        for req in requests:
            at = req.at or 0.0
            if at >= stage.duration:
                break
            delay = started + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            launch(req)
    else:
        for at in send_times(stage, index, seed):
            delay = started + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            launch(next(requests))
        await asyncio.sleep(max(0.0, end - time.perf_counter()))
    issued_until = time.perf_counter()
    if inflight is None:
        await drain_inflight(tasks, records, drain)
    bar.close()
    return StageResult(stage, records, started, issued_until, time.perf_counter())


async def drain_inflight(tasks: set[asyncio.Task], records: list[RequestRecord], drain: float) -> None:
    """Wait at most `drain` seconds for `tasks`, cancel the rest and mark their records."""
    if tasks:
        _, pending = await asyncio.wait(set(tasks), timeout=drain)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for rec in records:
        if rec.e2e is None and rec.error is None:
            rec.error = "cancelled at drain"


__all__ = ["RequestRecord", "Stage", "StageResult", "drain_inflight", "ramp", "run_stage", "send"]
