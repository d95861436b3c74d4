"""The launcher installs the stop flag before anything else: a USR2 during start-up is kept,
not fatal (SLURM can signal a job as it starts)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT


def test_usr2_during_startup_is_remembered() -> None:
    code = "import os, signal, hpcrun.launch, hpcrun.signals; os.kill(os.getpid(), signal.SIGUSR2); os.kill(os.getpid(), signal.SIGTERM); print(hpcrun.signals.FLAG.signum)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "15", out.stderr


def test_without_the_flag_usr2_kills() -> None:
    """What the launcher prevents: the default action of USR2 ends the process."""
    out = subprocess.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGUSR2); print('alive')"], capture_output=True, text=True)
    assert out.returncode == -12 and "alive" not in out.stdout


def test_launcher_replaces_submitit_handlers() -> None:
    code = (
        "import signal, hpcrun.launch as l\n"
        "from submitit.core import job_environment as je\n"
        "import submitit.core.submission as s\n"
        "s.submitit_main = lambda: None\n"
        "l.main()\n"
        "je.JobEnvironment._handle_signals(None, None, None)\n"
        "print(signal.getsignal(signal.SIGUSR2).__self__ is hpcrun.signals.FLAG)\n"
    )
    out = subprocess.run([sys.executable, "-c", "import hpcrun.signals\n" + code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "True", out.stderr


def test_cpu_ranks_share_the_cores() -> None:
    import os

    from hpcrun.runtime.env import cpu_threads

    cores = len(os.sched_getaffinity(0))
    assert cpu_threads(1) == cores
    assert cpu_threads(cores) == 1 and cpu_threads(cores * 4) == 1
