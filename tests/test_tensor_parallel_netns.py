"""Tensor parallelism across two "hosts": two ranks in two Linux network namespaces joined by a
veth pair (10.77.0.1/24, 10.77.0.2/24), their MPI traffic over TCP on the veth, give the tokens
(and logits) of one rank, for both netmods of the ch4 device of MPICH from PyPI (ucx, ofi).
Needs root and ``ip netns``; skipped, saying so, without them.

How the ranks start (there is no sshd): ``mpiexec -launcher manual -localhost 10.77.0.1 -hosts
10.77.0.1,10.77.0.2`` runs in namespace A and prints one proxy command per host,
``HYDRA_LAUNCH: .../hydra_pmi_proxy --control-port 10.77.0.1:PORT ... --proxy-id I``, then
``HYDRA_LAUNCH_END``, and waits for the proxies; the test runs proxy I under ``ip netns exec``
in namespace I. Each proxy connects back to the control port and starts rank I. The command
line is MPMD (``-n 1 -env VAR vethA CMD : -n 1 -env VAR vethB CMD``) because each namespace's
veth has its own name. Each rank runs ``tests/tp_ranks.py`` through this file (``python THIS
--rank-report PREFIX tp_ranks.py MODEL OUT``), which afterwards, before MPI is finalized at
exit, writes the rank's network namespace and the TCP sockets it holds, read from /proc: the
whole run takes about a second, too short to catch reliably from outside with ``ss``.

What listens, and how it is confined (MPICH 5.0.2, ``--with-device=ch4:ucx,ofi``; ucx is the
default netmod):

- mpiexec's control port: bound to 0.0.0.0 (Hydra listens on INADDR_ANY, with ``-localhost``
  or ``-iface`` too). ``-localhost`` names the address written into ``--control-port`` (without
  it Hydra picked 10.77.0.1 as well, the local one of ``-hosts``); ``-iface`` is passed to every
  proxy and sets ``MPIR_CVAR_NEMESIS_TCP_NETWORK_IFACE`` for the ranks, which only the ch3
  device reads. Only the namespace confines the port here; ``MPIEXEC_PORT_RANGE=LOW:HIGH``
  confines its number. The proxies listen on nothing (``--pmi-port 0``: a rank talks PMI over
  a socket pair it inherits; it also inherits its proxy's connection to the control port).
- ucx: left alone, UCX sees one kernel and carries the ranks' traffic over shared memory
  (sysv, cma) rather than the veth, and also listens on 127.0.0.1. ``UCX_TLS=self,tcp`` keeps
  it on TCP; ``UCX_NET_DEVICES=<veth>`` (per rank) makes it listen on the veth address only. A
  device a rank lacks draws a UCX warning, so one list of both names works but is noisy.
- ofi (``MPIR_CVAR_CH4_NETMOD=ofi``): ``FI_PROVIDER=tcp`` and ``FI_TCP_IFACE=<veth>`` (per rank).
  Without ``FI_TCP_IFACE`` it also listened on the veth address only, the namespaces holding no
  other non-loopback interface; on a host with several it names the one to use.

A veth end reaches operstate UP a moment after ``ip link set up`` (up to a second); UCX skips a
device not yet up, so the namespaces fixture waits for it.
"""
from __future__ import annotations

import json
import os
import queue
import runpy
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import logits_atol  # noqa: E402
from test_tensor_parallel import ROOT, RANKS_SCRIPT, descendants, random_models, run_ranks  # noqa: E402,F401

from llaisys.parallel.launch import find_mpiexec  # noqa: E402

ADDRESSES = ("10.77.0.1", "10.77.0.2")  # host 0 (namespace A, with mpiexec), host 1 (namespace B)
PREFIX = 24
RUN_TIMEOUT_S = 45  # the two-namespace run: everything it started is killed when it is past this
TEST_TIMEOUT_S = 100  # pytest-timeout's limit on the whole test, models and reference included

# the settings that keep each netmod on TCP over the veth: (for every rank, per rank: name -> veth)
NETMODS = {
    "ucx": ({"MPIR_CVAR_CH4_NETMOD": "ucx", "UCX_TLS": "self,tcp"}, "UCX_NET_DEVICES"),
    "ofi": ({"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}, "FI_TCP_IFACE"),
}


# ---- namespaces --------------------------------------------------------------------------------
def ip_command() -> str | None:
    for found in (shutil.which("ip"), "/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"):
        if found and os.access(found, os.X_OK):
            return found
    return None


@pytest.fixture(scope="module")
def ip() -> str:
    """The ``ip`` command, once ``ip netns add`` is seen to work; else the test is skipped."""
    if os.geteuid() != 0:
        pytest.skip("needs root: creating network namespaces and veth interfaces (ip netns add) requires root")
    ip = ip_command()
    if ip is None:
        pytest.skip("ip netns is unavailable: no `ip` command (iproute2) found")
    probe = f"llaisys-probe-{secrets.token_hex(4)}"
    added = subprocess.run([ip, "netns", "add", probe], capture_output=True, text=True, timeout=10)
    if added.returncode != 0:
        pytest.skip(f"ip netns is unavailable: `ip netns add {probe}` failed: {added.stderr.strip()}")
    subprocess.run([ip, "netns", "delete", probe], capture_output=True, timeout=10)
    return ip


@pytest.fixture
def namespaces(ip):
    """Two fresh namespaces (uniquely named), a veth pair between them with ADDRESSES, lo up in
    each: [(namespace, veth), ...]; deleted afterwards, whatever happened."""
    token = secrets.token_hex(3)
    pairs = [(f"llaisys-tp-{token}-{side}", f"lltp{token}{side}") for side in "ab"]
    (ns_a, veth_a), (ns_b, veth_b) = pairs

    def ip_(*args: str) -> None:
        proc = subprocess.run([ip, *args], capture_output=True, text=True, timeout=10)
        assert proc.returncode == 0, f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}"

    try:
        for ns, _ in pairs:
            ip_("netns", "add", ns)
        # made in the namespaces directly: the names never meet another interface's
        ip_("link", "add", veth_a, "netns", ns_a, "type", "veth", "peer", "name", veth_b, "netns", ns_b)
        for (ns, veth), address in zip(pairs, ADDRESSES):
            ip_("-n", ns, "addr", "add", f"{address}/{PREFIX}", "dev", veth)
            ip_("-n", ns, "link", "set", veth, "up")
            ip_("-n", ns, "link", "set", "lo", "up")
        # a veth end reports carrier (operstate UP) a moment after both ends are up (the kernel's
        # link watch runs up to a second later); UCX skips a device that is not yet running
        deadline = time.monotonic() + 10
        for ns, veth in pairs:
            while "state UP" not in (shown := subprocess.run([ip, "-n", ns, "-o", "link", "show", "dev", veth],
                                                              capture_output=True, text=True, timeout=10).stdout):
                assert time.monotonic() < deadline, f"{veth} in {ns} did not come up: {shown}"
                time.sleep(0.05)
        yield pairs
    finally:
        subprocess.run([ip, "-n", ns_a, "link", "delete", veth_a], capture_output=True, timeout=10)  # both ends
        for ns, _ in pairs:
            subprocess.run([ip, "netns", "delete", ns], capture_output=True, timeout=10)


def netns_inode(ns: str) -> int:
    """The inode of namespace ``ns`` (what /proc/PID/ns/net names of a process in it)."""
    for root in ("/run/netns", "/var/run/netns"):
        if os.path.exists(f"{root}/{ns}"):
            return os.stat(f"{root}/{ns}").st_ino
    raise FileNotFoundError(f"no /run/netns/{ns}")


# ---- sockets, from /proc ---------------------------------------------------------------------
TCP_STATES = {"01": "ESTABLISHED", "0A": "LISTEN"}


def _endpoint(text: str) -> tuple[str, int]:
    """"0100007F:1F90" (a /proc/net/tcp address: 32-bit words in host order) as ("127.0.0.1", 8080)."""
    address, port = text.split(":")
    raw = bytes.fromhex(address)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, raw), int(port, 16)


def tcp_sockets(pid: int | str = "self") -> list[tuple[str, tuple[str, int], tuple[str, int]]]:
    """The TCP sockets process ``pid`` holds open: (state, (local address, port), (remote
    address, port)), listening and established ones, from its network namespace's tables."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[9] in inodes and fields[3] in TCP_STATES:
                found.append((TCP_STATES[fields[3]], _endpoint(fields[1]), _endpoint(fields[2])))
    return found


def rank_main(report: str, script: str, *args: str) -> None:
    """A rank: run ``script args`` as ``__main__``, then, before MPI is finalized (at exit),
    write this rank's network namespace and TCP sockets to ``report.RANK.json``."""
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    rank = os.environ["PMI_RANK"]
    Path(f"{report}.{rank}.json").write_text(json.dumps({
        "rank": int(rank), "pid": os.getpid(), "netns": os.readlink("/proc/self/ns/net"),
        "sockets": tcp_sockets()}))


# ---- the processes the test starts -----------------------------------------------------------
def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2:].split()[19].decode()


class Started:
    """The processes a run started and every process seen under them or carrying ``marker`` in
    its command line (a rank whose proxy died is no longer under it); ``kill`` ends them all."""

    def __init__(self, marker: str):
        self.marker, self.popens, self.seen = marker, [], {}

    def popen(self, *args, **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(*args, start_new_session=True, **kwargs)
        self.popens.append(proc)
        self.note(proc.pid)
        return proc

    def note(self, pid: int) -> None:
        if pid not in self.seen and (start := _start_time(pid)) is not None:
            self.seen[pid] = start

    def survey(self) -> None:
        for proc in self.popens:
            for pid in descendants(proc.pid):
                self.note(pid)
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if self.marker.encode() in (entry / "cmdline").read_bytes():
                        self.note(int(entry.name))
                except OSError:
                    pass

    def kill(self) -> None:
        self.survey()
        for pid, start in self.seen.items():
            if _start_time(pid) == start:  # still that process, not a reused pid
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for proc in self.popens:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def _read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def run_in_namespaces(namespaces, netmod: str, model: str, out: Path, report: str) -> dict:
    """``tests/tp_ranks.py model out`` as two ranks, rank I in namespace I, MPI over TCP on the
    veth; the ranks' reports, mpiexec's control port and its listening sockets."""
    common, per_rank = NETMODS[netmod]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               **common)
    rank_cmd = [sys.executable, str(Path(__file__).resolve()), "--rank-report", report, str(RANKS_SCRIPT),
                model, str(out)]
    mpmd = []
    for i, (_, veth) in enumerate(namespaces):
        mpmd += ([":"] if i else []) + ["-n", "1", "-env", per_rank, veth, *rank_cmd]
    ip = ip_command()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    started = Started(report)
    output: list[str] = []
    try:
        mpiexec = started.popen([ip, "netns", "exec", namespaces[0][0], find_mpiexec(), "-launcher", "manual",
                                 "-localhost", ADDRESSES[0], "-hosts", ",".join(ADDRESSES), *mpmd],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                env=env)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_read_lines, args=(mpiexec.stdout, lines), daemon=True).start()
        proxies: dict[int, list[str]] = {}
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no HYDRA_LAUNCH_END from mpiexec in {RUN_TIMEOUT_S} s:\n"
                                     + "".join(output)) from None
            if line is None:
                raise AssertionError(f"mpiexec ended before printing its proxies' commands:\n{''.join(output)}")
            output.append(line)
            if line.startswith("HYDRA_LAUNCH_END"):
                break
            if line.startswith("HYDRA_LAUNCH:"):
                cmd = shlex.split(line.split(":", 1)[1])
                proxies[int(cmd[cmd.index("--proxy-id") + 1])] = cmd
        assert sorted(proxies) == [0, 1], output
        control = proxies[0][proxies[0].index("--control-port") + 1]  # host:port
        mpiexec_sockets = tcp_sockets(mpiexec.pid)  # waiting for the proxies: its control port is open
        for i, (ns, _) in enumerate(namespaces):  # proxy I on host I
            started.popen([ip, "netns", "exec", ns, *proxies[i]], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=env)
        while mpiexec.poll() is None:
            if time.monotonic() > deadline:
                started.kill()
                raise AssertionError(f"the two-namespace run took over {RUN_TIMEOUT_S} s; killed it:\n"
                                     + "".join(output))
            started.survey()
            time.sleep(0.2)
        try:
            while (line := lines.get(timeout=10)) is not None:
                output.append(line)
        except queue.Empty:
            pass
        assert mpiexec.returncode == 0, f"mpiexec exited with {mpiexec.returncode}:\n{''.join(output)}"
        for proc in started.popens[1:]:
            assert proc.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, "a proxy failed"
    finally:
        started.kill()
    reports = {}
    for rank in range(len(namespaces)):
        path = Path(f"{report}.{rank}.json")
        assert path.is_file(), f"rank {rank} wrote no report:\n{''.join(output)}"
        reports[rank] = json.loads(path.read_text())
    return {"reports": reports, "control": control, "mpiexec_sockets": mpiexec_sockets, "output": "".join(output)}


# ---- the test ----------------------------------------------------------------------------------
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("netmod", list(NETMODS))
def test_two_ranks_in_two_network_namespaces_over_tcp_equal_one(ip, namespaces, random_models, netmod, tmp_path):
    model = str(random_models / "llama")
    one = run_ranks(1, model, str(tmp_path / "one.npz"), timeout=RUN_TIMEOUT_S)
    assert one.returncode == 0, f"one rank failed:\n{one.stdout}\n{one.stderr}"

    start = time.monotonic()
    run = run_in_namespaces(namespaces, netmod, model, tmp_path / "two.npz", str(tmp_path / f"report-{netmod}"))
    print(f"two namespaces, {netmod}: {time.monotonic() - start:.1f} s")

    # where things listened: mpiexec on its control port only (0.0.0.0 or host 0's address),
    # each rank only on its own veth address, and the ranks connected over the veth
    host, port = run["control"].split(":")
    assert host == ADDRESSES[0]
    listening = [s[1] for s in run["mpiexec_sockets"] if s[0] == "LISTEN"]
    print(f"mpiexec listened on {listening}")
    assert listening and all(p == int(port) and a in ("0.0.0.0", ADDRESSES[0]) for a, p in listening), listening
    reports = run["reports"]
    for rank, (ns, _) in enumerate(namespaces):
        r = reports[rank]
        assert r["netns"] == f"net:[{netns_inode(ns)}]", f"rank {rank} ran outside {ns}"
        listens = [tuple(s[1]) for s in r["sockets"] if s[0] == "LISTEN"]
        print(f"rank {rank} ({ns}) listened on {listens}")
        assert listens and all(a == ADDRESSES[rank] for a, _ in listens), \
            f"rank {rank} listened on {listens}, not only on {ADDRESSES[rank]}"
    rank_listens = {tuple(s[1]) for r in reports.values() for s in r["sockets"] if s[0] == "LISTEN"}
    between = [s for r in reports.values() for s in r["sockets"] if s[0] == "ESTABLISHED"
               and s[1][0] != s[2][0] and (tuple(s[1]) in rank_listens or tuple(s[2]) in rank_listens)]
    print(f"connections between the ranks: {between}")
    assert between, f"no TCP connection between the ranks' listening ports: {reports}"

    # the tokens (and logits) of one rank
    two, ref = np.load(tmp_path / "two.npz"), np.load(tmp_path / "one.npz")
    np.testing.assert_array_equal(two["loop"], ref["loop"])
    np.testing.assert_array_equal(two["engine"], ref["engine"])
    scale = max(1.0, float(np.abs(ref["logits"]).max()))
    np.testing.assert_allclose(two["logits"], ref["logits"], rtol=0, atol=logits_atol(ref["logits"], 1e-5 * scale))


if __name__ == "__main__":  # a rank of run_in_namespaces
    assert sys.argv[1] == "--rank-report", sys.argv
    rank_main(*sys.argv[2:])
