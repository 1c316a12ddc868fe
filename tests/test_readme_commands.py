"""The commands the README tells a newcomer to type, run as typed: the Makefile's `run` and
`serve` recipes (as `make -n` prints them, with this interpreter as PYTHON) and the `llaisys`
lines of the README and docs/cli.md that use the reference device plugin. References: exit
statuses, what the processes print, the server's own /health and /v1/models answers, and the
path `make plugins` reports."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", ROOT / "docs" / "cli.md")

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def make_env() -> dict[str, str]:
    """The environment without an outer make's flags (under `make test`, MAKEFLAGS would make
    `make -n` print directory lines) and without an API key that would lock the server."""
    return {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "LLAISYS_API_KEY")}


def recipe(target: str, *variables: str) -> list[str]:
    """The command the Makefile's ``target`` runs after installing (its one line, the install
    step taken as done), as `make -n` prints it, split as the shell would."""
    proc = subprocess.run(["make", "-n", "--no-print-directory", "-o", "install", target, f"PYTHON={sys.executable}",
                           *variables],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, env=make_env())
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"`make -n {target}` runs more than one command after installing:\n{proc.stdout}"
    return shlex.split(lines[0])


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def installs(checkout: Path, *flags: str) -> bool:
    """Whether `make -n run` in ``checkout`` (with make's ``flags``) would run pip."""
    proc = subprocess.run(["make", "-n", "--no-print-directory", *flags, "run", f"PYTHON={sys.executable}"],
                          cwd=checkout, capture_output=True, text=True, timeout=60, env=make_env())
    assert proc.returncode == 0, proc.stderr
    return " -m pip install " in proc.stdout


def test_make_installs_once_and_again_when_its_sources_change(tmp_path) -> None:
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for part in ("Makefile", "pyproject.toml", "setup.py", "tools", "csrc", "include"):
        copy = shutil.copytree if (ROOT / part).is_dir() else shutil.copy2
        copy(ROOT / part, checkout / part)
    assert installs(checkout), "a checkout never installed does not install"
    stamp = subprocess.run([sys.executable, "tools/install_stamp.py", "base"], cwd=checkout, capture_output=True,
                           text=True, check=True).stdout.strip()
    (checkout / stamp).parent.mkdir(parents=True)
    (checkout / stamp).touch()  # what the install step leaves when it has run
    assert not installs(checkout), "an installed checkout installs again"
    c_source = next((checkout / "csrc").rglob("*.c")).relative_to(checkout)
    assert installs(checkout, "-W", str(c_source)), f"a changed {c_source} does not rebuild the native kernels"
    assert installs(checkout, "-W", "pyproject.toml"), "changed dependencies do not reinstall"


def test_make_run_prints_an_answer() -> None:
    cmd = recipe("run")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=make_env())
    assert proc.returncode == 0, proc.stderr
    words = re.findall(r"[A-Za-z']+", proc.stdout)
    assert len(words) >= 3, f"`{shlex.join(cmd)}` printed no answer: {proc.stdout!r}\n{proc.stderr}"


def test_make_serve_says_where_and_when_ready_and_stops_on_sigterm(tmp_path) -> None:
    port = free_port()
    cmd = recipe("serve", f"SERVE_ARGS=--port {port}")
    assert cmd[-2:] == ["--port", str(port)]
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, env=make_env())
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 120
        status = None
        while time.monotonic() < deadline and server.poll() is None:
            try:
                status, _ = get(url + "health", timeout=2)
            except OSError:
                status = None
            if status == 200:
                break
            time.sleep(0.5)
        assert status == 200, f"/health never answered 200:\n{log.read_text()}"
        name = json.loads(get(url + "v1/models")[1])["data"][0]["id"]
        page_status, page = get(url)
        assert page_status == 200 and b"<html" in page.lower()
        while time.monotonic() < deadline and "ready:" not in log.read_text():
            time.sleep(0.1)  # printed by a thread as the model becomes ready, next to /health's 200
        text = log.read_text()
        assert f"llaisys serve: chat page at {url}\n" in text, text
        assert f"llaisys serve: ready: {name} at {url}\n" in text, text
        assert text.index("chat page at") < text.index("ready:")
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0, log.read_text()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


# ---- the plugin lines of the docs ------------------------------------------------------------
def code_lines(path: Path) -> list[tuple[str, str | None, str]]:
    """(section heading, code or None, line) for each line of a markdown file; code: the line's
    text inside a fenced block or a block indented by 4."""
    out, heading, fenced = [], "", False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
            out.append((heading, None, line))
            continue
        if not fenced and re.match(r"#+ ", line):
            heading = line
        code = line if fenced else line[4:] if line.startswith("    ") else None
        out.append((heading, code, line))
    return out


def plugin_commands() -> list[tuple[Path, str, list[str]]]:
    """(file, section heading, argv) of each `llaisys` command in a code block of the docs that
    names the reference plugin's library."""
    return [(path, heading, shlex.split(code, comments=True))
            for path in DOCS for heading, code, _ in code_lines(path)
            if code and code.lstrip().startswith("llaisys ") and "libcustom_cpu.so" in code]


def make_plugins() -> Path:
    """Run `make plugins`; the library it reports."""
    proc = subprocess.run(["make", "--no-print-directory", "plugins", f"PYTHON={sys.executable}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=make_env())
    assert proc.returncode == 0, proc.stderr
    return Path(proc.stdout.strip().splitlines()[-1]).resolve()


def test_docs_plugin_commands_run_as_pasted_after_make_plugins() -> None:
    built = make_plugins()
    assert built.is_file()
    commands = plugin_commands()
    assert len(commands) >= 4, commands  # README's Use and Device plugins blocks, docs/cli.md
    for path, heading, argv in commands:
        where = f"{path.name}, section {heading!r}: {shlex.join(argv)}"
        assert [(ROOT / a).resolve() for a in argv if a.endswith("libcustom_cpu.so")] == [built], where
        lines = [line for h, _, line in code_lines(path) if h == heading]
        assert any("make plugins" in line for line in lines), f"{where}: the section does not say `make plugins`"
        argv = [sys.executable, "-m", "llaisys", *argv[1:]]
        if "generate" in argv:
            argv += ["--max-new-tokens", "8"]
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300, env=make_env())
        assert proc.returncode == 0, f"{where}\n{proc.stdout}\n{proc.stderr}"
