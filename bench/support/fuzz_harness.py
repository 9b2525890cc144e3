"""The ext_proc fuzz harness: runs seeded random streams against a running picker and checks invariants.

It speaks only the picker's network interfaces (ext_proc gRPC, grpc.health.v1, HTTP /metrics),
so it drives an in-process server (the CI test) and an `epp serve` process (bench/fuzz.py) alike.

Invariants (issue #18):
- the server never dies: health stays SERVING and /metrics answers, checked as the run goes;
- every complete request gets a defined answer within 5 s (a pick or a GIE error), and every
  stream ends within 5 s of its last message; idle ones are answered by the idle timeout;
- a picked endpoint is a pool member and inside the subset hint;
- errors are JSON (OpenAI's error shape, Anthropic's on /v1/messages) whose message is
  `inference error: <Code> - <msg>` with the code's HTTP status, never Internal;
- request and response bodies pass through byte-identical (no model rewrite asked for);
- the in-flight gauges return to zero when all streams are done.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.support.fuzz_cases import Case, CaseMaker
from epp.config.compose import endpoint_picker_config
from epp.framework.errors import ErrorCode

# The picker configuration both fuzz runs use: approximate prefix routing with the load scorers.
_PREFIX_SCORERS = ("prefix-home-scorer", "queue-scorer", "kv-cache-utilization-scorer", "max-score-picker")
PREFIX_CONFIG = endpoint_picker_config(["approx-prefix-cache-producer", "prefix-cache-scorer", *_PREFIX_SCORERS],
                                       {"prefix-cache-scorer": 3, **dict.fromkeys(_PREFIX_SCORERS)})

ANSWER_WITHIN_S = 5.0
GIE_ERROR = re.compile(r"^inference error: (\w+) - .+$", re.DOTALL)
STATUS_OF_CODE = {code.label: code.http_status for code in ErrorCode}
HEALTH_SERVICES = ("", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")


@dataclass
class Target:
    """Where the picker under test listens, and what it serves."""

    grpc_port: int
    health_port: int
    metrics_port: int
    pool: tuple[str, ...]
    idle_timeout_s: float


@dataclass
class Report:
    """Outcome counts, invariant violations (case index: what), and timing of one fuzz run."""

    streams: int = 0
    outcomes: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    slowest_answer_s: float = 0.0
    elapsed_s: float = 0.0
    health_checks: int = 0

    def violate(self, case: Case, what: str) -> None:
        self.violations.append(f"case {case.index} ({case.kind}): {what}")


def _error_message(body: str) -> str:
    """The message of a JSON error answer in OpenAI's or Anthropic's shape ("" when it is neither)."""
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return ""
    return error.get("message", "") if isinstance(error, dict) else ""


def _allowed(pool: tuple[str, ...], hint: tuple[str, ...] | None) -> set[str]:
    if hint is None:
        return set(pool)
    exact = {e for e in hint if e in pool}
    hosts = {e.strip("[]") for e in hint}
    return exact | {ep for ep in pool if ep.rpartition(":")[0] in hosts}


def _streamed(replies, phase: str) -> bytes:
    return b"".join(getattr(r, phase).response.body_mutation.streamed_response.body for r in replies
                    if r.WhichOneof("response") == phase)


class Fuzzer:
    """Runs cases with bounded concurrency and records what every stream got."""

    def __init__(self, target: Target, seed: int, concurrency: int = 32) -> None:
        self.target = target
        self.maker = CaseMaker(seed, target.pool)
        self.concurrency = concurrency
        self.report = Report()
        self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{target.grpc_port}",
                                                  options=[("grpc.max_receive_message_length", 64 << 20),
                                                           ("grpc.max_send_message_length", 64 << 20)])
        self._stub = pb_grpc.ExternalProcessorStub(self._channel)
        self._health_channel = grpc.aio.insecure_channel(f"127.0.0.1:{target.health_port}")
        self._http: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        await self._channel.close()
        await self._health_channel.close()
        if self._http is not None:
            await self._http.close()

    # -- whole-server checks ----------------------------------------------------------------

    async def metrics_text(self) -> str:
        if self._http is None:
            self._http = aiohttp.ClientSession()
        async with self._http.get(f"http://127.0.0.1:{self.target.metrics_port}/metrics",
                                  timeout=aiohttp.ClientTimeout(total=ANSWER_WITHIN_S)) as r:
            if r.status != 200:
                raise AssertionError(f"/metrics answered {r.status}")
            return await r.text()

    async def check_server(self) -> None:
        """Health SERVING on every readiness service, and /metrics answering (failures are violations)."""
        stub = health_pb2_grpc.HealthStub(self._health_channel)
        try:
            for service in HEALTH_SERVICES:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=ANSWER_WITHIN_S)
                if reply.status != health_pb2.HealthCheckResponse.SERVING:
                    self.report.violations.append(f"health of {service!r} is {reply.status}")
            await self.metrics_text()
        except Exception as exc:
            self.report.violations.append(f"server check failed: {type(exc).__name__}: {exc}")
        self.report.health_checks += 1

    async def in_flight(self) -> float:
        """Open streams plus running requests, as /metrics reports them."""
        total = 0.0
        for line in (await self.metrics_text()).splitlines():
            if line.startswith(("epp_extproc_streams_active ", "inference_objective_running_requests{")):
                total += float(line.rsplit(" ", 1)[1])
        return total

    # -- one stream -------------------------------------------------------------------------

    async def run_case(self, case: Case) -> None:
        report = self.report
        try:
            outcome = await (self._garbage(case) if case.garbage else self._stream(case))
        except Exception as exc:  # the harness itself must not hide a failure
            report.violate(case, f"harness error {type(exc).__name__}: {exc}")
            outcome = "harness_error"
        report.outcomes[outcome] += 1
        report.streams += 1

    async def _garbage(self, case: Case) -> str:
        call = self._channel.stream_stream("/envoy.service.ext_proc.v3.ExternalProcessor/Process")()
        await call.write(case.garbage)
        try:
            async with asyncio.timeout(ANSWER_WITHIN_S):
                while await call.read() is not grpc.aio.EOF:
                    pass
        except grpc.aio.AioRpcError as err:
            if err.code() is grpc.StatusCode.INVALID_ARGUMENT:
                return "garbage_rejected"
            self.report.violate(case, f"garbage answered {err.code()}")
            return "garbage_other"
        except TimeoutError:
            self.report.violate(case, "garbage not answered within 5 s")
            call.cancel()
            return "garbage_hung"
        return "garbage_parsed"  # bytes that happen to decode as a ProcessingRequest

    async def _stream(self, case: Case) -> str:
        call = self._stub.Process()
        replies: list = []
        got_answer = asyncio.Event()
        ended = asyncio.Event()

        async def reader() -> None:
            try:
                while True:
                    reply = await call.read()
                    if reply is grpc.aio.EOF:
                        break
                    replies.append(reply)
                    if reply.WhichOneof("response") in ("request_headers", "immediate_response"):
                        got_answer.set()
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                pass
            finally:
                got_answer.set()
                ended.set()

        reading = asyncio.create_task(reader())
        try:
            return await self._drive(case, call, replies, got_answer, ended)
        finally:
            if not reading.done():
                call.cancel()
            await asyncio.gather(reading, return_exceptions=True)

    async def _drive(self, case: Case, call, replies: list, got_answer: asyncio.Event,
                     ended: asyncio.Event) -> str:
        report = self.report
        messages = case.request + case.response
        if case.cancel_after is not None:
            for msg in messages[:case.cancel_after]:
                await call.write(msg)
            await asyncio.sleep(0)
            call.cancel()
            return "cancelled"
        for msg in case.request:
            await call.write(msg)
        if case.idle:
            if not await _wait(got_answer, self.target.idle_timeout_s + ANSWER_WITHIN_S):
                report.violate(case, "idle stream not answered by the idle timeout")
                return "idle_hung"
            return self._check_answer(case, replies, "idle")
        sent = time.monotonic()
        if case.ordered:
            if not await _wait(got_answer, ANSWER_WITHIN_S):
                report.violate(case, "complete request not answered within 5 s")
                return "unanswered"
            report.slowest_answer_s = max(report.slowest_answer_s, time.monotonic() - sent)
            picked = any(r.WhichOneof("response") == "request_headers" for r in replies)
            if picked:
                for msg in case.response:
                    await call.write(msg)
        else:
            for msg in case.response:
                await call.write(msg)
        await call.done_writing()
        if not await _wait(ended, ANSWER_WITHIN_S):
            report.violate(case, "stream did not end within 5 s of its last message")
            return "stream_hung"
        return self._check_answer(case, replies, "ordered" if case.ordered else "invalid_order")

    def _check_answer(self, case: Case, replies: list, mode: str) -> str:
        report = self.report
        outcome = f"{mode}:no_answer"
        for reply in replies:
            kind = reply.WhichOneof("response")
            if kind == "immediate_response":
                status = reply.immediate_response.status.code
                body = reply.immediate_response.body.decode("utf-8", "replace")
                match = GIE_ERROR.match(_error_message(body))
                if match is None or STATUS_OF_CODE.get(match.group(1)) != status:
                    report.violate(case, f"error not in the JSON error format: {status} {body[:100]!r}")
                elif match.group(1) == "Internal":
                    report.violate(case, f"internal error: {body[:200]!r}")
                outcome = f"{mode}:{status}"
                break
            if kind == "request_headers":
                self._check_pick(case, reply)
                outcome = f"{mode}:picked"
                break
        if mode == "ordered" and case.complete and outcome.endswith("no_answer"):
            report.violate(case, "complete request got no answer")
        if mode == "ordered" and outcome.endswith("picked") and not case.rewrite:
            self._check_passthrough(case, replies)
        return outcome

    def _check_pick(self, case: Case, reply) -> None:
        common = reply.request_headers.response
        headers = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
        destination = headers.get("x-gateway-destination-endpoint", "")
        metadata = reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields
        if metadata["x-gateway-destination-endpoint"].string_value != destination:
            self.report.violate(case, "header and metadata name different endpoints")
        allowed = _allowed(self.target.pool, case.subset)
        for endpoint in destination.split(","):
            if endpoint not in allowed:
                self.report.violate(case, f"picked {endpoint!r} outside pool/subset {case.subset}")

    def _check_passthrough(self, case: Case, replies: list) -> None:
        if case.kind != "header_only":
            sent = b"".join(m.request_body.body for m in case.request if m.WhichOneof("request") == "request_body")
            if _streamed(replies, "request_body") != sent:
                self.report.violate(case, "request body not forwarded byte-identical")
        if case.response_chunks and _streamed(replies, "response_body") != b"".join(case.response_chunks):
            self.report.violate(case, "response body not passed through byte-identical")

    # -- a run ------------------------------------------------------------------------------

    async def run(self, streams: int, check_every: int = 500, progress=None) -> Report:
        """Run `streams` cases, checking the server every `check_every`, then the gauges at the end."""
        started = time.monotonic()
        semaphore = asyncio.Semaphore(self.concurrency)
        pending: set[asyncio.Task] = set()

        async def one(case: Case) -> None:
            async with semaphore:
                await self.run_case(case)

        for index in range(streams):
            case = self.maker.make(index)
            await semaphore.acquire()
            semaphore.release()
            task = asyncio.create_task(one(case))
            pending.add(task)
            task.add_done_callback(pending.discard)
            if (index + 1) % check_every == 0:
                await self.check_server()
                if progress is not None:
                    progress(index + 1, self.report)
        await asyncio.gather(*pending)
        await self.check_server()
        deadline = time.monotonic() + ANSWER_WITHIN_S
        left = None
        try:
            while (left := await self.in_flight()) != 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        except Exception as exc:
            self.report.violations.append(f"gauges unreadable: {type(exc).__name__}: {exc}")
        if left:
            self.report.violations.append(f"in-flight gauges stay at {left} after all streams ended")
        self.report.elapsed_s = time.monotonic() - started
        return self.report


async def _wait(event: asyncio.Event, timeout: float) -> bool:
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return False
    return True
