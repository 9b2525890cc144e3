"""Seeded random ext_proc streams for the fuzz harness: what a stream sends and what it may expect.

Every case is built from one `random.Random`, so a seed and a case index reproduce it exactly.
Cases mix valid and invalid phase orders, bodies split at random bytes, hostile headers and
metadata, non-UTF-8, deep nesting, huge numbers and strings, wrong field types, cancellations,
idle streams, garbage protobuf and hostile model-server responses.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/conversations", "/v1/embeddings")
SUBSET_KEY = "x-gateway-destination-endpoint-subset"


@dataclass
class Case:
    """One stream: the messages to send, and what the harness may check about the answers."""

    index: int
    kind: str
    request: list[pb.ProcessingRequest] = field(default_factory=list)
    response: list[pb.ProcessingRequest] = field(default_factory=list)
    garbage: bytes = b""
    complete: bool = True          # the request phase ends (EoS or trailers) in a valid order
    ordered: bool = True           # phases in Envoy's order
    subset: tuple[str, ...] | None = None
    rewrite: bool = False          # a model-name rewrite is asked for: response bytes may change
    response_chunks: list[bytes] = field(default_factory=list)
    cancel_after: int | None = None  # cancel the call after this many messages
    idle: bool = False             # never completes: the idle timeout must answer


def _headers(pairs: list[tuple[str, bytes]]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in pairs])


class CaseMaker:
    """Builds cases for a pool; `pool` are `ip:port` strings the picker serves."""

    def __init__(self, seed: int, pool: tuple[str, ...]) -> None:
        self.rng = random.Random(seed)
        self.pool = pool

    # -- hostile atoms ----------------------------------------------------------------------

    def text(self, size: int | None = None) -> str:
        rng = self.rng
        size = rng.choice((0, 1, 5, 20, 100)) if size is None else size
        alphabet = rng.choice(("abc xyz", "é漢字🙂\u200b", "\x00\x01\n\t\"\\<>&", "aaaa"))
        return "".join(rng.choice(alphabet) for _ in range(size))

    def model(self) -> object:
        rng = self.rng
        roll = rng.random()
        if roll < 0.6:
            return rng.choice(("m", "llama", "tiny", "org/model-7b", "lora-a"))
        if roll < 0.7:
            return self.text(rng.choice((1, 50, 300, 5000)))
        if roll < 0.8:
            return rng.choice((123, None, [], {}, True, 1.5, ""))
        if roll < 0.9:
            return "m" * rng.choice((129, 2000, 100_000))
        return "model-" + str(rng.randrange(10_000))

    def deep(self, depth: int) -> str:
        opener, closer = self.rng.choice((("[", "]"), ('{"a":', "}")))
        return opener * depth + "1" + closer * depth

    def huge_number(self) -> str:
        return self.rng.choice(("1e999999", "-1e999999", "9" * 5000, "1" + "0" * 400, "-0", "1.5e-400",
                                "123456789012345678901234567890"))

    # -- request bodies ---------------------------------------------------------------------

    def valid_fields(self, path: str) -> dict:
        rng = self.rng
        content = self.text(rng.choice((0, 10, 200, 3000)))
        if path.endswith("/chat/completions"):
            fields: dict = {"messages": [{"role": "user", "content": content}] * rng.randint(1, 3)}
        elif path.endswith("/completions"):
            fields = {"prompt": rng.choice((content or "x", [content or "x", "y"], [1, 2, 3], [[1, 2], [3]]))}
        elif path.endswith("/responses"):
            fields = {"input": content or "x", "instructions": self.text()}
        elif path.endswith("/conversations"):
            fields = {"items": [{"role": "user", "content": content}]}
        else:
            fields = {"input": content or "x"}
        if rng.random() < 0.3:
            fields["stream"] = rng.choice((True, False, "yes", 1))
        if rng.random() < 0.2:
            fields["cache_salt"] = rng.choice(("salt", 5, ""))
        return fields

    def body(self, path: str) -> tuple[bytes, str]:
        """A request body and what kind it is."""
        rng = self.rng
        roll = rng.random()
        if roll < 0.55:
            fields = {"model": self.model(), **self.valid_fields(path)}
            return json.dumps(fields, ensure_ascii=rng.random() < 0.5).encode(), "valid"
        if roll < 0.62:
            depth = rng.choice((129, 300, 1000, 5000, 50_000))
            field_name = rng.choice(("prompt", "messages", "input", "x"))
            return ('{"model":"m","' + field_name + '":' + self.deep(depth) + "}").encode(), "deep"
        if roll < 0.68:
            escape = rng.choice((r"\ud800", r"\udfff", r"\ud83d", r"\ud83d\ude00"))
            where = rng.choice(("model", "prompt"))
            fields = {"model": "m", "prompt": "p"}
            raw = json.dumps(fields).replace(f'"{fields[where]}"', f'"x{escape}y"', 1)
            return raw.encode(), "surrogate"
        if roll < 0.73:
            return ('{"model":"m","prompt":"x","n":' + self.huge_number() + "}").encode(), "huge_number"
        if roll < 0.76:
            size = rng.choice((100_000, 1_000_000))
            return json.dumps({"model": "m", "prompt": "z" * size}).encode(), "huge_string"
        if roll < 0.84:
            wrong = rng.choice(({"model": "m", "messages": "x"}, {"model": "m", "messages": [1]},
                                {"model": "m", "messages": [{"content": 5}]}, {"model": "m", "prompt": {}},
                                {"model": "m", "prompt": [[]]}, {"model": "m", "prompt": [1.5]},
                                {"model": "m", "input": 0}, {"model": "m", "items": "x"}, [], "s", 5, None))
            return json.dumps(wrong).encode(), "wrong_types"
        if roll < 0.92:
            good = json.dumps({"model": "m", "prompt": "hello"}).encode()
            broken = rng.choice((good[: rng.randrange(len(good))], b"\xff\xfe\x00garbage", good + b"}}",
                                 good.replace(b"hello", b"hel\xc3\x28lo"), b"", b"no healthy upstream",
                                 good.decode().encode("utf-16"), b'{"model":"m","model":"n","prompt":"x"}'))
            return broken, "invalid_json"
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))), "random_bytes"

    # -- headers and metadata ---------------------------------------------------------------

    def request_headers(self, path: str) -> tuple[list[tuple[str, bytes]], bool]:
        """Request headers, and whether a model rewrite is asked for."""
        rng = self.rng
        pairs: list[tuple[str, bytes]] = [(":method", b"POST"), (":path", path.encode()), (":authority", b"gw"),
                                          ("content-type", b"application/json")]
        rewrite = False
        for _ in range(rng.choice((0, 0, 1, 3, 8))):
            roll = rng.random()
            if roll < 0.3:
                name = rng.choice(("x-gateway-destination-endpoint", "x-gateway-destination-endpoint-served",
                                   "x-gateway-inference-objective", "x-gateway-inference-fairness-id",
                                   "x-request-id", SUBSET_KEY))
                pairs.append((name, rng.choice((b"192.0.2.1:80", b"", b"\xff\xfe", self.text().encode()))))
            elif roll < 0.4:
                rewrite = True
                pairs.append(("x-gateway-model-name-rewrite", rng.choice((b"other", b"m", b"\xff", b"x" * 1000))))
            elif roll < 0.6:
                pairs.append((f"x-junk-{rng.randrange(1000)}", bytes(rng.randrange(256) for _ in range(20))))
            elif roll < 0.65:
                pairs.append(("x-big", b"v" * rng.choice((1000, 100_000, 200_000))))
            else:
                pairs.append((self.text(8).lower() or "x", self.text().encode("utf-8", "surrogatepass")))
        if rng.random() < 0.03:
            pairs.extend((f"x-many-{i}", b"v") for i in range(rng.choice((150, 250))))
        return pairs, rewrite

    def subset(self) -> tuple[struct_pb2.Value | None, tuple[str, ...] | None]:
        """A subset hint as Envoy would forward it (list or comma string, some junk), and its meaning."""
        rng = self.rng
        roll = rng.random()
        if roll < 0.6:
            return None, None
        members = rng.sample(self.pool, rng.randint(0, len(self.pool)))
        entries = members + rng.sample(["192.0.2.9:80", "10.9.9.9", "junk", "[::1]:1", ""], rng.randint(0, 2))
        if rng.random() < 0.3:
            entries += [ep.rpartition(":")[0] for ep in rng.sample(self.pool, 1)]  # bare IP: any port
        value = struct_pb2.Value()
        if roll < 0.85:
            value.list_value.extend(entries)
        elif roll < 0.95:
            value.string_value = ",".join(entries)
        else:
            value.number_value = 5  # wrong type: treated as an empty hint
            return value, ()
        return value, tuple(e.strip() for e in entries if e.strip())

    # -- responses --------------------------------------------------------------------------

    def response(self, sse: bool) -> bytes:
        rng = self.rng
        roll = rng.random()
        usage = rng.choice(('{"prompt_tokens":5,"completion_tokens":2}', self.deep(5000), self.huge_number(),
                            '{"prompt_tokens":"x","completion_tokens":' + self.huge_number() + "}",
                            '{"prompt_tokens_details":{"cached_tokens":' + self.huge_number() + "}}", "null"))
        if sse:
            lines = [f'data: {{"choices":[{{"text":{json.dumps(self.text())}}}]}}\n\n' for _ in range(rng.randint(0, 3))]
            if roll < 0.5:
                lines.append(f'data: {{"choices":[],"usage":{usage}}}\n\n')
            elif roll < 0.7:
                lines.append('data: {"type":"response.completed","response":' + rng.choice(('[1]', '"x"', "{}"))
                             + ',"usage":1}\n\n')
            elif roll < 0.85:
                lines.append("data: " + self.deep(rng.choice((2000, 20_000))) + " usage\n\n")
            else:
                lines.append("data: \udcff\udcfe usage garbage\n\n")  # raw 0xff 0xfe: not UTF-8
            lines.append("data: [DONE]\n\n")
            return "".join(lines).encode("utf-8", "surrogateescape")
        if roll < 0.5:
            return f'{{"id":"x","model":"m","choices":[],"usage":{usage}}}'.encode()
        if roll < 0.7:
            return self.deep(rng.choice((1000, 5000, 100_000))).encode()
        if roll < 0.85:
            return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 500)))
        return json.dumps({"model": "m", "usage": {"input_tokens": 3}, "text": "y" * rng.choice((10, 70_000))}).encode()

    # -- whole streams ----------------------------------------------------------------------

    def split(self, data: bytes, eos: bool, response: bool = False) -> list[pb.ProcessingRequest]:
        cuts = sorted(self.rng.sample(range(1, len(data)), min(len(data) - 1, self.rng.randint(0, 5)))) \
            if len(data) > 1 else []
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)] or [b""]
        out = []
        for i, piece in enumerate(pieces):
            body = pb.HttpBody(body=piece, end_of_stream=eos and i == len(pieces) - 1)
            out.append(pb.ProcessingRequest(response_body=body) if response else pb.ProcessingRequest(request_body=body))
        return out

    def make(self, index: int) -> Case:
        rng = self.rng
        roll = rng.random()
        if roll < 0.02:
            case = Case(index, "garbage", complete=False, ordered=False)
            case.garbage = rng.choice((bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))),
                                       b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x05abc"))
            return case
        path = rng.choice(PATHS) if rng.random() < 0.9 else rng.choice(("/", "/v1/models?x=1", "/\xff" * 3,
                                                                         "/v1/" + "a" * 5000))
        headers, rewrite = self.request_headers(path)
        hint_value, hint = self.subset()
        header_only = rng.random() < 0.08
        first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=_headers(headers),
                                                                    end_of_stream=header_only))
        if hint_value is not None:
            first.metadata_context.filter_metadata["envoy.lb.subset_hint"].fields[SUBSET_KEY].CopyFrom(hint_value)
        case = Case(index, "header_only" if header_only else "request", request=[first], subset=hint,
                    rewrite=rewrite)
        if not header_only:
            body, kind = self.body(path)
            case.kind = kind
            ending = rng.random()
            if ending < 0.85:
                case.request += self.split(body, eos=True)
            elif ending < 0.95:  # the body ends with trailers instead of end_of_stream
                case.request += self.split(body, eos=False)
                case.request.append(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
            else:  # never ends: an idle stream
                case.request += self.split(body, eos=False)
                case.complete, case.idle, case.kind = False, True, "idle"
        if not case.idle:
            sse = rng.random() < 0.4
            status = rng.choice((b"200", b"200", b"200", b"500", b"429"))
            content_type = b"text/event-stream" if sse else rng.choice((b"application/json", b"text/plain"))
            case.response.append(pb.ProcessingRequest(response_headers=pb.HttpHeaders(
                headers=_headers([(":status", status), ("content-type", content_type)]))))
            data = self.response(sse)
            case.response_chunks = [data]
            case.response += self.split(data, eos=True, response=True)
            if rng.random() < 0.3:
                case.response.append(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
        if rng.random() < 0.06:
            messages = case.request + case.response
            rng.shuffle(messages)
            case.request, case.response = messages, []
            # The hint rides on the headers message: a request scheduled before it came never saw it.
            ends = [i for i, m in enumerate(messages) if m.WhichOneof("request") in ("request_body", "request_trailers")]
            if ends and messages.index(first) > min(ends):
                case.subset = None
            case.ordered, case.complete, case.kind = False, False, "invalid_order"
        elif rng.random() < 0.05:
            case.cancel_after = rng.randrange(len(case.request) + len(case.response) + 1)
            case.kind = "cancelled"
        return case
