"""The parser author's path: install examples/outside_parser into a fresh venv and route Ollama requests with it."""

import json
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from tests.support.outside_package import first_python_block, install_example, run

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "outside_parser"

SCRIPT = textwrap.dedent('''
    import asyncio, json
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from epp.config import describe
    from epp.datalayer.registry import parse_endpoint_list
    from epp.server.extproc import ExtProcService, _Stream
    from epp.server.runner import EppServer, ServeOptions

    CONFIG = """
    apiVersion: llm-d.ai/v1alpha1
    kind: EndpointPickerConfig
    plugins:
    - type: ollama-parser
    - type: openai-parser
    - type: prefix-cache-scorer
    - type: queue-scorer
    requestHandler:
      parsers: [{pluginRef: ollama-parser}, {pluginRef: openai-parser}]
    schedulingProfiles:
    - name: default
      plugins: [{pluginRef: prefix-cache-scorer, weight: 3}, {pluginRef: queue-scorer}]
    """
    SYSTEM = "You are the support assistant of a router maker. Quote the manual. " * 20

    def headers(pairs):
        return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])

    async def one(service, path, body, ndjson=None):
        """One request through the ext_proc service: (destination or error, usage, api, parser module)."""
        stream = _Stream(service)
        await service._dispatch(stream, pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers(
            [(":method", "POST"), (":path", path), ("content-type", "application/json")]))))
        try:
            replies = await service._dispatch(stream, pb.ProcessingRequest(request_body=pb.HttpBody(
                body=json.dumps(body).encode(), end_of_stream=True)))
        except Exception as exc:
            reply = service.error_reply(exc, path).immediate_response
            return {"status": reply.status.code, "error": json.loads(reply.body)}
        mutation = replies[0].request_headers.response.header_mutation
        target = next(h.header.raw_value.decode() for h in mutation.set_headers
                      if h.header.key == "x-gateway-destination-endpoint")
        if ndjson is not None:
            service_headers = [(":status", "200"), ("content-type", "application/x-ndjson")]
            await service._dispatch(stream, pb.ProcessingRequest(response_headers=pb.HttpHeaders(
                headers=headers(service_headers))))
            for i, line in enumerate(ndjson):
                await service._dispatch(stream, pb.ProcessingRequest(response_body=pb.HttpBody(
                    body=(json.dumps(line) + "\\n").encode(), end_of_stream=i == len(ndjson) - 1)))
        request = stream.life.request
        out = {"target": target, "usage": stream.life.response.usage, "api": request.api,
               "module": type(request.format).__module__, "first_token": stream.life.first_token_seen}
        stream.life.complete(aborted=True)
        return out

    async def main():
        server = EppServer(ServeOptions(grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
                                        endpoints=parse_endpoint_list(",".join(f"127.0.0.1:{9000 + i}" for i in range(8))),
                                        scrape_metrics=False, config_text=CONFIG))
        await server.start()
        try:
            service = ExtProcService(server.director, server.parser, server.metrics)
            answer = [{"model": "llama3", "response": "Hold", "done": False},
                      {"model": "llama3", "response": " reset.", "done": False},
                      {"model": "llama3", "response": "", "done": True, "prompt_eval_count": 412, "eval_count": 3}]
            first = await one(service, "/api/generate", {"model": "llama3", "system": SYSTEM,
                                                         "prompt": "How do I reset it?"}, answer)
            follow = [await one(service, "/api/generate", {"model": "llama3", "system": SYSTEM,
                                                            "prompt": f"Question {i}: which light is on?"})
                      for i in range(6)]
            bad = await one(service, "/api/generate", {"model": "llama3", "prompt": 7})
            openai = await one(service, "/v1/completions", {"model": "m", "prompt": "hi"})
            print(json.dumps({"first": first, "follow": follow, "bad": bad, "openai": openai,
                              "describe": describe(server.pipeline)}))
        finally:
            await server.stop(0)

    asyncio.run(main())
''')


@pytest.mark.slow
def test_outside_parser_package_installs_and_routes(tmp_path):
    python = install_example(EXAMPLE, "epp_ollama_parser", tmp_path)

    done = run([str(python), "-c", SCRIPT], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    first = out["first"]
    assert (first["api"], first["module"], first["first_token"]) == ("generate", "epp_ollama_parser", True)
    assert first["usage"] == {"prompt_tokens": 412, "completion_tokens": 3}  # read from the NDJSON's last line
    # The shared system prompt steers every follow-up to the endpoint that holds it (prefix-cache-scorer).
    assert {f["target"] for f in out["follow"]} == {first["target"]}
    assert out["bad"] == {"status": 400, "error": {"error": "inference error: BadRequest - prompt must be a string"}}
    assert (out["openai"]["api"], out["openai"]["module"]) == ("completions", "epp.scorers.parsers.openai")
    assert "parsers (asked in order; a path goes to the first that claims it): ollama-parser, openai-parser, " \
           "passthrough-parser" in out["describe"]

    # Installed only into the fresh venv: the environment running the tests is unchanged.
    assert "ollama-parser" not in {ep.name for ep in entry_points(group="epp.plugins")}


def test_the_docs_parser_example_is_the_example_package():
    code = first_python_block(ROOT / "docs" / "parsers.md", "## Writing a parser")
    assert code == (EXAMPLE / "epp_ollama_parser" / "__init__.py").read_text(encoding="utf-8")
