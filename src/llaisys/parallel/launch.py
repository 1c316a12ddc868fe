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
from pathlib import Path
from typing import Sequence

LAUNCHERS = ("mpiexec", "mpirun")


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


def relaunch(ranks: int, argv: Sequence[str]) -> int:
    """Run ``llaisys argv`` as ``ranks`` ranks on this host, wait, and return the exit status.

    When a rank dies, the launcher ends the others; the status then says so on stderr."""
    cmd = launch_command(ranks, argv)
    with subprocess.Popen(cmd) as proc:
        try:
            status = proc.wait()
        except KeyboardInterrupt:  # the ranks got the same SIGINT and stop as they would alone
            try:
                status = proc.wait()
            except KeyboardInterrupt:  # a second one: stop them now
                proc.send_signal(signal.SIGKILL)
                status = proc.wait()
    if status not in (0, 1, 2, 130):
        print(f"llaisys: a tensor-parallel rank ended abnormally (launcher exit status {status}); "
              f"all {ranks} ranks were stopped", file=sys.stderr)
    return status
