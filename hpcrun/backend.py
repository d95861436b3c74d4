"""Submission: write a run directory and hand its rendered script to the scheduler, SLURM's
`sbatch` or the local controller. The script submitted is the file `render` printed, byte for
byte; the job's tasks start `python -m hpcrun.launch <run dir>`, which reads the RunSpec.

Inside the job each task's ranks come from srun's variables (runtime/env.py). Submission is
hpcrun's own because submitit has no public hook for the text of the sbatch script (only private
executor methods), and hpcrun's promise is that the rendered template is what runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import shutil
import sys
import time
import typing as tp
from pathlib import Path

from hpcrun import jobstate, localjob, mtbf, slurm
from hpcrun.errors import HpcrunError, SubmissionError
from hpcrun.plan import RunSpec
from hpcrun.render import render, render_array
from hpcrun.rundir import CorruptStateError, RunDir, atomic_write
from hpcrun.status import controller_alive, squeue

# An sbatch whose hpcrun died may still be waiting on slurmctld: its job could appear this long
# after the intent was written, so a lost submission is sent again only once the intent is older.
INTENT_GRACE_S = 2 * slurm.TIMEOUT_S
CLOCK_SLACK_S = 60.0  # the login node's clock against slurmctld's, when comparing submit times
# An attempt that wrote its end (state.json) still exits (srun, the controller, SLURM's epilog)
ENDING_WAIT_S = 30.0


def prepare(spec: RunSpec, script: str | None = None) -> Path:
    """Write the run directory: the resolved RunSpec and the script (an array's script for a
    sweep point). Returns its path. A run directory whose job record is corrupt is refused
    before anything in it is overwritten. The spec written carries the node MTBF learned from the
    site's results now (hpcrun.mtbf), which the job's saves are spaced by; the script is unchanged."""
    run_dir = RunDir(spec.run_dir)
    run_dir.jobs()  # raises CorruptStateError: never overwrite what we cannot read
    run_dir.logs.mkdir(parents=True, exist_ok=True)
    atomic_write(run_dir.spec, mtbf.resolve(spec).model_dump_json(indent=1))
    atomic_write(run_dir.script, script if script is not None else render(spec))
    return run_dir.path


def prepare_run(spec: RunSpec) -> Path:
    """`prepare` for a run submitted on its own (`hpcrun submit --run-id`, `hpcrun resume`: a
    sweep point's run gets a script of its own, not its array's), refused first while the run's
    latest job has not ended: that job reads runspec.json again when it is requeued. A pending
    submission is looked up first, so its job counts."""
    run_dir = RunDir(spec.run_dir)
    if run_dir.intent_file.exists():
        with run_dir.submitting():
            settle([run_dir])
    require_ended(run_dir)
    return prepare(spec)


def require_sbatch(spec: RunSpec) -> None:
    slurm.require("sbatch", f"site {spec.site.name!r} needs a SLURM login node")


@dataclasses.dataclass
class Settled:
    """What the scheduler says of run directories' unanswered submissions (their intents)."""

    found: dict[Path, str] = dataclasses.field(default_factory=dict)  # the job SLURM holds, now recorded
    waiting: dict[Path, float] = dataclasses.field(default_factory=dict)  # too recent: seconds left to wait


def settle(run_dirs: list[RunDir]) -> Settled:
    """Look up every pending intent among `run_dirs` with one scheduler query: a job SLURM holds
    under the intent's tag is recorded as the run's job (the answer sbatch lost); an intent with
    no job is dropped once older than INTENT_GRACE_S, and kept (waiting) before."""
    intents = {d.path: intent for d in run_dirs if (intent := d.intent()) is not None}
    settled = Settled()
    if not intents:
        return settled
    since = min(float(i["at"]) for i in intents.values()) - CLOCK_SLACK_S
    tagged = slurm.tagged_jobs({str(i["tag"]): str(i["script"]) for i in intents.values()}, since)
    for path, intent in intents.items():
        run_dir = RunDir(path)
        known = {str(job["job_id"]).split("_")[0] for job in run_dir.jobs()}
        new = [job for job in tagged.get(str(intent["tag"]), []) if job not in known]
        age = time.time() - float(intent["at"])
        if new:
            if len(new) > 1:  # an orphaned sbatch answered after all: both jobs write this run
                comment = slurm.comment(str(intent["tag"]))
                print(f"[hpcrun] warning: jobs {', '.join(new)} all carry --comment={comment} for {path}; "
                      f"recording {new[-1]}: cancel the others", file=sys.stderr)
            settled.found[path] = _record(run_dir, new[-1], intent)
        elif age < INTENT_GRACE_S:
            settled.waiting[path] = INTENT_GRACE_S - age
        else:
            run_dir.clear_intent(intent)
    return settled


def _record(run_dir: RunDir, job: str, intent: dict[str, tp.Any]) -> str:
    """Record `job` (an array's id for an array) as the job of the run's intent; returns its id."""
    job_id = job if intent.get("index") is None else f"{job}_{intent['index']}"
    extra = {"log_folder": str(intent["log_folder"])} if intent.get("log_folder") else {}
    run_dir.record_job(job_id, "slurm", tag=str(intent["tag"]), **extra)
    return job_id


def lost(run_dir: RunDir, tag: str, why: str, wait_s: float) -> slurm.LostAnswer:
    """The error for a submission whose answer is lost and whose job SLURM does not show (yet)."""
    return slurm.LostAnswer(
        f"{why}; SLURM shows no job with --comment={slurm.comment(tag)} yet. The submission stays recorded as "
        f"pending: submitting this run again looks it up first, and sends it anew only if SLURM still has no "
        f"such job in {wait_s:.0f} s",
        run_dir.path,
    )


def require_ended(run_dir: RunDir) -> None:
    """Refuse to submit a run whose latest job has not ended (the scheduler says, or for a local
    job its controller's liveness): two jobs would write one run's checkpoints. A job whose
    attempt has already said it ended (state.json) is given ENDING_WAIT_S to finish exiting."""
    job = run_dir.latest_job()
    if job is None:
        return
    job_id = str(job["job_id"])
    state = _live(run_dir, job_id, str(job["scheduler"]))
    mark = run_dir.state()
    if state is not None and mark.get("job_id") == job_id and mark.get("status") in ("stopped", "completed", "failed"):
        deadline = time.monotonic() + ENDING_WAIT_S
        while state is not None and time.monotonic() < deadline:
            time.sleep(1.0)
            state = _live(run_dir, job_id, str(job["scheduler"]))
    if state is not None:
        why = f"job {job_id} of this run is still {state}: wait for it to end, or cancel it (hpcrun cancel)"
        raise HpcrunError(why, run_dir.path)


def _live(run_dir: RunDir, job_id: str, scheduler: str) -> str | None:
    """The state of a job that has not ended, or None once it has."""
    if scheduler == "local":
        return "RUNNING" if controller_alive(job_id, run_dir.path) else None
    # slurmctld holds every job until it has ended (accounting may not list a pending array task)
    row = squeue([job_id], max_age=0).get(job_id)
    return row.state if row is not None and not jobstate.of(row.state).done else None


def submit(spec: RunSpec, dependency: str | None = None) -> str:
    """Submit a prepared run; returns the job id. The run's own earlier submission whose answer
    was lost is looked up first (its job recorded), and a run whose latest job has not ended is
    refused. A refused submission leaves no run directory that looks live: a fresh one is
    removed, and the scheduler's own message is raised."""
    run_dir = RunDir(spec.run_dir)
    if spec.site.scheduler != "local":
        try:
            require_sbatch(spec)
        except SubmissionError:  # nothing can be sent from here: a fresh run directory goes
            if not run_dir.jobs() and run_dir.intent() is None:
                shutil.rmtree(run_dir.path, ignore_errors=True)
            raise
    with run_dir.submitting():
        if spec.site.scheduler != "local":
            intent = run_dir.intent()
            waiting = settle([run_dir]).waiting.get(run_dir.path)
            if intent is not None and waiting is not None:
                why = "an earlier submission of this run has no recorded answer"
                raise lost(run_dir, str(intent["tag"]), why, waiting)
        require_ended(run_dir)
        earlier = run_dir.jobs()
        try:
            if spec.site.scheduler == "local":
                # locally each submission of the run counts as one requeue (SLURM counts its own)
                job_id = localjob.start(
                    run_dir, spec.tasks_per_node, spec.time_min, spec.signal_lead_s, slurm_requeues=len(earlier)
                )
            else:
                run_dir.record_intent(spec.run_id, run_dir.script)
                job_id = _sbatch_or_find([run_dir], dependency)[0]
        except slurm.LostAnswer:
            raise
        except SubmissionError:
            _not_sent(run_dir, bool(earlier))
            raise
        if spec.site.scheduler == "local":
            run_dir.record_job(job_id, "local")
        return job_id


def _not_sent(run_dir: RunDir, submitted_before: bool) -> None:
    """A submission SLURM refused: its intent goes, and so does a run directory made for it alone
    (one submitted before keeps its history and checkpoints)."""
    run_dir.clear_intent()
    if not submitted_before:
        shutil.rmtree(run_dir.path, ignore_errors=True)


def _sbatch_or_find(run_dirs: list[RunDir], dependency: str | None = None) -> list[str]:
    """Submit the script the first run's intent names and record the job in every run (task `i`
    of an array for the i-th). An answer sbatch lost is looked up by the intent's tag at once:
    found, it is recorded as if sbatch had answered; not found, the intents stay and LostAnswer
    says so (exit 2, like any SLURM tool that did not answer)."""
    intent = run_dirs[0].intent()
    assert intent is not None
    try:
        job = slurm.sbatch(Path(intent["script"]), dependency)
    except slurm.LostAnswer as exc:
        try:
            settled = settle(run_dirs)
        except HpcrunError as lookup:  # the answer is lost, and so is the way to look for it: say both
            why = f"{exc.message}; its job could not be looked up either ({lookup.message})"
            raise slurm.LostAnswer(f"{why}: submitting this run again looks it up first", run_dirs[0].path) from exc
        if all(d.path in settled.found for d in run_dirs):
            return [settled.found[d.path] for d in run_dirs]
        raise lost(run_dirs[0], str(intent["tag"]), exc.message, INTENT_GRACE_S) from exc
    return [_record(run_dir, job, run_dir.intent() or intent) for run_dir in run_dirs]


def array_tag(specs: list[RunSpec]) -> str:
    """The tag of the array `specs` would be submitted as: the sweep and a digest of its points
    and how often each was submitted, so the same submission sent again (its answer lost) has
    the same tag and a later one (a retry) another."""
    history = [(spec.run_id, len(RunDir(spec.run_dir).jobs())) for spec in specs]
    return f"{specs[0].sweep_id}.{hashlib.sha256(json.dumps(history).encode()).hexdigest()[:10]}"


def submit_array(specs: list[RunSpec], log_folder: Path, max_concurrent: int | None, tag: str,
                 dependency: str | None = None) -> list[str]:
    """Points that render to the same script as one job array tagged `tag` (task `i` runs
    `specs[i]`); returns their job ids (`<array>_<index>`). A refused array leaves none of its
    fresh run directories behind; one whose answer is lost leaves them with their intents."""
    require_sbatch(specs[0])
    array = f"0-{len(specs) - 1}" + (f"%{max_concurrent}" if max_concurrent else "")
    script = render_array(specs, array, log_folder, tag)
    with contextlib.ExitStack() as held:
        run_dirs = [RunDir(spec.run_dir) for spec in specs]
        for run_dir in run_dirs:  # a `hpcrun resume` of a point waits, then sees its job
            held.enter_context(run_dir.submitting())
        earlier = [bool(run_dir.jobs()) for run_dir in run_dirs]
        for spec in specs:
            prepare(spec, script)
        log_folder.mkdir(parents=True, exist_ok=True)
        for index, run_dir in enumerate(run_dirs):
            run_dir.record_intent(tag, run_dirs[0].script, index=index, log_folder=str(log_folder))
        try:
            return _sbatch_or_find(run_dirs, dependency)
        except slurm.LostAnswer:
            raise
        except SubmissionError:
            for run_dir, retried in zip(run_dirs, earlier):
                _not_sent(run_dir, retried)
            raise


def load_spec(run_dir: Path) -> RunSpec:
    """The RunSpec a run was submitted with; a missing or unreadable one is one line."""
    path = RunDir(run_dir).spec
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        raise HpcrunError(f"not a run directory (no {path.name})", run_dir) from exc
    except OSError as exc:
        raise CorruptStateError(path, f"unreadable: {exc}") from exc
    try:
        return RunSpec.model_validate_json(text)
    except ValueError as exc:
        raise CorruptStateError(path, str(exc).splitlines()[0]) from exc
