"""A model-server stand-in in its own process, so a test can kill it mid-request (SIGKILL).

Serves SSE completions (one event every `delay` seconds) and vLLM's `/metrics` page;
`POST /fault {"metrics": MODE}` makes `/metrics` misbehave from then on: "hang" (never answers),
"garbage" (200 with bytes that are no Prometheus text), "huge" (200 with a 5 MB page), "500",
or "ok" again.
Run as: python -m tests.reliability.backend_process PORT NAME
"""

from __future__ import annotations

import asyncio
import json
import sys

from aiohttp import web

from tests.support.vllm_metrics import VllmState, vllm_metrics_page

METRICS = vllm_metrics_page(VllmState(model="m", kv_usage=0.1))


def main(port: int, name: str) -> None:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "x-backend": name})
        await resp.prepare(request)
        try:
            for i in range(int(body.get("events", 5))):
                await resp.write(f"data: {json.dumps({'choices': [{'text': f't{i}'}]})}\n\n".encode())
                await asyncio.sleep(float(body.get("delay", 0.2)))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client (or Envoy) went away mid-stream: what the fault tests do on purpose
        return resp

    fault = {"metrics": "ok"}
    huge = METRICS + "".join(f"# padding line {i:08d} {'x' * 80}\n" for i in range(5_000_000 // 100))

    async def metrics(_request: web.Request) -> web.Response:
        mode = fault["metrics"]
        if mode == "hang":
            await asyncio.sleep(3600)
        if mode == "garbage":
            return web.Response(body=bytes(range(256)) * 64, content_type="application/octet-stream")
        if mode == "huge":
            return web.Response(text=huge)
        if mode == "500":
            return web.Response(status=500, text="internal error")
        return web.Response(text=METRICS)

    async def set_fault(request: web.Request) -> web.Response:
        fault.update(await request.json())
        return web.json_response(fault)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/fault", set_fault)
    print("ready", flush=True)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
