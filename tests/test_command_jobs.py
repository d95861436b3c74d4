"""Command jobs (a user's unchanged script) keep hpcrun's fault-tolerance promise: a stop signal
is forwarded, a script that exits after it is a stopped attempt (requeued on SLURM within the
cap, whatever its exit code), a script that ignores it is killed and stopped all the same, and
the next attempt resumes from what the script saved under HPCRUN_CHECKPOINT_DIR."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from hpcrun.steps import load_steps
from tests.helpers import ROOT
from tests.runs import hpcrun, recipe, rows, run_dir_of, site_copy, state, status, wait_for
from tests.test_fault_tolerance import ranks

pytestmark = pytest.mark.slow

STEPS = 20
STEP_DELAY_S = 0.5  # the job lasts >= 10 s on any CPU: time to signal it mid-way


def example(tmp_path: Path, name: str, **fields: object) -> Path:
    """jobs/command_train.py (the documented contract), sized by time."""
    job = {
        "kind": "command",
        "command": [
            "python",
            str(ROOT / "jobs" / "command_train.py"),
            "--steps",
            str(STEPS),
            "--step-delay-s",
            str(STEP_DELAY_S),
        ],
    }
    return recipe(tmp_path, name, job=job, **fields)


def starts(run_dir: Path) -> list[int]:
    path = run_dir / "command-starts"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def test_stopped_command_resumes_where_it_saved(tmp_path: Path) -> None:
    """USR2 to the rank of a local command job (as SLURM signals every task): the script saves
    and exits 0, the attempt is `stopped` (not `completed`), and `resume` continues from the
    saved step to the end. One rank: the signal's forwarding and the stop are the rank's own (two
    ranks are stopped together by test_command_ignoring_the_signals_is_killed_with_its_children and
    the cluster's launcher tests), and each attempt's imports were most of this test's time under CI's load."""
    began = time.monotonic()
    site = site_copy(tmp_path)
    one = {"nodes": 1, "gpus_per_node": 1, "time": "00:10:00"}
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), str(example(tmp_path, "cmd-stop", resources=one))))
    # at once: the script's 10 s are the signal's whole window (3 s after the start, CI's load once made the
    # signal reach it in its last step)
    wait_for(lambda: starts(run_dir) == [0] and len(ranks(run_dir)) == 1, what="the script's start")
    for pid in ranks(run_dir):
        os.kill(pid, signal.SIGUSR2)
    wait_for(lambda: status(run_dir) is not None, what="the stop")
    stopped = state(run_dir)
    assert stopped["status"] == "stopped", stopped
    assert "SIGUSR2" in stopped["reason"]
    assert (run_dir / "checkpoints" / "command_train.pt").exists()
    assert not (run_dir / "command-ok").exists()
    hpcrun("resume", "--site", str(site), "--wait", run_dir.name)
    assert state(run_dir)["status"] == "completed", state(run_dir)
    first, resumed = starts(run_dir)
    assert first == 0 and 0 < resumed < STEPS, starts(run_dir)  # continued, not restarted
    assert (run_dir / "command-ok").read_text().strip() == "1"
    print(f"duration {time.monotonic() - began:.0f} s")


def test_command_ignoring_the_signals_is_killed_with_its_children(tmp_path: Path) -> None:
    """A script that ignores USR2 and SIGTERM, with a child of its own (as torchrun has its
    workers), is killed with that child after the grace (half the signal lead), and the attempt
    is stopped, not left running into the time limit."""
    began = time.monotonic()
    site = site_copy(tmp_path)
    script = (
        "import signal,subprocess,time; [signal.signal(s, signal.SIG_IGN) for s in (signal.SIGUSR2, signal.SIGTERM)]; "
        "child = subprocess.Popen(['sleep', '600']); open('child-' + str(child.pid), 'w').close(); time.sleep(300)"
    )
    rec = recipe(
        tmp_path,
        "cmd-deaf",
        job={"kind": "command", "command": ["python", "-c", script], "workdir": "."},
        checkpoint={"signal_lead_s": 10},
    )  # a 5 s grace
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), str(rec)))
    wait_for(lambda: len(list(tmp_path.glob("child-*"))) == 2 and len(ranks(run_dir)) == 2, what="the script's start")
    children = [int(p.name.split("-")[1]) for p in tmp_path.glob("child-*")]
    signalled = time.monotonic()
    for pid in ranks(run_dir):
        os.kill(pid, signal.SIGUSR2)
    # well before the script's own end (300 s): the kill ended it; the grace and the row written
    # after it took 10-20 s at CI's load
    wait_for(lambda: status(run_dir) is not None, timeout=150, what="the stop")
    assert time.monotonic() - signalled < 120
    final = state(run_dir)
    assert final["status"] == "stopped" and "SIGUSR2" in final["reason"], final
    assert "killed with its children" in "".join(p.read_text() for p in (run_dir / "logs").glob("*_log.out"))
    wait_for(
        lambda: not any(Path(f"/proc/{pid}").exists() for pid in children),
        timeout=10,
        what="the script's children to be gone",
    )
    print(f"duration {time.monotonic() - began:.0f} s")


def test_torchrun_gives_its_workers_the_usr2_grace(tmp_path: Path) -> None:
    """After USR2 a torchrun worker may take longer than torchrun's own 30 s default to save:
    hpcrun's grace (the lead less 30 s: 50 s here) reaches it through torchrun."""
    site = site_copy(tmp_path)
    script = (
        "import signal,time; signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM]); open('started', 'w').close(); "
        "signal.sigwait([signal.SIGTERM]); time.sleep(35); open('saved', 'w').close()"
    )  # a 35 s save
    job = {"kind": "command", "launcher": "torchrun", "command": ["python", "-c", script], "workdir": "."}
    rec = recipe(
        tmp_path,
        "torchrun-slow-save",
        job=job,
        resources={"nodes": 1, "gpus_per_node": 1, "time": "00:10:00"},
        checkpoint={"signal_lead_s": 80},
    )
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), str(rec)))
    wait_for(lambda: (tmp_path / "started").exists() and len(ranks(run_dir)) == 1, what="the worker's start")
    for pid in ranks(run_dir):
        os.kill(pid, signal.SIGUSR2)
    wait_for(lambda: status(run_dir) is not None, what="the stop")
    final = state(run_dir)
    assert final["status"] == "stopped" and "SIGUSR2" in final["reason"], final
    assert (tmp_path / "saved").exists(), "torchrun killed its worker mid-save"


def test_torchrun_launcher_runs_the_ranks_and_reports_steps(tmp_path: Path) -> None:
    """jobs/torchrun.yaml on this machine: one task runs torchrun, which starts 2 ranks (the
    script's all-reduce sees 2); the script's reported steps fill the per-step table and the
    results row."""
    site = site_copy(tmp_path)
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), "--wait", str(ROOT / "jobs" / "torchrun.yaml")))
    assert state(run_dir)["status"] == "completed", state(run_dir)
    assert (run_dir / "command-ok").read_text().strip() == "2"
    assert len(ranks_started(run_dir)) == 1  # one task: torchrun made the ranks
    row = rows(tmp_path, run_dir).iloc[-1]
    assert (row["world_size"], row["first_step"], row["last_step"]) == (2, 0, 40) and row["step_time_p50_s"] > 0
    assert row["final_loss"] == pytest.approx(
        json.loads((run_dir / "reported" / f"{row['job_id']}-0.jsonl").read_text().splitlines()[-1])["loss"]
    )
    curve = load_steps(tmp_path / "results", run_id=run_dir.name)
    assert list(curve["step"]) == list(range(1, 41)) and curve["loss"].notna().all()


def ranks_started(run_dir: Path) -> list[Path]:
    """The task logs of a local run: one per task the controller started."""
    return sorted((run_dir / "logs").glob("*_log.out"))


def lightning_recipe(tmp_path: Path, steps: int, delay: float, accumulate: int = 1) -> Path:
    script = str(ROOT / "jobs" / "lightning_train.py")
    job = {
        "kind": "command",
        "command": [
            "python",
            script,
            "--steps",
            str(steps),
            "--devices",
            "2",
            "--step-delay-s",
            str(delay),
            "--accumulate",
            str(accumulate),
        ],
    }
    return recipe(tmp_path, "lightning", job=job)


def test_lightning_script_saves_its_hpc_checkpoint_on_usr2(tmp_path: Path) -> None:
    """USR2 to the ranks (as SLURM signals every task): the script saves Lightning's HPC
    checkpoint at the step all ranks agree on and leaves fit before its end; the attempt is
    stopped at that step. With gradient accumulation (4 batches a step) the save comes after
    an optimizer step, never between micro-batches (their gradients would be lost)."""
    site = site_copy(tmp_path)
    run_dir = run_dir_of(
        hpcrun("submit", "--site", str(site), str(lightning_recipe(tmp_path, 200, 0.05, accumulate=4)))
    )
    job = json.loads((run_dir / "jobs.json").read_text())[-1]["job_id"]
    metrics = run_dir / "reported" / f"{job}-0.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, what="three reported steps")
    for pid in ranks(run_dir):
        os.kill(pid, signal.SIGUSR2)
    wait_for(lambda: status(run_dir) is not None, what="the stop")
    final = state(run_dir)
    assert final["status"] == "stopped" and "SIGUSR2" in final["reason"], final
    saved = list((run_dir / "lightning").glob("hpc_ckpt_*.ckpt"))
    assert [p.name for p in saved] == ["hpc_ckpt_1.ckpt"] and not list((run_dir / "lightning").glob("hpcrun-stop*"))
    import torch

    checkpoint = torch.load(saved[0], weights_only=False, map_location="cpu")
    step = checkpoint["global_step"]
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert 3 <= step == last < 200, (step, last)  # saved at the last reported step, mid-run
    batches = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["processed"]
    assert batches == 4 * step, (batches, step)  # at an optimizer step's end, not between micro-batches
    logs = "".join(p.read_text() for p in ranks_started(run_dir))
    assert "steps over" not in logs  # fit was left: the script's code after it did not run


def test_prune_keeps_the_newest_two_hpc_checkpoints(tmp_path: Path) -> None:
    """One full checkpoint per requeue would fill the disk; the one before the newest stays as
    the fallback. Versions are numbers (10 is newer than 9), sharded saves are directories, other
    files are the script's."""
    from hpcrun.lightning import prune

    for n in (1, 2, 9, 10):
        (tmp_path / f"hpc_ckpt_{n}.ckpt").write_text("x")
    (tmp_path / "hpc_ckpt_3.ckpt").mkdir()
    (tmp_path / "hpc_ckpt_3.ckpt" / "shard-0").write_text("x")
    (tmp_path / "last.ckpt").write_text("the script's own")
    prune(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hpc_ckpt_10.ckpt", "hpc_ckpt_9.ckpt", "last.ckpt"]
