"""Worked pages run as shown: their shell blocks start the stack, their Python blocks print what the page says.

`docs/bbr.md`: its one-machine try-out runs, and its request reaches the adapter's base model's pool.

`docs/sim-fleet-sdk.md`: the shell blocks (all but the install and the `kill` at the end) run in a
fresh folder with `.venv/bin` first on PATH, the page's fixed ports swapped for free ones; the
Python blocks then run in order in one interpreter, and what each prints must be the `text` block
that follows it on the page. `EPP_DOCS_WRITE=1` writes the outputs into the page instead (then
read the diff before committing it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.markdown import ROOT, Fence, fences
from tests.support.ports import free_port

pytestmark = [pytest.mark.envoy, pytest.mark.timeout(240)]

SDK_PAGE = ROOT / "docs" / "sim-fleet-sdk.md"
# The ports the page names: clients (Envoy's listener), the picker's three, Envoy's admin.
PAGE_PORTS = ("8081", "9002", "9003", "9090", "19000")
END = "\0--block-end--"
READY = "--stack-ready--"
RUNNER = f"""\
import json, sys
namespace = {{"__name__": "__main__"}}
for number, block in enumerate(json.loads(sys.stdin.read())):
    exec(compile(block, f"python block {{number + 1}}", "exec"), namespace)
    print({END!r}, flush=True)
"""


def runnable_shell(fence: Fence) -> bool:
    """The shell blocks that start things (not the install, not the `kill` that stops them)."""
    text = fence.text.strip()
    return fence.lang == "bash" and "pip install" not in text and not text.startswith("kill")


def with_ports(text: str, ports: dict[str, str]) -> str:
    return re.sub(r"(?<!\d)(" + "|".join(ports) + r")(?!\d)", lambda m: ports[m.group(1)], text)


def python_blocks_and_outputs(page: Path) -> list[tuple[Fence, Fence]]:
    """Each Python block with the `text` block right after it."""
    blocks = fences(page)
    pairs = []
    for i, fence in enumerate(blocks):
        if fence.lang == "python":
            following = blocks[i + 1] if i + 1 < len(blocks) else None
            assert following is not None and following.lang == "text", f"{fence.where}: no text block after it"
            pairs.append((fence, following))
    return pairs


def write_outputs(page: Path, outputs: list[str]) -> None:
    """Put each output into the text block after its Python block (EPP_DOCS_WRITE=1)."""
    lines = page.read_text().splitlines(keepends=True)
    for (_, text_block), output in sorted(zip(python_blocks_and_outputs(page), outputs),
                                          key=lambda pair: -pair[0][1].line):
        start = text_block.line  # the opening fence's line (1-based): the body starts after it
        end = start + len(text_block.text.splitlines())
        body = text_block.text.rstrip("\n")
        lines[start:end if body else start] = [output]
    page.write_text("".join(lines))


def start_shell(page: Path, ports: dict[str, str], cwd: Path) -> tuple[subprocess.Popen, str]:
    """Run the page's shell blocks; the shell stays, as a user's does (Envoy ends with the shell that started it)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    script = "\n".join(with_ports(f.text, ports) for f in fences(page) if runnable_shell(f))
    script += f"\necho {READY}\nwait\n"
    stack = subprocess.Popen(["bash", "-e", "-c", script], cwd=cwd, env=env, start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    said = _read_until_ready(stack, timeout=120)
    if not said.endswith(READY + "\n"):
        _stop_group(stack)
        pytest.fail(said + "".join(f"\n--- {log.name}:\n{log.read_text()[-2000:]}" for log in cwd.glob("*.log")))
    return stack, said


def test_the_bbr_page_try_out_runs_and_routes_the_adapter_to_its_base_models_pool(tmp_path):
    ports = {port: str(free_port()) for port in (*PAGE_PORTS, "9012", "9013", "9091", "9092", "9004", "9005")}
    stack, said = start_shell(ROOT / "docs" / "bbr.md", ports, tmp_path)
    try:
        assert said.startswith("HTTP/1.1 200 OK") and "x-sim-replica: pool-a-" in said
        assert '"model":"a-lora"' in said
    finally:
        _stop_group(stack)


def test_the_sdk_page_runs_as_shown(tmp_path):
    ports = {port: str(free_port()) for port in PAGE_PORTS}
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    stack, _ = start_shell(SDK_PAGE, ports, tmp_path)
    try:
        pairs = python_blocks_and_outputs(SDK_PAGE)
        run = subprocess.run([sys.executable, "-c", RUNNER], cwd=tmp_path, env=env, timeout=120,
                             input=json.dumps([with_ports(code.text, ports) for code, _ in pairs]),
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-4000:]
        outputs = run.stdout.split(END + "\n")[:-1]
        assert len(outputs) == len(pairs)
        if os.environ.get("EPP_DOCS_WRITE") == "1":
            write_outputs(SDK_PAGE, outputs)
            return
        for (code, shown), printed in zip(pairs, outputs):
            assert printed == shown.text, f"{code.where} prints\n{printed}but the page shows\n{shown.text}"
    finally:
        _stop_group(stack)


def _read_until_ready(stack: subprocess.Popen, timeout: float) -> str:
    """What the shell printed up to its ready line (or up to its end, or the timeout)."""
    import selectors
    import time

    said = ""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(stack.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline and not said.endswith(READY + "\n"):
            if not selector.select(timeout=0.5):
                continue
            line = stack.stdout.readline()
            if not line:
                break
            said += line
    return said


def _stop_group(stack: subprocess.Popen) -> None:
    """Whatever the shell left running in its session (the fleet, the picker, Envoy) is stopped."""
    import time

    try:
        os.killpg(stack.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        stack.wait(timeout=10)  # the shell itself, reaped: until then its session id stays taken
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.killpg(stack.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(stack.pid, signal.SIGKILL)
