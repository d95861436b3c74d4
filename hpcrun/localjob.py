"""The local "scheduler" of `--site local`: a detached controller that runs the rendered local
script once per rank, like srun would, and behaves like SLURM towards them.

- Each rank gets torchrun-style variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE) plus
  HPCRUN_LOCAL_JOB_ID (the controller's pid, the job id `status` and `cancel` use) and
  HPCRUN_REQUEUES (which submission of the run this is), and its own log files.
- USR2 `signal_lead_s` before the time limit, SIGTERM at it, SIGKILL after KILL_WAIT_S.
- SIGTERM/SIGUSR2 sent to the controller (`hpcrun cancel`) are forwarded to every rank.
- A rank that fails ends the others at once (srun's --kill-on-bad-exit): a peer that waits in a
  collective for a dead rank would otherwise hang until the collective timeout.
- A failed attempt that no rank lived to record (a rank killed) is recorded here, as the batch
  script's failure step records it on SLURM (hpcrun.runtime.failure); `hpcrun resume` continues it.

hpcrun owns this instead of using submitit's local executor because that executor offers no
public way to start its controller in a session of its own (so a Ctrl-C at `submit --wait`
would reach the ranks) and installs its own signal handlers in every task.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
import typing as tp
from pathlib import Path

from hpcrun.rundir import RunDir, local_scratch, read_json, snapshot_job_dir

# Time for ranks to save after SIGTERM before SIGKILL. SLURM's default KillWait is 30 s; this is
# the test cluster's KillWait (20 s), the shorter one: a job that stops in time here does there.
KILL_WAIT_S = 20.0
POLL_S = 0.2


def start(run_dir: RunDir, ranks: int, time_min: int, signal_lead_s: int, slurm_requeues: int) -> str:
    """Start the controller detached (its own session, its own log) and return its job id. The
    caller's stdout/stderr are not inherited: a pipe (`| tee`, a test) closes when hpcrun exits."""
    run_dir.logs.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "hpcrun.localjob", str(run_dir.path),
        "--ranks", str(ranks), "--time-s", str(time_min * 60), "--signal-lead-s", str(signal_lead_s),
        "--requeues", str(slurm_requeues),
    ]
    with run_dir.controller_log.open("ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    return str(proc.pid)


class Controller:
    def __init__(self, run_dir: RunDir, ranks: int, time_s: float, signal_lead_s: float, slurm_requeues: int) -> None:
        self.run_dir, self.ranks = run_dir, ranks
        # the run's earlier submissions: what SLURM_RESTART_COUNT is under SLURM (hpcrun.slurm.requeue_count)
        self.time_s, self.lead_s, self.slurm_requeues = time_s, signal_lead_s, slurm_requeues
        self.job_id = str(os.getpid())
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pending: list[int] = []  # signals received, forwarded from the loop (not from the handler)

    def _on_signal(self, signum: int, frame: tp.Any) -> None:
        self.pending.append(signum)

    def _send(self, signum: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(signum)
                except ProcessLookupError:
                    pass

    def launch(self) -> None:
        for rank in range(self.ranks):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(self.ranks),
                "LOCAL_WORLD_SIZE": str(self.ranks),
                "HPCRUN_LOCAL_JOB_ID": self.job_id,
                "HPCRUN_REQUEUES": str(self.slurm_requeues),
            }
            with (
                self.run_dir.log(self.job_id, rank, "out").open("ab") as out,
                self.run_dir.log(self.job_id, rank, "err").open("ab") as err,
            ):
                self.procs.append(
                    subprocess.Popen(
                        ["bash", str(self.run_dir.script)], env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL
                    )
                )

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        start = time.monotonic()
        self.launch()
        warned = terminated = False
        kill_at: float | None = None
        ended: list[str] = []  # srun's words for the ranks that failed before this controller ended any
        first_code = 0  # the exit status of the rank that failed first, not of those killed after it
        while any(p.poll() is None for p in self.procs):
            now = time.monotonic() - start
            while self.pending:
                signum = self.pending.pop(0)
                self._send(signal.SIGTERM if signum == signal.SIGINT else signum)
                if signum != signal.SIGUSR2 and kill_at is None:
                    kill_at = now + KILL_WAIT_S
            if not warned and now >= self.time_s - self.lead_s:
                warned = True
                self._send(signal.SIGUSR2)
            if not terminated and now >= self.time_s:
                terminated = True
                print(f"hpcrun local job {self.job_id}: time limit reached, SIGTERM to every rank", flush=True)
                self._send(signal.SIGTERM)
                kill_at = now + KILL_WAIT_S
            failed = [i for i, p in enumerate(self.procs) if p.poll() not in (None, 0)]
            if failed and kill_at is None:  # --kill-on-bad-exit
                self._send(signal.SIGKILL)
                kill_at = now
                # seen in one look: a rank a signal ended first (an exit status is more often a peer's consequence)
                failed.sort(key=lambda rank: tp.cast(int, self.procs[rank].returncode) > 0)
                first_code = tp.cast(int, self.procs[failed[0]].returncode)
                ended = [task_ended(rank, tp.cast(int, self.procs[rank].returncode)) for rank in failed]
                print(f"hpcrun local job {self.job_id}: rank {failed[0]} exited with {first_code}; ending the others",
                      flush=True)
            if kill_at is not None and now >= kill_at:
                self._send(signal.SIGKILL)
            time.sleep(POLL_S)
        codes = [p.returncode for p in self.procs]
        self.remove_snapshots()
        code = first_code or next((c for c in codes if c != 0), 0)
        if code:
            self.record(code, ended or [cancelled(self.job_id, terminated)])
        return code

    def record(self, code: int, said: list[str]) -> None:
        """What the batch script's failure step does after srun: the attempt's record when no rank
        wrote one (a rank killed, by the OOM killer say, or ended by a signal): without it the run
        would have no end on disk. `said`: srun's words for how the step ended."""
        from hpcrun import slurm
        from hpcrun.errors import HpcrunError
        from hpcrun.runtime.failure import record_failed_step

        # the attempt as the ranks count it (hpcrun.runtime.env), from the environment they inherit
        env = {**os.environ, "HPCRUN_REQUEUES": str(self.slurm_requeues)}
        ids = (self.job_id, slurm.attempt_number(env), slurm.requeue_count(env))
        try:
            reason = record_failed_step(self.run_dir, code, "\n".join(said) + "\n", ids=ids)
        except Exception as exc:  # noqa: BLE001 - the ranks are gone whatever happens here: one line, not a traceback
            said_why = exc.format_message() if isinstance(exc, HpcrunError) else f"{type(exc).__name__}: {exc}"
            print(f"hpcrun local job {self.job_id}: recording the failed attempt: {said_why}", flush=True)
            return
        if reason:
            print(f"hpcrun local job {self.job_id}: attempt failed: {reason}", flush=True)

    def remove_snapshots(self) -> None:
        """What the sbatch script does at a job's end: remove this job's in-memory snapshots
        (hpcrun.runtime.snapshot), which ranks that were killed could not."""
        spec = read_json(self.run_dir.spec, missing={})
        scratch = local_scratch(spec.get("local_scratch") or "/dev/shm")
        shutil.rmtree(snapshot_job_dir(scratch, self.job_id, self.slurm_requeues), ignore_errors=True)


def task_ended(rank: int, code: int) -> str:
    """srun's line for a task that ended badly (hpcrun.runtime.cause reads it), e.g. "srun: error:
    HOST: task 1: Killed"; `code` as subprocess gives it (negative: the signal)."""
    from hpcrun.runtime.cause import SIGNAL_WORDS

    if code > 0:
        what = f"Exited with exit code {code}"
    else:
        try:
            name = signal.Signals(-code).name
        except ValueError:  # a real-time signal: no name
            name = f"signal {-code}"
        what = next((word for word, sig in SIGNAL_WORDS.items() if sig == name), f"Signal {name}")
    return f"srun: error: {os.uname().nodename}: task {rank}: {what}"


def cancelled(job_id: str, at_limit: bool) -> str:
    """slurmstepd's line for a job this controller ended (a cancel, the time limit) whose ranks did
    not record their stop in time."""
    when, why = time.strftime("%Y-%m-%dT%H:%M:%S"), " DUE TO TIME LIMIT" if at_limit else ""
    return f"*** JOB {job_id} ON {os.uname().nodename} CANCELLED AT {when}{why} ***"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcrun.localjob")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--time-s", type=float, required=True)
    parser.add_argument("--signal-lead-s", type=float, required=True)
    parser.add_argument("--requeues", dest="slurm_requeues", type=int, default=0)
    args = parser.parse_args(argv)
    controller = Controller(RunDir(args.run_dir), args.ranks, args.time_s, args.signal_lead_s, args.slurm_requeues)
    return controller.run()


if __name__ == "__main__":
    sys.exit(main())
