"""Through real Envoy: with `--emit-endpoint-scores` the pick's scores reach Envoy's dynamic metadata.

Envoy runs the config `epp envoy-config` ships (its ext_proc filter accepts the picker's
`envoy.lb` metadata) with an access log added that prints the scores key, as an operator would
read them; the replicas are echo backends that report the load the scorers see.
"""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from epp.datalayer.registry import parse_endpoint_list
from epp.debug.scores import ENDPOINT_SCORES_KEY
from epp.envoy import EnvoyProcess, render_config
from epp.server.runner import EppServer, ServeOptions
from tests.support.backends import EchoBackend
from tests.support.configs import endpoint_picker_config
from tests.support.ports import free_port

pytestmark = [pytest.mark.envoy, pytest.mark.timeout(60)]

CONFIG = endpoint_picker_config(["queue-scorer", "prefix-cache-scorer"], {"queue-scorer": 1, "prefix-cache-scorer": 2})
ACCESS_LOG = f"%DYNAMIC_METADATA(envoy.lb:{ENDPOINT_SCORES_KEY})% %DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint)%"


def with_access_log(config: str, path: Path) -> str:
    """The shipped Envoy config with a file access log of the picker's `envoy.lb` metadata."""
    anchor = "          stat_prefix: inference\n"
    assert anchor in config
    log = (f"          access_log:\n"
           f"          - name: envoy.access_loggers.file\n"
           f"            typed_config:\n"
           f"              \"@type\": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog\n"
           f"              path: {path}\n"
           f"              log_format:\n"
           f"                text_format_source:\n"
           f"                  inline_string: \"{ACCESS_LOG}\\n\"\n")
    return config.replace(anchor, anchor + log)


@pytest.mark.parametrize("emit", [None, "scorers"])
async def test_the_picks_scores_reach_envoys_access_log(tmp_path, emit):
    backends = [EchoBackend(f"b{i}") for i in range(3)]
    for b in backends:
        await b.start()
    epp = EppServer(ServeOptions(
        grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
        endpoints=parse_endpoint_list(",".join(b.hostport for b in backends)), config_text=CONFIG,
        scrape_metrics=False, grace_period_s=1, emit_endpoint_scores=emit))
    await epp.start()
    listen, admin = free_port(), free_port()
    log_path = tmp_path / "access.log"
    envoy = EnvoyProcess(with_access_log(render_config(listen_port=listen, admin_port=admin,
                                                       epp_port=epp.grpc_port), log_path), admin)
    await envoy.start()
    prompt = "the same long prompt, sent twice " * 20
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(2):
                async with http.post(f"http://127.0.0.1:{listen}/v1/completions",
                                     json={"model": "m", "prompt": prompt}) as resp:
                    assert resp.status == 200
                    served = resp.headers["x-backend"]
    finally:
        await envoy.stop()  # which flushes its access log
        await epp.stop(0)
        for b in backends:
            await b.stop()
    lines = log_path.read_text().splitlines()
    assert len(lines) == 2
    scores_text, destination = lines[1].split(" ")
    assert destination == next(b.hostport for b in backends if b.name == served)
    if emit is None:
        assert scores_text == "-"  # Envoy's mark for a missing metadata key
        return
    scores = json.loads(scores_text)["default"]
    # The second request found its prefix on the first one's endpoint: queue 1 x 1 + prefix 2 x 1.
    assert list(scores)[0] == destination
    assert scores[destination] == {"total": 3.0, "scorers": {"queue-scorer": 1.0, "prefix-cache-scorer": 1.0}}
    others = [s for ep, s in scores.items() if ep != destination]
    assert len(others) == 2 and all(s["scorers"]["prefix-cache-scorer"] == 0.0 for s in others)
