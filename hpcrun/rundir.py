"""The one owner of hpcrun's places on disk: a run directory's layout and file names, a sweep's
directory, and how every state file is written (atomically, durably) and read (a corrupt file is
an error naming it, never an empty default).

Everything else asks this module for a path; no other module spells a file name (checked by
tests/test_layers.py). It imports nothing of hpcrun's but the error type, so both the login side
and the runtime may use it: a run directory's, a checkpoint's and a results directory's names.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import time
import typing as tp
from pathlib import Path

from filelock import FileLock

from hpcrun.errors import HpcrunError

SPEC = "runspec.json"
SCRIPT = "script.sh"
JOBS = "jobs.json"
SUBMITTING = "submitting.json"
STATE = "state.json"
LOGS = "logs"
CHECKPOINTS = "checkpoints"
FINAL_WEIGHTS = "final-weights.pt"
WEIGHTS_DIGEST = "weights.sha256"
DEEPSPEED_CONFIG = "deepspeed-config.json"
CONTROLLER_LOG = "controller.log"
FUNCTION = "function.pkl"  # a function job's pickled call (hpcrun.executor), rewritten by its checkpoint
PROGRESS = "progress.json"
TENSORBOARD = "tensorboard"
EXITS = "exits"
SAVING = ".saving"  # exits/<job>-<attempt>-rank<r>.saving: a survivor's save under way
SILENT = ".silent"  # exits/<job>-<attempt>-rank<r>.silent: the pulse ring named rank r silent
SURVIVOR_CLAIM = "survivor-"  # <node's snapshot dir of a run>/survivor-<attempt>-step-N: who writes step N there
STARTS = "starts"  # starts/<SLURM job id>: one line per start of the training step (the batch script's count)
LEDGER = "ledger.json"
SWEEPS = "sweeps"
LIGHTNING = "lightning"  # a Lightning command job's Trainer root (PL_TRAINER_DEFAULT_ROOT_DIR)
LIGHTNING_PARTIAL = "hpcrun-stop.partial"  # a stop save being written there (not Lightning's `hpc_ckpt_` name)
# inside checkpoints/ (hpcrun.runtime.checkpoint)
STEP = "step-"  # step-NNNNNNNN/: a complete checkpoint
PARTIAL_STEP = ".tmp-"  # .tmp-step-NNNNNNNN/: one being written, renamed into place when complete
MANIFEST = "manifest.json"  # written last, inside a step's directory
ENGINE_STATE = "state"  # the engine's own files (DCP, or DeepSpeed's with ENGINE_STATE as its tag)
UNIVERSAL = "universal"  # beside DeepSpeed's tag: its universal checkpoint, converted for another world size
# under a results directory (hpcrun.results, hpcrun.steps)
RESULTS_STEPS = "steps"  # the per-step dataset, one directory per run
UNREADABLE = "unreadable"  # result files compaction could not read, set aside (never deleted)


class CorruptStateError(HpcrunError):
    """A state file that exists but cannot be read: refused, because guessing (reading it as
    empty) would resubmit work or overwrite a live run."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"corrupt state file, refusing to guess its content ({why}); inspect or restore it", path)


def fsync_dir(path: Path) -> None:
    """Make a rename (or a new entry) in `path` durable: without it a crash can lose the entry
    even though the file's own data was synced."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Every file and directory under `path`, and `path` itself, made durable (deepest first)."""
    for entry in [*sorted(path.rglob("*"), reverse=True), path]:
        fsync_dir(entry)  # os.fsync of a read-only descriptor: a file's data as a directory's entries


@contextlib.contextmanager
def atomic_path(path: Path) -> tp.Iterator[Path]:
    """A temporary name beside `path` to write to; on success it is synced and renamed over
    `path` (and the directory synced), so readers see the old file or the new one, never half of
    one. The temporary name is unique per writer, so concurrent writers never share it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write(path: Path, data: str | bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


def replace_whole(path: Path, text: str) -> None:
    """Replace `path` whole (readers see the old text or the new, never half), without the fsyncs
    of atomic_write: for files whose loss in a crash costs nothing (heartbeats, caches), written
    often enough that an fsync each would weigh on a shared filesystem."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path: Path, value: tp.Any) -> None:
    atomic_write(path, json.dumps(value, indent=1, sort_keys=True) + "\n")


def read_json(path: Path, missing: tp.Any) -> tp.Any:
    """The file's JSON, or `missing` when there is no file. Anything else that stops it being
    read is a CorruptStateError naming the file."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return missing
    except (OSError, UnicodeDecodeError) as exc:
        raise CorruptStateError(path, f"unreadable: {exc}") from exc
    try:
        return json.loads(text)
    except ValueError as exc:
        raise CorruptStateError(path, f"not JSON: {exc}") from exc


# Names older hpcrun versions wrote, read as today's: the one map from old to new, for the state files
# (state.json, progress.json, exit records: `current_names`) and the results and steps tables (hpcrun.tables).
RENAMED = {
    "restart_count": "attempt",  # hpcrun's number of the start of the training step (not SLURM's requeues)
}


def current_names(value: dict[str, tp.Any]) -> dict[str, tp.Any]:
    """A state file's JSON object with the keys an older hpcrun wrote under an old name (RENAMED)
    under today's; where both are there, today's wins."""
    if not any(old in value for old in RENAMED):
        return value
    renamed = {k: v for k, v in value.items() if k not in RENAMED}
    for old, new in RENAMED.items():
        if old in value:
            renamed.setdefault(new, value[old])
    return renamed


def lock(path: Path) -> FileLock:
    """The lock guarding read-modify-write of `path` between processes (login node and job)."""
    return FileLock(str(path.with_name(f".{path.name}.lock")))


class RunDir:
    """`<runs_dir>/<run id>/`: runspec.json (the resolved plan), script.sh (what was submitted),
    jobs.json (every submission), submitting.json (one sent, not yet answered), state.json (the
    runtime's last word), logs/, checkpoints/, and a stage's exported final weights."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def spec(self) -> Path:
        return self.path / SPEC

    @property
    def script(self) -> Path:
        return self.path / SCRIPT

    @property
    def jobs_file(self) -> Path:
        return self.path / JOBS

    @property
    def intent_file(self) -> Path:
        """A submission sent but not yet answered (hpcrun.backend): its tag, time and script."""
        return self.path / SUBMITTING

    @property
    def state_file(self) -> Path:
        return self.path / STATE

    @property
    def logs(self) -> Path:
        return self.path / LOGS

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def final_weights(self) -> Path:
        return self.path / FINAL_WEIGHTS

    @property
    def weights_digest(self) -> Path:
        return self.path / WEIGHTS_DIGEST

    @property
    def deepspeed_config(self) -> Path:
        return self.path / DEEPSPEED_CONFIG

    @property
    def progress(self) -> Path:
        """Rank 0's latest progress (step, total, loss, rate, ETA), rewritten as it trains."""
        return self.path / PROGRESS

    @property
    def tensorboard(self) -> Path:
        return self.path / TENSORBOARD

    @property
    def function(self) -> Path:
        """A function job's call: submitit's pickled DelayedSubmission, replaced by the one its
        `checkpoint` returns when the job is stopped for a requeue."""
        return self.path / FUNCTION

    @property
    def controller_log(self) -> Path:
        return self.path / LOGS / CONTROLLER_LOG

    def losses(self, job_id: str, attempt: int) -> Path:
        """One attempt's global losses, one per line (what exact-resume tests compare)."""
        return self.path / f"losses-{job_id}-{attempt}.txt"

    def reported(self, job_id: str, attempt: int) -> Path:
        """The metrics a command job's own script reports for one attempt (JSON lines, written by
        the script: hpcrun.runtime.reported)."""
        return self.path / "reported" / f"{job_id}-{attempt}.jsonl"

    @property
    def lightning(self) -> Path:
        return self.path / LIGHTNING

    def starts(self, allocation_id: str) -> Path:
        """The batch script's line per start of the training step in one allocation (SLURM_JOB_ID):
        `<SLURM_RESTART_COUNT> <restarts in the job> <epoch seconds> <nodes>`, oldest first."""
        return self.path / STARTS / allocation_id

    def exit_record(self, job_id: str, attempt: int, rank: int) -> Path:
        """What a failing rank knew as it failed (error, step, node, its row so far): read once,
        after the job step ended, by the one writer of the failed attempt (hpcrun.runtime.failure)."""
        return self.path / EXITS / f"{job_id}-{attempt}-rank{rank}.json"

    def survivor_saving(self, job_id: str, attempt: int, rank: int) -> Path:
        """There while a rank that outlived a failure saves its state (hpcrun.runtime.snapshotsurvivor):
        the batch script's watcher gives the step longer to end while one is (templates/sbatch.sh.j2)."""
        return self.path / EXITS / f"{job_id}-{attempt}-rank{rank}{SAVING}"

    def named_silent(self, job_id: str, attempt: int, rank: int) -> Path:
        """There once the rank after `rank` in the pulse ring found it silent, recorded that and kept its state:
        the batch script's watcher ends the step then, not after its grace (templates/sbatch.sh.j2)."""
        return self.path / EXITS / f"{job_id}-{attempt}-rank{rank}{SILENT}"

    def heartbeat(self, job_id: str, attempt: int, rank: int) -> Path:
        """A rank's last completed step and when (hpcrun.runtime.watchdog): how the ranks whose
        watchdog fires name the rank that went silent."""
        return self.path / HEARTBEATS / f"{job_id}-{attempt}-rank{rank}.json"

    @property
    def flight_recorder(self) -> Path:
        """Where PyTorch's NCCL flight recorder dumps its per-rank traces on a timeout."""
        return self.path / FLIGHT_RECORDER

    def exit_records(self, job_id: str, attempt: int) -> list[Path]:
        return sorted((self.path / EXITS).glob(f"{job_id}-{attempt}-rank*.json"))

    def log(self, job_id: str, rank: int, stream: str, folder: str | Path | None = None) -> Path:
        """A rank's log of a job (an array's logs sit in its sweep's log folder)."""
        return Path(folder or self.logs) / f"{job_id}_{rank}_log.{stream}"

    def probe_report(self, rank: int) -> Path:
        """What one rank of a `hpcrun doctor` probe job saw."""
        return self.path / f"probe-rank{rank:05d}.json"

    def probe_reports(self) -> list[dict[str, tp.Any]]:
        """Every rank's probe report, in rank order; a corrupt one is refused with its name."""
        reports = []
        for path in sorted(self.path.glob("probe-rank*.json")):
            report = read_json(path, None)
            if not isinstance(report, dict):
                raise CorruptStateError(path, "not a JSON object")
            reports.append(report)
        return reports

    def is_run(self) -> bool:
        return self.spec.exists()

    # submissions -------------------------------------------------------------------------
    def jobs(self) -> list[dict[str, tp.Any]]:
        """Every job submitted for this run, oldest first; [] before the first."""
        jobs = read_json(self.jobs_file, [])
        if not isinstance(jobs, list) or not all(isinstance(j, dict) and "job_id" in j for j in jobs):
            raise CorruptStateError(self.jobs_file, "not a list of jobs")
        return jobs

    def latest_job(self) -> dict[str, tp.Any] | None:
        jobs = self.jobs()
        return jobs[-1] if jobs else None

    def record_job(self, job_id: str, scheduler: str, **extra: str) -> None:
        """Add a submission's job; it answers the pending intent, if any, which goes."""
        with lock(self.jobs_file):
            jobs = self.jobs()
            jobs.append({"job_id": job_id, "scheduler": scheduler, "submitted": time.time(), **extra})
            write_json(self.jobs_file, jobs)
            self.intent_file.unlink(missing_ok=True)

    def intent(self) -> dict[str, tp.Any] | None:
        """The submission sent without a recorded answer, or None."""
        intent = read_json(self.intent_file, None)
        if intent is not None and not (isinstance(intent, dict) and {"tag", "at", "script"} <= intent.keys()):
            raise CorruptStateError(self.intent_file, "not a submission intent (tag, at, script)")
        return intent

    def record_intent(self, tag: str, script: Path, **extra: tp.Any) -> None:
        """Say, before sending it, that a submission tagged `tag` of `script` is under way: if its
        answer is lost, the next submission looks the job up by its tag instead of doubling it."""
        write_json(self.intent_file, {"tag": tag, "at": time.time(), "script": str(script), **extra})

    def clear_intent(self, read: dict[str, tp.Any] | None = None) -> None:
        """The pending submission is known not to have created a job. With `read`: only if the
        intent is still that one (another submission may have written its own since)."""
        with lock(self.jobs_file):
            if read is None or self.intent() == read:
                self.intent_file.unlink(missing_ok=True)

    def submitting(self) -> FileLock:
        """Held from reading the intent to recording the job: one submission of a run at a time."""
        return lock(self.intent_file)

    # the runtime's marker ----------------------------------------------------------------
    def state(self) -> dict[str, tp.Any]:
        """state.json: what the runtime last said of the run ({} before its first attempt ends)."""
        state = read_json(self.state_file, {})
        if not isinstance(state, dict):
            raise CorruptStateError(self.state_file, "not a JSON object")
        state = current_names(state)  # a run an older hpcrun started
        learnt = (("failed_nodes", list), ("excluded_nodes", list), ("slow_ranks", dict))  # what the run learnt
        for key, kind in learnt:
            if not isinstance(state.get(key) or kind(), kind):
                raise CorruptStateError(self.state_file, f"{key} is not a JSON {'list' if kind is list else 'object'}")
        return state

    def update_state(self, merge: tp.Callable[[dict[str, tp.Any]], dict[str, tp.Any] | None]) -> None:
        """Read, decide and write state.json under its lock: `merge(current)` returns the new
        state, or None to keep the current one. Deciding outside the lock would let two writers
        (a rank and the failure step, the login node) each overwrite what the other just said."""
        with lock(self.state_file):
            new = merge(self.state())
            if new is not None:
                write_json(self.state_file, new)

    # after the run ----------------------------------------------------------------------
    def consolidated(self, step: int) -> Path:
        """`hpcrun checkpoint consolidate`'s one fp32 state dict of checkpoint `step`."""
        return self.path / f"{CONSOLIDATED}-step-{step:08d}.pt"


# a run's checkpoints/ ----------------------------------------------------------------------
def step_dir(checkpoints: Path, step: int) -> Path:
    """Checkpoint `step`, once complete (a rename makes it visible)."""
    return checkpoints / f"{STEP}{step:08d}"


def partial_step_dir(checkpoints: Path, step: int) -> Path:
    """Where checkpoint `step` is written until it is complete."""
    return checkpoints / f"{PARTIAL_STEP}{step_dir(checkpoints, step).name}"


def step_dirs(checkpoints: Path) -> dict[int, Path]:
    """Checkpoint directories by step, by name alone (complete only once their manifest says so)."""
    found = {}
    for path in checkpoints.glob(f"{STEP}*"):
        digits = path.name[len(STEP):]
        if digits.isdigit() and path.name == step_dir(checkpoints, int(digits)).name:
            found[int(digits)] = path
    return found


def newest_checkpoint(checkpoints: Path) -> int | None:
    """The step of the newest checkpoint directory (they become visible only when complete, by
    a rename); None when there is none. Read by name: the failure step after srun imports no torch."""
    return max(step_dirs(checkpoints), default=None)


def survivor_partial_step_dir(rank_dir: Path, step: int, what: str) -> Path:
    """Where a survivor writes `what` of snapshot `step` before publishing (hpcrun.runtime.snapshotsurvivor):
    a partial step's name (a restart's sweep removes one left half-written), apart from the periodic
    snapshot of the same step that may be in flight."""
    partial = partial_step_dir(rank_dir, step)
    return partial.with_name(f"{partial.name}.{SURVIVOR_CLAIM}{what}")


def partial_step_dirs(checkpoints: Path) -> list[Path]:
    return sorted(checkpoints.glob(f"{PARTIAL_STEP}*"))


def manifest(step: Path) -> Path:
    return step / MANIFEST


def engine_state(step: Path) -> Path:
    return step / ENGINE_STATE


def trainer_state(step: Path, rank: int) -> Path:
    """One rank's trainer state (step, data position, RNG) in checkpoint directory `step`."""
    return step / f"trainer-rank{rank:05d}.pt"


# a results directory -----------------------------------------------------------------------
def attempt_file(results_dir: Path, run_id: str, job_id: str, attempt: int, attempt_id: str) -> Path:
    """One attempt's results row (hpcrun.results)."""
    return results_dir / f"{run_id}__{job_id}__{attempt}__{attempt_id[:12]}.parquet"


def compacted_file(results_dir: Path, token: str) -> Path:
    """Rows compaction merged from many attempt files."""
    return results_dir / f"compacted-{token}.parquet"


def steps_dir(results_dir: str | Path) -> Path:
    return Path(results_dir) / RESULTS_STEPS


def steps_batch(results_dir: str | Path, run_id: str, job_id: str, attempt: int, seq: int) -> Path:
    """One flush of one attempt's per-step rows (hpcrun.steps): names sort by sequence within an attempt."""
    return steps_dir(results_dir) / run_id / f"{job_id}-{attempt}-{seq:06d}.parquet"


def unreadable_dir(results_dir: Path) -> Path:
    return results_dir / UNREADABLE


def sweep_dir(runs_dir: str | Path, sweep_id: str) -> Path:
    """`<runs_dir>/sweeps/<sweep id>/`: the sweep's ledger and its arrays' logs."""
    return Path(runs_dir) / SWEEPS / sweep_id


def nvme_job_dir(nvme_base: str, allocation_id: str) -> str:
    """A job's own directory on node-local NVMe (ZeRO-Infinity swap files), `<base>/hpcrun-<id>`
    with the scheduler's id of the allocation (SLURM_JOB_ID, unique per array task). The sbatch
    and local templates create and remove it with the same spelling, their own."""
    return f"{nvme_base}/hpcrun-{allocation_id}"


# node-local scratch: in-memory snapshots (hpcrun.runtime.snapshot) --------------------------
SCRATCH_ENV = "HPCRUN_LOCAL_SCRATCH"  # one rank's override of storage.local_scratch (tests' pretend nodes)


def local_scratch(configured: str) -> Path:
    """The node-local directory snapshots go to: the plan's, unless this process is told another."""
    return Path(os.environ.get(SCRATCH_ENV) or configured)


def snapshot_job_name(allocation_id: str, slurm_requeues: int | str) -> str:
    """`hpcrun-<SLURM_JOB_ID>-<SLURM_RESTART_COUNT>`, the name of one job start's snapshot directory
    on a node. The one spelling: the ranks name it with the values, the sbatch script (which removes
    it on every node at the job's end) with the shell's variables in their place (hpcrun.render)."""
    return f"hpcrun-{allocation_id}-{slurm_requeues}"


def snapshot_job_dir(scratch: str | Path, allocation_id: str, slurm_requeues: int) -> Path:
    """`<scratch>/hpcrun-<SLURM_JOB_ID>-<SLURM_RESTART_COUNT>`: one job start's snapshots on one node,
    valid only within that start (SLURM's requeue count, not hpcrun's attempt: a restart inside the
    job finds the same directory)."""
    return Path(scratch) / snapshot_job_name(allocation_id, slurm_requeues)


def snapshot_job_dirs(scratch: str | Path) -> dict[str, list[Path]]:
    """Every job start's snapshot directory in `scratch` owned by this user, by SLURM job id."""
    found: dict[str, list[Path]] = {}
    named = re.compile(snapshot_job_name(r"(\d+)", r"\d+"))
    for path in Path(scratch).glob(snapshot_job_name("*", "*")):
        match = named.fullmatch(path.name)
        with contextlib.suppress(OSError):
            if match and path.is_dir() and path.stat().st_uid == os.getuid():
                found.setdefault(match[1], []).append(path)
    return found


def snapshot_rank_dir(job_dir: Path, run_id: str, node: str, rank: int) -> Path:
    """One rank's snapshots on node `node`, `<job dir>/<run id>/<node>/rank-NNNNN/`, each a
    checkpoint-like `step-N/` directory (`step_dir`, `partial_step_dir`, `manifest`, `engine_state`,
    `trainer_state`). The node's name keeps nodes apart where the scratch is shared after all."""
    return job_dir / run_id / node / f"rank-{rank:05d}"


def snapshot_ranks(job_dir: Path, run_id: str, node: str) -> dict[int, Path]:
    """The rank directories node `node` holds of run `run_id`, by rank (its own and its replicas)."""
    found = {}
    for path in (job_dir / run_id / node).glob("rank-*"):
        digits = path.name.removeprefix("rank-")
        if digits.isdigit():
            found[int(digits)] = path
    return found


def compact_left(results_dir: Path) -> Path:
    """The files the last compaction left as they are (a newer hpcrun's, unreadable ones it may
    not move, others' it may not remove): readers do not count them towards the next one."""
    return results_dir / COMPACT_LEFT


def compact_lock(results_dir: Path) -> FileLock:
    """The lock that keeps two compactions of one results directory from merging the same files."""
    return FileLock(str(results_dir / COMPACT_LOCK))


HEARTBEATS = "heartbeats"

FLIGHT_RECORDER = "flight-recorder"
CONSOLIDATED = "consolidated"
COMPACT_LOCK = ".compact.lock"
COMPACT_LEFT = ".compact-left.json"
