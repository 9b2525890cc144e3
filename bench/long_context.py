"""What a long conversation's next turn costs the picker, against a fresh 2 KB prompt, in one run.

The picker runs in-process (`EppServer`, 8 endpoints, no scraping) and its ext_proc service is
handed the messages Envoy sends (request headers, the body in 16 KB pieces as HTTP/2 frames
bring it, response headers and a JSON body with the usage), without gRPC. A chat conversation
grows about 1 KB a turn (a user question, the assistant's answer) from a 2 KB system prompt to
`--kb` KB; each turn is timed (wall and process CPU, threads included, from the first message
to the last reply). With the precise pipeline the replica's KV events are replayed into the
index after each pick (outside the timing), so that each turn's lookup walks a real match.
Reported per pipeline: the mean of the last `--tail` turns against the mean of fresh 2 KB
prompts (a new conversation each) measured in the same run, interleaved.

With `--grpc` the same conversation goes over gRPC to `epp serve` (its own process) as Envoy
would send it, and a row for `bench/minimal_picker.py` (random pick, bodies re-emitted: what any
Python ext_proc picker pays to receive and re-send a body) shows the transport's own ratio.
Timed there: from the first request message sent to the routing reply and the re-emitted body
received, at the client; CPU: the picker process's, from /proc, over the same turns. No KV
events reach that picker: the precise pipeline's matches are its own claims (speculativeTTL).

    python bench/long_context.py                                  # default, approximate, precise
    python bench/long_context.py --pipelines precise --profile /tmp/precise.prof
    python bench/long_context.py --grpc --pipelines minimal,default,approximate,precise
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from epp.config.compose import DEFAULT_CONFIG_YAML, endpoint_picker_config, plugin  # noqa: E402
from epp.datalayer.registry import parse_endpoint_list  # noqa: E402
from epp.engine.sim.fleet import default_tokenizer_dir  # noqa: E402
from epp.engine.tinymodel import _WORDS  # noqa: E402
from epp.kvevents.decoding import BlockStored, DecodedBatch, Tier  # noqa: E402
from epp.request.parsing import RequestParser  # noqa: E402
from epp.server.extproc import ExtProcService, _Stream  # noqa: E402
from epp.server.runner import EppServer, ServeOptions  # noqa: E402

MODEL = "sim-model"
FRAME = 16 * 1024  # Envoy forwards a body as the HTTP/2 frames bring it: 16 KB each by default
ENDPOINTS = 8
SAMPLE_CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"


def pipeline_config(name: str, tokenizer_dir: str) -> str:
    """default: GIE's default; approximate: examples/configs/approximate.yaml; precise: llm-d's weights."""
    if name == "default":
        return DEFAULT_CONFIG_YAML
    if name == "approximate":
        return (SAMPLE_CONFIGS / "approximate.yaml").read_text()
    if name == "precise":
        weights = {"prefix-cache-scorer": 3, "queue-scorer": 2, "kv-cache-utilization-scorer": 2}
        producer = plugin("precise-prefix-cache-producer", blockSizeTokens=16, subscribe=False,
                          tokenizers={MODEL: tokenizer_dir})
        return endpoint_picker_config([producer, *weights], weights)
    raise ValueError(f"unknown pipeline {name!r}")


def text(rng: random.Random, size: int) -> str:
    """About `size` characters of sentences from the tiny model's words."""
    words: list[str] = []
    length = 0
    while length < size:
        word = rng.choice(_WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:size]


class Conversation:
    """A chat that grows by a question and an answer per turn."""

    def __init__(self, seed: int, system_bytes: int = 2048) -> None:
        self.rng = random.Random(seed)
        self.messages = [{"role": "system", "content": text(self.rng, system_bytes)}]

    def ask(self, size: int = 400) -> bytes:
        """The next request's body: the history and a new question."""
        self.messages.append({"role": "user", "content": text(self.rng, size)})
        return json.dumps({"model": MODEL, "messages": self.messages, "max_tokens": 64}).encode()

    def answered(self, size: int = 600) -> None:
        self.messages.append({"role": "assistant", "content": text(self.rng, size)})


def _headers(pairs: list[tuple[str, str]]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])


def messages_for(body: bytes) -> list[pb.ProcessingRequest]:
    """What Envoy sends for one request and its JSON response, all phases."""
    first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=_headers(
        [(":method", "POST"), (":path", "/v1/chat/completions"), ("content-type", "application/json"),
         ("x-request-id", "r")])))
    first.protocol_config.request_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED
    first.protocol_config.response_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED
    out = [first]
    for offset in range(0, len(body), FRAME):
        out.append(pb.ProcessingRequest(request_body=pb.HttpBody(
            body=body[offset:offset + FRAME], end_of_stream=offset + FRAME >= len(body))))
    out.append(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=_headers(
        [(":status", "200"), ("content-type", "application/json")]))))
    out.append(pb.ProcessingRequest(response_body=pb.HttpBody(
        body=b'{"usage":{"prompt_tokens":%d,"completion_tokens":64}}' % (len(body) // 3), end_of_stream=True)))
    return out


class KVReplay:
    """Plays the picked replica's KV events into the precise producer's index (as vLLM would publish them)."""

    def __init__(self, server: EppServer) -> None:
        self.producer = next((p for p in server.pipeline.data_producers
                              if p.type_name == "precise-prefix-cache-producer"), None) if server.pipeline else None
        self.stored: dict[str, int] = {}  # endpoint -> tokens of the conversation it holds

    async def after_pick(self, stream: _Stream, conversation_id: str) -> None:
        if self.producer is None or stream.life.request is None or stream.life.target is None:
            return
        tokens = await self.producer.prompt_tokens(stream.life.request)
        if not tokens:
            return
        endpoint = stream.life.target.name
        key = f"{endpoint}/{conversation_id}"
        bs = self.producer.block_size
        start = self.stored.get(key, 0)
        end = len(tokens) // bs * bs
        if end <= start:
            return
        # Engine hashes: any distinct ints (the index maps them to its own keys); parent = the block before.
        base = hash((endpoint, conversation_id)) & 0xFFFF_FFFF_FFFF
        hashes = tuple(base * 100_000 + i for i in range(start // bs, end // bs))
        parent = base * 100_000 + start // bs - 1 if start else None
        event = BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tuple(tokens[start:end]),
                            block_size=bs, tier=Tier.GPU)
        self.producer.index.apply_batch(endpoint, DecodedBatch(ts=time.time(), events=[event]), MODEL)
        self.stored[key] = end


@contextlib.asynccontextmanager
async def picker(config_text: str) -> AsyncIterator[tuple[EppServer, ExtProcService]]:
    options = ServeOptions(grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
                           endpoints=parse_endpoint_list(",".join(f"127.0.0.1:{9100 + i}" for i in range(ENDPOINTS))),
                           scrape_metrics=False, config_text=config_text)
    server = EppServer(options)
    await server.start()
    try:
        yield server, ExtProcService(server.director, RequestParser(), server.metrics)
    finally:
        await server.stop(0)


async def one_request(service: ExtProcService, msgs: list[pb.ProcessingRequest]) -> tuple[float, float, _Stream]:
    """Wall and CPU seconds of one request's messages through the service."""
    stream = _Stream(service)
    w0, c0 = time.perf_counter(), time.process_time()
    for req in msgs:
        await service._dispatch(stream, req)
    stream.on_close()
    stream.life.complete(aborted=True)
    return time.perf_counter() - w0, time.process_time() - c0, stream


async def measure(pipeline: str, kb: int, tail: int, fresh: int, profile: str | None) -> dict:
    config = pipeline_config(pipeline, default_tokenizer_dir())
    async with picker(config) as (server, service):
        replay = KVReplay(server)
        convo = Conversation(seed=1)
        fresh_rng = random.Random(2)
        turns: list[tuple[int, float, float]] = []
        fresh_times: list[tuple[float, float]] = []
        profiler = cProfile.Profile() if profile else None
        for _ in range(20):  # warm-up: code paths, tokenizer loaded
            await one_request(service, messages_for(Conversation(fresh_rng.randrange(1 << 30)).ask()))
        turn = 0
        while True:
            body = convo.ask()
            msgs = messages_for(body)
            last = len(body) >= kb * 1024
            if profiler is not None and len(body) >= (kb - tail) * 1024:
                profiler.enable()
            wall, cpu, stream = await one_request(service, msgs)
            if profiler is not None:
                profiler.disable()
            turns.append((len(body), wall, cpu))
            await replay.after_pick(stream, "long")
            convo.answered()
            turn += 1
            if turn % max(1, (kb // fresh) or 1) == 0 or last:
                # A fresh 2 KB prompt: a new conversation (system prompt + a question), never seen before.
                other = Conversation(fresh_rng.randrange(1 << 30), system_bytes=1600)
                wall2, cpu2, stream2 = await one_request(service, messages_for(other.ask()))
                await replay.after_pick(stream2, f"fresh{turn}")
                fresh_times.append((wall2, cpu2))
            if last:
                break
        if profiler is not None and profile:
            profiler.dump_stats(profile)
    long_turns = turns[-tail:]
    result = {
        "pipeline": pipeline, "turns": len(turns), "last_body_bytes": turns[-1][0],
        "long_wall_ms": statistics.mean(t[1] for t in long_turns) * 1e3,
        "long_cpu_ms": statistics.mean(t[2] for t in long_turns) * 1e3,
        "fresh_wall_ms": statistics.mean(t[0] for t in fresh_times[-tail:]) * 1e3,
        "fresh_cpu_ms": statistics.mean(t[1] for t in fresh_times[-tail:]) * 1e3,
        "fresh_body_bytes": len(Conversation(0, system_bytes=1600).ask()),
    }
    result["ratio_wall"] = result["long_wall_ms"] / result["fresh_wall_ms"]
    result["ratio_cpu"] = result["long_cpu_ms"] / result["fresh_cpu_ms"]
    return result


async def measure_grpc(pipeline: str, kb: int, tail: int, fresh: int) -> dict:
    """The same conversation over gRPC to `epp serve` (or the minimal picker) in its own process."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    from epp.netutil import free_ports

    port, health, metrics = free_ports(3)
    endpoints = ",".join(f"127.0.0.1:{9100 + i}" for i in range(ENDPOINTS))
    if pipeline == "minimal":
        argv = [sys.executable, str(Path(__file__).with_name("minimal_picker.py")), str(port), endpoints]
    else:
        config = Path(f"/tmp/long-context-{pipeline}-{port}.yaml")
        config.write_text(pipeline_config(pipeline, default_tokenizer_dir()))
        argv = [sys.executable, "-m", "epp.cli", "serve", "--grpc-port", str(port), "--grpc-health-port", str(health),
                "--metrics-port", str(metrics), "--bind-address", "127.0.0.1", "--endpoints", endpoints,
                "--refresh-metrics-interval", "3600", "--config-file", str(config)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[
                ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]) as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)

            async def one(body: bytes) -> float:
                msgs = messages_for(body)
                requests = [m for m in msgs if m.WhichOneof("request") in ("request_headers", "request_body")]
                responses = msgs[len(requests):]
                call = stub.Process()
                t0 = time.perf_counter()
                for m in requests:
                    await call.write(m)
                while True:  # the routing reply, then the re-emitted body's pieces up to its last
                    reply = await call.read()
                    if reply.request_body.response.body_mutation.streamed_response.end_of_stream:
                        break
                wall = time.perf_counter() - t0
                for m in responses:
                    await call.write(m)
                    await call.read()
                await call.done_writing()
                return wall

            deadline = time.monotonic() + 60
            while True:
                try:
                    await one(Conversation(0).ask())
                    break
                except grpc.aio.AioRpcError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.3)
            fresh_rng = random.Random(2)
            for _ in range(20):
                await one(Conversation(fresh_rng.randrange(1 << 30)).ask())
            convo = Conversation(seed=1)
            long_walls: list[float] = []
            fresh_walls: list[float] = []
            long_cpu = fresh_cpu = 0.0
            every = max(1, kb // fresh)
            turn = 0
            while True:
                body = convo.ask()
                last = len(body) >= kb * 1024
                in_tail = len(body) >= (kb - tail) * 1024
                c0 = _process_cpu_s(proc.pid)
                wall = await one(body)
                if in_tail:
                    long_walls.append(wall)
                    long_cpu += _process_cpu_s(proc.pid) - c0
                convo.answered()
                turn += 1
                if turn % every == 0 or last:
                    other = Conversation(fresh_rng.randrange(1 << 30), system_bytes=1600)
                    c0 = _process_cpu_s(proc.pid)
                    fresh_walls.append(await one(other.ask()))
                    fresh_cpu += _process_cpu_s(proc.pid) - c0
                if last:
                    break
    finally:
        proc.terminate()
        proc.wait(15)
    result = {"pipeline": pipeline, "turns": turn, "last_body_bytes": len(body),
              "long_wall_ms": statistics.median(long_walls) * 1e3,
              "long_cpu_ms": long_cpu / len(long_walls) * 1e3,
              "fresh_wall_ms": statistics.median(fresh_walls) * 1e3,
              "fresh_cpu_ms": fresh_cpu / len(fresh_walls) * 1e3}
    result["ratio_wall"] = result["long_wall_ms"] / result["fresh_wall_ms"]
    result["ratio_cpu"] = result["long_cpu_ms"] / max(result["fresh_cpu_ms"], 1e-9)
    return result


def _process_cpu_s(pid: int) -> float:
    """CPU seconds of a process's live threads in nanoseconds' resolution (/proc/<pid>/task/*/schedstat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that just ended
    return total / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipelines", default="default,approximate,precise")
    parser.add_argument("--kb", type=int, default=200, help="grow the conversation to this many KB (default 200)")
    parser.add_argument("--tail", type=int, default=20, help="turns averaged at the end (default 20)")
    parser.add_argument("--fresh", type=int, default=40, help="fresh 2 KB prompts interleaved (default 40)")
    parser.add_argument("--profile", help="write a cProfile of the last turns here (one pipeline)")
    parser.add_argument("--grpc", action="store_true", help="over gRPC to `epp serve` in its own process")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    results = []
    for name in args.pipelines.split(","):
        if args.grpc:
            results.append(asyncio.run(measure_grpc(name, args.kb, args.tail, args.fresh)))
        else:
            results.append(asyncio.run(measure(name, args.kb, args.tail, args.fresh, args.profile)))
    how = ("over gRPC, wall: median, CPU: the picker process's mean" if args.grpc
           else "in-process, no gRPC, means")
    print(f"\nconversation to {args.kb} KB (~1 KB a turn), the last {args.tail} turns against fresh "
          f"~2 KB prompts in the same run; {ENDPOINTS} endpoints, {how}\n")
    print("| pipeline | turns | last body (KB) | long turn wall / CPU (ms) | fresh 2 KB wall / CPU (ms) | "
          "ratio wall / CPU |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['pipeline']} | {r['turns']} | {r['last_body_bytes'] / 1024:.0f} | "
              f"{r['long_wall_ms']:.2f} / {r['long_cpu_ms']:.2f} | {r['fresh_wall_ms']:.2f} / {r['fresh_cpu_ms']:.2f} | "
              f"{r['ratio_wall']:.2f} / {r['ratio_cpu']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
