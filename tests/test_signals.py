"""The launcher installs the stop flag before anything else: a USR2 during start-up is kept,
not fatal (SLURM can signal a job as it starts)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT


def test_usr2_during_startup_is_remembered() -> None:
    code = (
        "import os, signal, hpcrun.launch, hpcrun.signals; os.kill(os.getpid(), signal.SIGUSR2); "
        "os.kill(os.getpid(), signal.SIGTERM); print(hpcrun.signals.FLAG.signum)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "15", out.stderr


def test_without_the_flag_usr2_kills() -> None:
    """What the launcher prevents: the default action of USR2 ends the process."""
    out = subprocess.run(
        [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGUSR2); print('alive')"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == -12 and "alive" not in out.stdout


def test_job_environment_leaves_the_flag_in_place() -> None:
    """Inside a SLURM task the ranks come from srun's variables (no SUBMITIT_EXECUTOR set, no
    submitit), and reading them leaves the stop flag's handlers in place (submitit's would requeue
    from inside a handler on one rank). MASTER_ADDR, when the script did not set it, is the node
    list's first host."""
    import os

    code = (
        "import signal, hpcrun.launch, hpcrun.signals\n"
        "from hpcrun.runtime.env import from_scheduler\n"
        "env = from_scheduler()\n"
        "import os\n"
        "print(env.rank, env.world_size, env.job_id, env.allocation_id, os.environ['MASTER_ADDR'])\n"
        "print(all(signal.getsignal(s).__self__ is hpcrun.signals.FLAG for s in (signal.SIGUSR2, signal.SIGTERM)))\n"
    )
    slurm = {
        "SLURM_JOB_ID": "77",
        "SLURM_ARRAY_JOB_ID": "70",
        "SLURM_ARRAY_TASK_ID": "3",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "4",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_JOB_NODELIST": "gpu[07-08],cpu3",
        "SLURM_NODEID": "0",
        "SLURM_JOB_NUM_NODES": "1",
        "OMP_NUM_THREADS": "1",
    }
    environ = {k: v for k, v in os.environ.items() if k not in ("SUBMITIT_EXECUTOR", "MASTER_ADDR")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env={**environ, **slurm}
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["1 4 70_3 77 gpu07", "True"], out.stdout + out.stderr


def test_a_rank_dying_of_a_fatal_signal_leaves_its_threads_stacks() -> None:
    """A library's abort (DeepSpeed's once ended a completed ZeRO-Infinity rank with SIGABRT, no word of where)
    leaves every thread's Python stack in the rank's log, and the status stays the signal's."""
    code = (
        "import os, signal, threading, time, hpcrun.launch\n"
        "def helper_thread_waits(): time.sleep(60)\n"
        "threading.Thread(target=helper_thread_waits, daemon=True).start(); time.sleep(0.2)\n"
        "os.kill(os.getpid(), signal.SIGABRT)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == -6, out.stderr
    assert "Fatal Python error: Aborted" in out.stderr and "helper_thread_waits" in out.stderr, out.stderr


def test_launch_usage_is_one_line() -> None:
    out = subprocess.run([sys.executable, "-m", "hpcrun.launch"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and out.stderr.strip() == "usage: python -m hpcrun.launch RUN_DIR"


def test_cpu_ranks_share_the_cores() -> None:
    import os

    from hpcrun.runtime.env import cpu_threads

    cores = len(os.sched_getaffinity(0))
    assert cpu_threads(1) == cores
    assert cpu_threads(cores) == 1 and cpu_threads(cores * 4) == 1


RANK = """
import os, signal, sys, datetime
import hpcrun.launch  # the stop flag, as in a SLURM task
import torch, torch.distributed as dist
dist.init_process_group("gloo", rank=int(sys.argv[1]), world_size=2, timeout=datetime.timedelta(seconds=120))
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGSTOP)  # a peer that stops answering, its connection open
print("in all_reduce", flush=True)
dist.all_reduce(torch.ones(4))
print("returned", flush=True)
"""


def test_sigterm_ends_a_rank_blocked_in_a_collective_within_seconds() -> None:
    """A rank waiting in gloo for a stopped peer never runs its Python SIGTERM handler; the
    watcher thread ends it within seconds (with its stacks), not at SLURM's SIGKILL (see
    hpcrun.signals on why that wait makes a requeued job's next attempt fail)."""
    import os
    import signal
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        assert ranks[0].stdout is not None and ranks[0].stdout.readline().strip() == "in all_reduce"
        time.sleep(1.0)  # inside the collective
        assert ranks[0].poll() is None
        sent = time.monotonic()
        ranks[0].send_signal(signal.SIGTERM)
        out, err = ranks[0].communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    assert ranks[0].returncode == 128 + signal.SIGTERM, err
    assert took < 15, took
    assert "returned" not in out and "did not return to Python" in err and "all_reduce" in err, err
