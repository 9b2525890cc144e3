"""The scorer author's path: install examples/outside_scorer into a fresh venv and schedule with it."""

import json
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from tests.support.outside_package import first_python_block, install_example, run

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "outside_scorer"

SCRIPT = textwrap.dedent("""
    import asyncio, json
    from types import MappingProxyType
    from epp.config import load_config_text, describe
    from epp.framework import CycleState, Endpoint, EndpointMetrics, InferenceRequest

    CONFIG = '''
    apiVersion: inference.networking.x-k8s.io/v1alpha1
    kind: EndpointPickerConfig
    plugins:
    - type: kv-headroom-scorer
      parameters: {threshold: 0.5}
    schedulingProfiles:
    - name: default
      plugins:
      - pluginRef: kv-headroom-scorer
        weight: 2
    '''

    async def main():
        loaded = load_config_text(CONFIG, source="outside.yaml")
        eps = [Endpoint("10.1.0.%d" % i, 8000, metrics=EndpointMetrics(kv_cache_usage=kv))
               for i, kv in enumerate([0.45, 0.05, 0.30, 0.90])]
        scorer = loaded.plugin("kv-headroom-scorer")
        req = InferenceRequest("r1", "completions", "m", "m", {"model": "m", "prompt": "hi"})
        state = CycleState()
        picks = {loaded.scheduler.schedule(CycleState(), req, eps).targets[0].name for _ in range(20)}
        scores = scorer.score(state, req, eps)
        try:
            load_config_text(CONFIG.replace("0.5", "2"), source="outside.yaml")
            error = None
        except Exception as exc:
            error = str(exc)
        print(json.dumps({"picks": sorted(picks), "scores": {k: round(v, 6) for k, v in scores.items()},
                          "module": type(scorer).__module__, "describe": describe(loaded), "error": error}))

    asyncio.run(main())
""")


@pytest.mark.slow
def test_outside_scorer_package_installs_and_schedules(tmp_path):
    python = install_example(EXAMPLE, "epp_kv_headroom", tmp_path)

    done = run([str(python), "-c", SCRIPT], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["module"] == "epp_kv_headroom"
    assert out["scores"] == {"10.1.0.0:8000": 0.1, "10.1.0.1:8000": 0.9, "10.1.0.2:8000": 0.4, "10.1.0.3:8000": 0.0}
    assert out["picks"] == ["10.1.0.1:8000"]
    assert "- kv-headroom-scorer weight 2" in out["describe"]
    assert out["error"] == ("outside.yaml: plugins[0].parameters: plugin 'kv-headroom-scorer': "
                            "parameter 'threshold' must be <= 1.0, got 2.0")

    # Installed only into the fresh venv: the environment running the tests is unchanged.
    assert "kv-headroom" not in {ep.name for ep in entry_points(group="epp.plugins")}


def test_the_readme_plugin_example_is_the_example_package():
    code = first_python_block(ROOT / "README.md", "## Writing a plugin")
    assert code == (EXAMPLE / "epp_kv_headroom" / "__init__.py").read_text(encoding="utf-8")
