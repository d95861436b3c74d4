"""A command job: the user's own training script under hpcrun, unchanged.

Launchers (the recipe's `job.launcher`):
- `srun`: SLURM starts one task per rank; each task's hpcrun process starts the command with
  RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set beside SLURM's own variables, so a
  Lightning script's SLURM detection sees the allocation it runs in.
- `torchrun`: SLURM starts one task per node (holding the node's CPUs and GPUs); each runs
  `torchrun --nnodes <nodes> --nproc-per-node <ranks per node>` with c10d rendezvous on the first
  node's high-speed name (that node hosts the store: no guessing from hostnames, which network
  namespaces and multi-homed nodes get wrong), each node announcing its own high-speed name,
  and no torchrun restarts (a failed attempt is hpcrun's to record and requeue).

Stopping. SLURM signals every process of a job step, the command and its workers included:
USR2 ahead of the time limit, SIGTERM on preemption or scancel. The command starts with USR2
ignored (a script that installs its own handler still gets it): the default action of USR2
is to die, and a script that never asked for it must not die before it saves. When the attempt
must stop, hpcrun sends the command one SIGTERM, the signal torchrun, Lightning (through
hpcrun.lightning) and most scripts take as "save and exit"; scripts must treat repeated stop
signals as one. A command that exits after a stop signal, whatever its exit code, is a
stopped attempt that requeues; one still running `stop_grace_s` later is killed with its
children and requeued all the same (it resumes from its own last save).

The run's places are in the command's environment: HPCRUN_RUN_DIR, HPCRUN_RUN_ID,
HPCRUN_CHECKPOINT_DIR (where to save and resume), HPCRUN_METRICS (hpcrun.runtime.reported),
and PL_TRAINER_DEFAULT_ROOT_DIR (a Lightning Trainer's root, unless the script names its own),
so that a Lightning run's checkpoints are its own and not its working directory's. Under the
torchrun launcher TORCH_ELASTIC_SHUTDOWN_TIMEOUT (unless set) gives the workers hpcrun's grace
after the stop signal, not torchrun's 30 s.
"""

from __future__ import annotations

import math
import os
import shlex
import signal
import subprocess
import sys
import time
import typing as tp
from pathlib import Path

from hpcrun.recipe import CommandJob
from hpcrun.runtime.context import Context
from hpcrun.runtime.reported import Reported
from hpcrun.runtime.steps import attempt_ids

# `sh` sets USR2 ignored and execs the command, which keeps it ignored (an ignored signal
# survives exec; a Python handler would not): thread-safe, unlike a preexec_fn.
IGNORE_USR2 = ("/bin/sh", "-c", 'trap "" USR2; exec "$@"', "hpcrun-command")

# The most a user script gets to exit after SIGTERM (preemption, the time limit itself): well
# below the shortest KillWait hpcrun runs under (20 s: the test cluster's and the local
# controller's; SLURM's default is 30 s), so that after a kill the rank still has time to write
# its row and requeue before SIGKILL.
STOP_GRACE_MAX_S = 12.0
# After USR2 (signal_lead_s before the time limit) a script may use the whole lead for its save
# (a sharded FSDP or DeepSpeed checkpoint of a real model takes minutes), less this margin for
# hpcrun's own record and requeue.
USR2_MARGIN_S = 30.0

POLL_S = 0.2


def run_command(ctx: Context) -> None:
    job = ctx.recipe.job
    assert isinstance(job, CommandJob)
    run_dir = ctx.run_dir
    reported_path = run_dir.reported(ctx.env.job_id, ctx.env.attempt)
    env = {
        **os.environ, "HPCRUN_RUN_DIR": str(run_dir.path), "HPCRUN_RUN_ID": ctx.spec.run_id,
        "HPCRUN_CHECKPOINT_DIR": str(ctx.checkpoints.root), "HPCRUN_METRICS": str(reported_path),
    }
    env.setdefault("PL_TRAINER_DEFAULT_ROOT_DIR", str(run_dir.lightning))
    if job.launcher == "torchrun":
        # torchrun SIGKILLs its workers this long after forwarding SIGTERM (30 s unless told):
        # never before hpcrun's own grace ends, or a long save after USR2 would be cut short
        env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(math.ceil(max_grace_s(ctx.spec.signal_lead_s)) + 5))
    reported = None
    if ctx.env.is_main:
        reported_path.parent.mkdir(parents=True, exist_ok=True)
        reported = Reported(reported_path, ctx.spec.results_dir, run_dir.progress, attempt_ids(ctx), ctx.info)
    cwd = Path(ctx.spec.recipe_path).resolve().parent / job.workdir if job.workdir else None
    argv = [*IGNORE_USR2, *(torchrun_argv(ctx) if job.launcher == "torchrun" else []), *job.command]
    ctx.info(f"command ({job.launcher}): {shlex.join(argv[len(IGNORE_USR2):])}")  # the torchrun line included
    ctx.flag.child = child = subprocess.Popen(argv, env=env, cwd=cwd)
    interval = ctx.recipe.metrics.flush_seconds
    try:
        code = wait_stoppable(child, ctx, (reported.poll, interval) if reported else None)
    finally:
        if child.poll() is None:  # this rank failed while waiting: the command must not outlive it
            kill_tree(child.pid)
    if ctx.flag.signum is not None:
        ctx.stopped = signal.Signals(ctx.flag.signum).name
    if reported is not None:
        reported.poll()
        fold(ctx, reported)
    if ctx.stopped:
        ctx.info(f"{ctx.stopped}: command exited with status {code} after the stop signal, stopping for requeue")
        return
    if code != 0:
        raise RuntimeError(
            f"command {job.command[0]!r} exited with status {code} "
            f"on {'node' if job.launcher == 'torchrun' else 'rank'} {ctx.rank}"
        )


def torchrun_argv(ctx: Context) -> list[str]:
    """torchrun for this node: the rendezvous store on the first node (task 0, the node the
    script's MASTER_ADDR names), this node's high-speed name for its peers to reach it. c10d
    numbers the nodes by their sorted --local-addr: global rank 0 is not necessarily on the
    first node."""
    spec, env = ctx.spec, ctx.env
    master, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    node = os.environ.get("SLURMD_NODENAME")
    names = spec.site.network.hostname
    local = f"{names.prefix}{node}{names.suffix}" if node else master
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={spec.nodes}", f"--nproc-per-node={spec.ranks_per_node}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={master}:{port}",
        f"--rdzv-id={env.allocation_id}-{env.attempt}",  # a requeued attempt is a new rendezvous
        f"--rdzv-conf=is_host={int(env.rank == 0)}", f"--local-addr={local}",
        "--max-restarts=0", "--no-python",
    ]


def fold(ctx: Context, reported: Reported) -> None:
    """The script's reported steps as the attempt's measurements (the results row's steps,
    step times, final loss and extras)."""
    lines = reported.lines
    if not lines:
        return
    ctx.start_step = lines[0].step - 1
    ctx.step = lines[-1].step - (1 if ctx.stopped else 0)  # the row counts a stopped attempt's last step + 1
    m = ctx.measured
    m.losses = [line.values["loss"] for line in lines if "loss" in line.values]
    m.step_times = reported.step_times()
    m.extra.update(lines[-1].extra)


def stop_grace_s(ctx: Context) -> float:
    """How long a script may take to save and exit after the stop signal it got: after USR2,
    the lead SLURM gives before the time limit less USR2_MARGIN_S (at least half of it); after
    SIGTERM, half the lead and at most STOP_GRACE_MAX_S, since on preemption only KillWait
    separates SIGTERM from SIGKILL."""
    lead = ctx.spec.signal_lead_s
    if ctx.flag.signum == signal.SIGUSR2:
        return max_grace_s(lead)
    return max(1.0, min(STOP_GRACE_MAX_S, lead / 2))


def max_grace_s(lead: float) -> float:
    """The longest grace, USR2's."""
    return max(1.0, lead / 2, lead - USR2_MARGIN_S)


def wait_stoppable(
    child: subprocess.Popen[bytes], ctx: Context, every: tuple[tp.Callable[[], None], float] | None = None
) -> int:
    """The command's exit status. After a stop signal it gets `stop_grace_s` to exit, then is
    killed with its children (its exit is then a stop like any other). `every` is a function
    to call, and its interval, while waiting."""
    deadline: float | None = None
    grace = signalled = 0.0
    killed = False
    last = time.monotonic()
    while True:
        try:
            return child.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if every is not None and now - last >= every[1]:
            every[0]()
            last = now
        if ctx.flag.signum is not None:
            if deadline is None:
                ctx.flag.forward()  # a signal that came before the child existed
                signalled, grace = now, stop_grace_s(ctx)
            grace = min(grace, stop_grace_s(ctx))  # SIGTERM after USR2 (preemption): KillWait is near
            deadline = signalled + grace
        if deadline is not None and now > deadline and not killed:  # once: SIGKILL needs no repeating
            killed = True
            ctx.info(f"command still running {grace:.0f} s after the stop signal: killed with its children")
            kill_tree(child.pid)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant (torchrun's workers must not outlive it)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    todo, found = [pid], []
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    for p in found:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
