"""What one 100k-token agentic continuation turn costs the precise picker, part by part, and its floor.

`bench/agentic_cpu.py` measures the whole picker behind Envoy against 100 simulated replicas; on a
loaded machine its per-turn figure moves with the load. This one measures the same turns part
by part, each on its own, in one process (CPU time, threads included), so the parts can be
compared and summed:

- **pick**: the precise pipeline (llm-d's weights: prefix 3, queue 2, KV utilization 2) on 100
  endpoints, `ExtProcService` fed the messages Envoy sends under `epp envoy-config --responses
  first-token` (request headers, the body in `--frame-kb` pieces as Envoy forwards it, response
  headers, the first streamed chunk; the picker lets go there): parsing, tokenizing (the
  tokenization cache reuses the previous turn's tokens), keying (the key cache), the index walk,
  scoring, claims, the replies. The picked replica's KV events are played into the index after
  each turn (outside this part), as the simulator publishes them: one BlockStored per prefill
  chunk of 8,192 tokens with its tokens, one per full output block of `--output-tokens`.
- **KV events**: those events' msgpack decoding and their application to the index.
- **transport**: the turn's gRPC messages (the same ones, and the replies `epp serve` sends: the
  routing headers, the body re-emitted in 62,000-byte pieces, the response replies, the close)
  between a client playing Envoy and a grpc.aio ext_proc servicer in its own process that does
  nothing but answer them (`bench/minimal_picker.py`'s least work, re-emitting in GIE's pieces):
  its CPU, from /proc, is what any Python ext_proc picker pays to take and answer them.
- **floor**: what no implementation of the precise pick in CPython avoids per turn: the server's
  transport, tokenizing the turn's new text (the simulator's tokenizer, `encode_batch_fast` of the
  new part alone: ids without offsets), hashing its new blocks (our xxhash64 chain), decoding and applying its KV events.

Conversations are `bench/agentic_cpu.py`'s (prefixes of 10-18k tokens, 0.8-1.2x `--context`,
replies and tool results from the agentic generator's full-scale distributions, compaction past
1.6x): the first turn of each is cold (not counted), then `--rounds` rounds of continuation turns,
a session's turns `--turn-gap-s` agent seconds apart (the match memo's clock).

    python bench/agentic_turn_cost.py --conversations 20 --rounds 4
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import msgspec
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.agentic.replay import PromptBuilder, turn_request  # noqa: E402
from bench.agentic_cpu import Conversations  # noqa: E402
from bench.routing.measure import process_cpu_seconds  # noqa: E402
from epp.config.compose import endpoint_picker_config, plugin  # noqa: E402
from epp.datalayer.registry import parse_endpoint_list  # noqa: E402
from epp.engine.kv_publisher import BlockStored, KVEventBatch  # noqa: E402
from epp.engine.sim.fleet import default_tokenizer_dir  # noqa: E402
from epp.kvevents.decoding import decode_batch  # noqa: E402
from epp.kvevents.keys import BlockKeyer  # noqa: E402
from epp.kvevents.producer import PrecisePrefixCacheProducer  # noqa: E402
from epp.netutil import free_ports  # noqa: E402
from epp.request.parsing import RequestParser  # noqa: E402
from epp.server.extproc import ExtProcService, _Stream  # noqa: E402
from epp.server.messages import BODY_CHUNK_LIMIT  # noqa: E402
from epp.server.runner import EppServer, ServeOptions  # noqa: E402

MODEL = "sim-model"
BLOCK = 16
PREFILL_CHUNK = 8192  # the simulated replicas' max_num_batched_tokens in bench/agentic_cpu.py
WEIGHTS = {"prefix-cache-scorer": 3, "queue-scorer": 2, "kv-cache-utilization-scorer": 2}
FIRST_CHUNK = b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" the"}]}\n\n'


def _headers(pairs: Sequence[tuple[str, str]]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])


def envoy_messages(body: bytes, frame: int, session: str) -> list[pb.ProcessingRequest]:
    """What Envoy sends the picker for one turn under `--responses first-token`, up to the first token."""
    first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=_headers(
        [(":method", "POST"), (":path", "/v1/completions"), ("content-type", "application/json"),
         ("x-request-id", session), ("x-claude-code-session-id", session)])))
    first.protocol_config.request_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED
    first.protocol_config.response_body_mode = ProcessingMode.STREAMED
    out = [first]
    for offset in range(0, len(body), frame):
        out.append(pb.ProcessingRequest(request_body=pb.HttpBody(
            body=body[offset:offset + frame], end_of_stream=offset + frame >= len(body))))
    out.append(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=_headers(
        [(":status", "200"), ("content-type", "text/event-stream")]))))
    out.append(pb.ProcessingRequest(response_body=pb.HttpBody(body=FIRST_CHUNK)))
    return out


class Replicas:
    """The KV events the picked replica publishes after each turn (engine hashes of our own, chained)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.held: dict[tuple[str, str], tuple[int, int]] = {}  # (endpoint, session) -> (blocks, last hash)
        self.encoder = msgspec.msgpack.Encoder()

    def after(self, endpoint: str, session: str, tokens: Sequence[int], output_tokens: int) -> list[bytes]:
        """The msgpack batches of one turn: prefill chunks past what the replica held, then full output blocks."""
        done, parent = self.held.get((endpoint, session), (0, 0))
        full = len(tokens) // BLOCK
        if done > full:  # compacted: a new context, prefilled from its start
            done, parent = 0, 0
        batches = []
        for start in range(done, full, PREFILL_CHUNK // BLOCK):
            end = min(full, start + PREFILL_CHUNK // BLOCK)
            hashes = [self.rng.getrandbits(63) for _ in range(start, end)]
            batches.append(self._batch([BlockStored(hashes, parent or None, list(tokens[start * BLOCK:end * BLOCK]),
                                                    BLOCK, None, "GPU", None)]))
            parent = hashes[-1]
        self.held[(endpoint, session)] = (full, parent)  # the next turn's new blocks chain from the prompt's last
        # The answer's blocks chain on (their tokens are the model's own: no later prompt repeats them here).
        outputs = [self.rng.randrange(1000, 30000) for _ in range(output_tokens)]
        for i in range(output_tokens // BLOCK):
            block = self.rng.getrandbits(63)
            batches.append(self._batch([BlockStored([block], parent, outputs[i * BLOCK:(i + 1) * BLOCK], BLOCK, None,
                                                    "GPU", None)]))
            parent = block
        return batches

    def _batch(self, events: list[Any]) -> bytes:
        return self.encoder.encode(KVEventBatch(time.time(), events, 0))


def cpu() -> float:
    return time.process_time()


async def measure_pick(args: argparse.Namespace) -> dict[str, Any]:
    """The pick and the KV events, in-process; and the floor's parts of the same turns."""
    tok = default_tokenizer_dir()
    producer = plugin("precise-prefix-cache-producer", blockSizeTokens=BLOCK, subscribe=False, tokenizers={MODEL: tok})
    endpoints = ",".join(f"127.0.0.1:{20000 + i}" for i in range(args.endpoints))
    server = EppServer(ServeOptions(grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
                                    endpoints=parse_endpoint_list(endpoints), scrape_metrics=False,
                                    config_text=endpoint_picker_config([producer, *WEIGHTS], WEIGHTS)))
    await server.start()
    rows: list[dict[str, Any]] = []
    try:
        assert server.director is not None
        service = ExtProcService(server.director, RequestParser(), server.metrics)
        [precise] = server.director.pipeline.plugins_of(PrecisePrefixCacheProducer)
        tokenizer = precise.tokenizers.load(MODEL) if precise.tokenizers is not None else None
        assert tokenizer is not None
        keyer = BlockKeyer(BLOCK)
        convs = Conversations(args.conversations, args.context, args.seed)
        prompts = PromptBuilder(args.seed, tok)
        replicas = Replicas(args.seed)
        frame = args.frame_kb * 1024
        previous: dict[str, str] = {}
        profiler = cProfile.Profile() if args.profile else None
        # Agent time: a session's next turn comes `--turn-gap-s` after its last (tool time and the answer's
        # generation), which decides whether the match memo may continue the last walk (matchReuseSeconds).
        clock = [0.0]
        if precise.match_memo is not None:
            precise.match_memo._clock = lambda: clock[0]
        for rnd in range(args.rounds + 1):
            for c in convs.items:
                clock[0] += args.turn_gap_s / len(convs.items)
                before = previous.get(c.session_id, "")
                prompt = previous[c.session_id] = prompts.prompt(hash(c.session_id), tuple(c.segments))
                body = json.dumps(turn_request(prompt, args.output_tokens, c.session_id).body).encode()
                stream = _Stream(service)
                if profiler is not None and rnd:
                    profiler.enable()
                t0 = cpu()
                for msg in envoy_messages(body, frame, c.session_id):
                    await service._dispatch(stream, msg)
                pick = cpu() - t0
                if profiler is not None:
                    profiler.disable()
                assert stream.released or rnd == 0, "the picker did not let go at the first token"
                target = stream.life.target
                request = stream.life.request
                assert target is not None and request is not None
                tokens = await precise.prompt_tokens(request)  # a full hit of the tokenization cache
                assert tokens is not None
                batches = replicas.after(target.name, c.session_id, tokens, args.output_tokens)
                t0 = cpu()
                for payload in batches:
                    precise.index.apply_batch(target.name, decode_batch(payload), MODEL)
                events = cpu() - t0
                stream.on_stream_end()
                if rnd:
                    # The floor's parts: the new text alone tokenized, its new blocks alone hashed.
                    new_text = prompt[len(before):] if prompt.startswith(before) else prompt
                    t0 = cpu()
                    new_ids = tokenizer.tokenizer.encode_batch_fast([new_text], add_special_tokens=False)[0].ids
                    tokenize_new = cpu() - t0
                    new_blocks = len(new_ids) // BLOCK
                    t0 = cpu()
                    keyer.chain(1, new_ids[: new_blocks * BLOCK])
                    hash_new = cpu() - t0
                    rows.append({"tokens": len(tokens), "new_tokens": len(new_ids), "body_bytes": len(body),
                                 "events": len(batches), "pick_ms": pick * 1e3, "events_ms": events * 1e3,
                                 "tokenize_new_ms": tokenize_new * 1e3, "hash_new_ms": hash_new * 1e3,
                                 "body_messages": -(-len(body) // frame)})
                convs.grow(c)
        if profiler is not None:
            profiler.dump_stats(args.profile)
        registry = server.metrics.registry
        caches = {f"{name}{{{k}={v!r}}}": registry.get_sample_value(name, {k: v}) or 0.0
                  for name, k, values in (("epp_tokenization_cache_lookups_total", "outcome",
                                           ("miss", "prefix_hit", "fallback", "full_hit")),
                                          ("epp_kv_key_cache_lookups_total", "outcome", ("hit", "miss")),
                                          ("epp_kv_match_memo_lookups_total", "walk", ("full", "incremental")))
                  for v in values}
    finally:
        await server.stop(0)
    return {"rows": rows, "caches": caches}


class _Answering(pb_grpc.ExternalProcessorServicer):
    """The least an ext_proc picker does for these messages: route, re-emit the body in GIE's pieces, answer."""

    ROUTE = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=pb.CommonResponse(
        clear_route_cache=True, header_mutation=pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="x-gateway-destination-endpoint", raw_value=b"127.0.0.1:20000"))]))))

    async def Process(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        parts: list[bytes] = []
        while (req := await context.read()) is not grpc.aio.EOF:
            kind = req.WhichOneof("request")
            if kind == "request_body":
                parts.append(req.request_body.body)
                if req.request_body.end_of_stream:
                    await context.write(self.ROUTE)
                    body = b"".join(parts)
                    for offset in range(0, len(body), BODY_CHUNK_LIMIT):
                        reply = pb.ProcessingResponse()
                        piece = reply.request_body.response.body_mutation.streamed_response
                        piece.body = body[offset:offset + BODY_CHUNK_LIMIT]
                        piece.end_of_stream = offset + BODY_CHUNK_LIMIT >= len(body)
                        await context.write(reply)
            elif kind == "response_headers":
                await context.write(pb.ProcessingResponse(response_headers=pb.HeadersResponse()))
            elif kind == "response_body":
                await context.write(pb.ProcessingResponse(response_body=pb.BodyResponse()))
                return  # lets go at the first token, as the picker does


async def serve_transport(port: int) -> None:
    """The answering servicer alone (`--serve-transport PORT`), in its own process so that its CPU is its own."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    pb_grpc.add_ExternalProcessorServicer_to_server(_Answering(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def measure_transport(args: argparse.Namespace, bodies: list[bytes]) -> dict[str, float]:
    """CPU per turn of the answering servicer (its own process, from /proc) for the turns' gRPC messages."""
    [port] = free_ports(1)
    proc = await asyncio.create_subprocess_exec(sys.executable, __file__, "--serve-transport", str(port))
    frame = args.frame_kb * 1024
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[
                ("grpc.max_send_message_length", 64 << 20)]) as channel:
            await asyncio.wait_for(channel.channel_ready(), 30)
            stub = pb_grpc.ExternalProcessorStub(channel)

            async def turn(body: bytes, session: str) -> None:
                call = stub.Process()
                msgs = envoy_messages(body, frame, session)
                for msg in msgs[:-2]:
                    await call.write(msg)
                while not (await call.read()).request_body.response.body_mutation.streamed_response.end_of_stream:
                    pass
                for msg in msgs[-2:]:
                    await call.write(msg)
                    await call.read()
                assert await call.read() is grpc.aio.EOF  # the server let go

            for body in bodies[:5]:  # warm-up
                await turn(body, "warm")
            c0 = process_cpu_seconds(proc.pid)
            for _ in range(args.transport_repeats):
                for i, body in enumerate(bodies):
                    await turn(body, f"s{i}")
            server = (process_cpu_seconds(proc.pid) - c0) / (len(bodies) * args.transport_repeats)
    finally:
        proc.terminate()
        await proc.wait()
    return {"transport_ms": server * 1e3}


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.fmean(r[key] for r in rows)


def report(args: argparse.Namespace, picked: dict[str, Any], transport: dict[str, float]) -> str:
    rows = picked["rows"]
    m = {k: _mean(rows, k) for k in ("tokens", "new_tokens", "body_bytes", "events", "pick_ms", "events_ms",
                                     "tokenize_new_ms", "hash_new_ms", "body_messages")}
    server_transport = transport["transport_ms"]
    turn_ms = m["pick_ms"] + m["events_ms"] + server_transport
    floor_ms = server_transport + m["tokenize_new_ms"] + m["hash_new_ms"] + m["events_ms"]
    lines = [
        "# One 100k-token agentic continuation turn, part by part (CPU per turn, threads included)", "",
        f"Command: `{' '.join(sys.argv)}`  ",
        f"{len(rows)} continuation turns of {args.conversations} conversations: {m['tokens']:,.0f} prompt tokens "
        f"({m['body_bytes'] / 1e3:,.0f} KB bodies, {m['body_messages']:.1f} body messages), {m['new_tokens']:,.0f} "
        f"new tokens a turn, {m['events']:.0f} KV-event batches a turn; {args.endpoints} endpoints.", "",
        "| part | ms per turn | turns per CPU-second |", "|---|---:|---:|",
        f"| pick (ext_proc service in-process: parse, tokenize, key, walk, score, claim, reply) | {m['pick_ms']:.2f} | "
        f"{1e3 / m['pick_ms']:.0f} |",
        f"| KV events of the turn (decode, apply) | {m['events_ms']:.2f} | {1e3 / m['events_ms']:.0f} |",
        f"| transport: the least-work servicer's CPU for the turn's messages (its own process) | "
        f"{server_transport:.2f} | {1e3 / server_transport:.0f} |",
        f"| **the turn (sum)** | **{turn_ms:.2f}** | **{1e3 / turn_ms:.0f}** |", "",
        "Floor (no CPython implementation of the precise pick avoids these):", "",
        "| part | ms per turn |", "|---|---:|",
        f"| transport, server side | {server_transport:.2f} |",
        f"| tokenizing the new text alone ({m['new_tokens']:,.0f} tokens) | {m['tokenize_new_ms']:.2f} |",
        f"| hashing its new blocks | {m['hash_new_ms']:.2f} |",
        f"| KV events of the turn | {m['events_ms']:.2f} |",
        f"| **floor** | **{floor_ms:.2f}** ({1e3 / floor_ms:.0f} turns per CPU-second) |", "",
        "The picker's caches over all turns (cold first turns included): "
        + ", ".join(f"`{k}` {v:g}" for k, v in picked["caches"].items()), ""]
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> str:
    picked = await measure_pick(args)
    convs = Conversations(args.conversations, args.context, args.seed + 1)
    prompts = PromptBuilder(args.seed + 1, default_tokenizer_dir())
    bodies = [json.dumps(turn_request(prompts.prompt(hash(c.session_id), tuple(c.segments)), args.output_tokens,
                                      c.session_id).body).encode() for c in convs.items]
    transport = await measure_transport(args, bodies)
    return report(args, picked, transport)


def main() -> int:
    """Entry point."""
    if sys.argv[1:2] == ["--serve-transport"]:
        asyncio.run(serve_transport(int(sys.argv[2])))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=20)
    p.add_argument("--rounds", type=int, default=4, help="continuation turns of each conversation")
    p.add_argument("--context", type=int, default=100_000, help="tokens a conversation is kept around")
    p.add_argument("--endpoints", type=int, default=100)
    p.add_argument("--output-tokens", type=int, default=1000, help="tokens out (their KV events)")
    p.add_argument("--frame-kb", type=int, default=512,
                   help="request body pieces as Envoy forwards them (about 2 a 560 KB body through Envoy 1.40)")
    p.add_argument("--turn-gap-s", type=float, default=20.0,
                   help="agent seconds between a session's turns (a tool run and a 1k-token answer: ~20 s; under "
                        "the match memo's 10 s every turn walks the index in full)")
    p.add_argument("--transport-repeats", type=int, default=5, help="times the transport part sends the bodies")
    p.add_argument("--seed", type=int, default=43)
    p.add_argument("--profile", help="write a cProfile of the continuation turns' picks here (the event loop's thread)")
    p.add_argument("--out", type=Path, help="write the report here too")
    args = p.parse_args()
    text = asyncio.run(main_async(args))
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
