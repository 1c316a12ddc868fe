"""Starting the ranks of a tensor-parallel run: ``llaisys ... --tensor-parallel N`` outside an
MPI launcher runs itself again under ``mpiexec -n N`` (the one installed with mpi4py's MPICH
by the ``mpi`` extra, next to the Python executable, else the first on PATH), so a user need
not know MPI. Across hosts, call ``mpiexec`` yourself (docs/tensor-parallel.md).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Sequence

LAUNCHERS = ("mpiexec", "mpirun")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOP_GRACE_S = 15.0  # after a stop signal, how long the ranks may take to end before they are killed


def find_mpiexec() -> str:
    """The MPI launcher to use; FileNotFoundError saying how to install one when there is none."""
    here = Path(sys.executable).parent
    for name in LAUNCHERS:
        if (here / name).is_file() and os.access(here / name, os.X_OK):
            return str(here / name)
    for name in LAUNCHERS:
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError("--tensor-parallel needs an MPI launcher (mpiexec) and none was found; install one "
                            "with `pip install 'llaisys[mpi]'` (mpi4py and MPICH from PyPI)")


def launch_command(ranks: int, argv: Sequence[str]) -> list[str]:
    """The command that runs ``llaisys argv`` as ``ranks`` MPI ranks on this host."""
    return [find_mpiexec(), "-n", str(ranks), sys.executable, "-m", "llaisys", *argv]


def relaunch(ranks: int, argv: Sequence[str], grace_s: float = STOP_GRACE_S) -> int:
    """Run ``llaisys argv`` as ``ranks`` ranks on this host, wait, and return the exit status.

    mpiexec runs in a session of its own; a SIGINT or SIGTERM this process gets (SIGHUP as
    SIGTERM) is passed on to it, and it passes it on to every rank: rank 0 stops as it would
    alone and lets the others go. What is left ``grace_s`` seconds later, or at a second
    signal, is killed: mpiexec's process group and every process under it (MPICH's ranks run
    in sessions of their own). Stopped by a signal, the status is mpiexec's when the ranks
    ended cleanly (0, or 130 after SIGINT), else 128 + the signal. When a rank dies, the
    launcher ends the others; the status then says so on stderr."""
    cmd = launch_command(ranks, argv)
    proc = subprocess.Popen(cmd, start_new_session=True)  # our signals reach it once, through us
    received: list[tuple[int, float]] = []  # (signal, monotonic time), in order

    def forward(sig: int, frame: FrameType | None) -> None:
        received.append((sig, time.monotonic()))
        if len(received) == 1:
            _send(proc.pid, signal.SIGTERM if sig == signal.SIGHUP else sig)
        else:  # a second one: stop now
            _kill_all(proc.pid)

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS
                if signal.getsignal(sig) is not signal.SIG_IGN}  # left ignored, e.g. SIGHUP under nohup
    try:
        while True:
            try:
                status = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if received and time.monotonic() > received[0][1] + grace_s:
                    print(f"llaisys: the {ranks} ranks had not stopped {grace_s:g} s after "
                          f"{signal.Signals(received[0][0]).name}; killing them", file=sys.stderr)
                    _kill_all(proc.pid)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:  # an exception here: leave nothing running
            _kill_all(proc.pid)
            proc.wait()
    if received:
        return status if status in (0, 130) else 128 + received[0][0]
    if status not in (0, 1, 2, 130):
        print(f"llaisys: a tensor-parallel rank ended abnormally (launcher exit status {status}); "
              f"all {ranks} ranks were stopped", file=sys.stderr)
    return status


def _send(pid: int, sig: int) -> None:
    """``os.kill`` that ignores a process already gone."""
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (children, theirs, ...), from /proc; [] where there is none."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])  # after "pid (name) state"
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _kill_all(pid: int) -> None:
    """SIGKILL the process ``pid``, everything under it and its process group."""
    for p in [pid, *_descendants(pid)]:
        _send(p, signal.SIGKILL)
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
