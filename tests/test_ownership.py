"""What hpcrun touches is its own: `cancel` signals only this run's local controller (never a
process that reused its pid), `checkpoint consolidate` writes its file whole and leaves no
temporary file, and a probe report that is not a JSON object is refused, not skipped."""

from __future__ import annotations

import json
import subprocess
import sys
import typing as tp
from pathlib import Path

import pytest

from hpcrun.cancel import cancel
from hpcrun.rundir import CorruptStateError, RunDir

SLEEP = "import time; time.sleep(120)"


@pytest.fixture
def procs() -> tp.Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


def local_run(path: Path, pid: int) -> RunDir:
    run = RunDir(path)
    path.mkdir(parents=True)
    run.record_job(str(pid), "local")
    return run


def still_running(proc: subprocess.Popen[bytes]) -> bool:
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        return True
    return False


def test_cancel_leaves_a_process_that_reused_the_pid_alone(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """The recorded pid now belongs to an unrelated process, or to another run's controller."""
    stranger = subprocess.Popen(["sleep", "120"])
    other = subprocess.Popen([sys.executable, "-c", SLEEP, "-m", "hpcrun.localjob", str(tmp_path / "other")])
    procs.extend([stranger, other])
    for name, proc in (("old", stranger), ("mine", other)):
        run = local_run(tmp_path / name, proc.pid)
        assert cancel(run.path) == str(proc.pid)
        assert still_running(proc), f"cancel of {name} signalled pid {proc.pid}, not its controller"


def test_cancel_signals_the_runs_own_controller(tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    """A stand-in controller (`-m hpcrun.localjob <run dir>` on its command line), started
    with the run directory relative to its own working directory."""
    run_path = tmp_path / "runs" / "live"
    controller = subprocess.Popen([sys.executable, "-c", SLEEP, "-m", "hpcrun.localjob", "runs/live"], cwd=tmp_path)
    procs.append(controller)
    local_run(run_path, controller.pid)
    cancel(run_path)
    assert controller.wait(timeout=10) == -15  # SIGTERM


def test_probe_report_that_is_not_an_object_is_refused(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.probe_report(0).write_text(json.dumps({"rank": 0}))
    run.probe_report(1).write_text("[1, 2]")
    with pytest.raises(CorruptStateError) as raised:
        run.probe_reports()
    assert str(run.probe_report(1)) in str(raised.value) and "not a JSON object" in str(raised.value)


def dcp_checkpoint(run: RunDir, step: int, state: dict[str, tp.Any]) -> None:
    """A complete single-process DCP checkpoint as Checkpoints writes it (state/ + manifest)."""
    import torch.distributed.checkpoint as dcp

    from hpcrun.rundir import MANIFEST, step_dir

    path = step_dir(run.checkpoints, step)
    dcp.save(state, checkpoint_id=str(path / "state"))
    (path / MANIFEST).write_text(json.dumps({"complete": True, "step": step, "strategy": "ddp", "world_size": 1}))


def leftovers(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.startswith(".") or p.name.endswith(".tmp"))


def test_consolidate_writes_the_model_and_nothing_else(tmp_path: Path) -> None:
    import torch

    from hpcrun.runtime.checkpoint import consolidate, state_digest

    run = RunDir(tmp_path)
    model = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3)}
    dcp_checkpoint(run, 4, {"model": model, "optimizer": {"m": torch.zeros(3)}})
    out, digest = consolidate(tmp_path)
    assert out == tmp_path / "consolidated-step-00000004.pt"
    saved = torch.load(out, weights_only=True)
    assert sorted(saved) == ["b", "w"] and torch.equal(saved["w"], model["w"])
    assert digest == state_digest(model)
    assert leftovers(tmp_path) == []


def test_consolidate_that_fails_leaves_no_temporary_file(tmp_path: Path) -> None:
    """A checkpoint without a model: the converter's output is written, then refused."""
    import torch

    from hpcrun.runtime.checkpoint import consolidate

    run = RunDir(tmp_path)
    dcp_checkpoint(run, 2, {"not_model": {"w": torch.ones(2)}})
    with pytest.raises(KeyError):
        consolidate(tmp_path)
    assert leftovers(tmp_path) == []
    assert not run.consolidated(2).exists()
