"""A model-server stand-in in its own process, so a test can kill it mid-request (SIGKILL).

Serves SSE completions (one event every `delay` seconds) and a vLLM-shaped `/metrics`.
Run as: python -m tests.reliability.backend_process PORT NAME
"""

from __future__ import annotations

import asyncio
import json
import sys

from aiohttp import web

METRICS = ("vllm:num_requests_waiting{model_name=\"m\"} 0\nvllm:num_requests_running{model_name=\"m\"} 0\n"
           "vllm:kv_cache_usage_perc{model_name=\"m\"} 0.1\n")


def main(port: int, name: str) -> None:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "x-backend": name})
        await resp.prepare(request)
        for i in range(int(body.get("events", 5))):
            await resp.write(f"data: {json.dumps({'choices': [{'text': f't{i}'}]})}\n\n".encode())
            await asyncio.sleep(float(body.get("delay", 0.2)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics)
    print("ready", flush=True)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
