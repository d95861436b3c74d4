"""Per-step metrics: the steps dataset (filters, stitching across requeues, bad files skipped),
progress.json, and TensorBoard events with the same values as the table."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import typing as tp
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpcrun import steps
from hpcrun.results import load
from tests.delayed_training import entrypoint_job
from tests.helpers import ROOT, cli, write_yaml
from tests.runs import hpcrun, losses, recipe, run_dir_of, site_copy, state, status, wait_for

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def rows(run_id: str, job_id: str, first: int, last: int, start_s: float, **ids: tp.Any) -> list[dict[str, tp.Any]]:
    """An attempt's rows for steps first..last, the loss telling the attempt apart."""
    base = {
        "run_id": run_id,
        "sweep_id": None,
        "point_id": None,
        "stage": None,
        "strategy": "ddp",
        "job_id": job_id,
        "attempt": 0,
        **ids,
    }
    return [
        {
            **base,
            "step": s,
            "time": T0 + dt.timedelta(seconds=start_s + s),
            "loss": float(int(job_id) * 1000 + s),
            "extra": {"x": float(s)},
        }
        for s in range(first, last + 1)
    ]


def write(results: Path, batch: list[dict[str, tp.Any]], seq: int = 0) -> None:
    steps.write_batch(results, batch, seq)


def test_load_steps_filters(tmp_path: Path) -> None:
    write(tmp_path, rows("a", "1", 1, 3, 0, sweep_id="s1", strategy="ddp"))
    write(tmp_path, rows("b", "2", 1, 3, 0, sweep_id="s1", strategy="fsdp"))
    write(tmp_path, rows("c", "3", 1, 2, 0, sweep_id="s2", strategy="fsdp"))
    everything = steps.load_steps(tmp_path)
    assert list(zip(everything["run_id"], everything["step"])) == [
        ("a", 1),
        ("a", 2),
        ("a", 3),
        ("b", 1),
        ("b", 2),
        ("b", 3),
        ("c", 1),
        ("c", 2),
    ]
    assert set(steps.load_steps(tmp_path, run_id="b")["run_id"]) == {"b"}
    assert set(steps.load_steps(tmp_path, run_id=["a", "c"])["run_id"]) == {"a", "c"}
    assert set(steps.load_steps(tmp_path, sweep_id="s1")["run_id"]) == {"a", "b"}
    assert set(steps.load_steps(tmp_path, strategy="fsdp", sweep_id="s1")["run_id"]) == {"b"}
    assert steps.load_steps(tmp_path, strategy="fsdp", step=[2, 3])["step"].tolist() == [2, 3, 2]
    assert dict(steps.load_steps(tmp_path, run_id="c")["extra"].iloc[1]) == {"x": 2.0}
    assert steps.load_steps(tmp_path, run_id="nope").empty
    with pytest.raises(KeyError, match="no column 'nodes'"):
        steps.load_steps(tmp_path, nodes=2)
    # the summary table does not read the steps dataset as (foreign) results files
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load(tmp_path).empty


def test_steps_stitched_across_attempts(tmp_path: Path) -> None:
    """Attempt 1 ran to step 8 (checkpoint 5), attempt 2 resumed at 6 and ran to 9 before it was
    killed (checkpoint still 5), attempt 3 resumed at 6 again and finished at 12."""
    write(tmp_path, rows("r", "1", 1, 4, 0), 0)
    write(tmp_path, rows("r", "1", 5, 8, 0), 1)
    write(tmp_path, rows("r", "2", 6, 9, 100))
    write(tmp_path, rows("r", "3", 6, 12, 200))
    write(tmp_path, rows("other", "4", 1, 3, 50))
    df = steps.load_steps(tmp_path, run_id="r")
    assert df["step"].tolist() == list(range(1, 13))
    assert df["loss"].tolist() == [1000.0 + s for s in range(1, 6)] + [3000.0 + s for s in range(6, 13)]
    assert len(steps.load_steps(tmp_path)) == 15


def test_files_of_older_and_newer_versions_load(tmp_path: Path) -> None:
    """A steps file written before a column existed, and one with a column this version does not
    know, load with what they have (once the older file was skipped as unreadable)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    write(tmp_path, rows("old", "1", 1, 2, 0))
    write(tmp_path, rows("new", "2", 1, 2, 0))
    old, new = (next(p for p in steps.files(tmp_path) if p.parent.name == run) for run in ("old", "new"))
    pq.write_table(pq.read_table(old).drop_columns(["memory_bytes", "extra", "slowest_rank"]), old)
    pq.write_table(pq.read_table(new).append_column("energy_j", pa.array([1.0, 2.0])), new)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        df = steps.load_steps(tmp_path)
    assert list(zip(df["run_id"], df["step"])) == [("new", 1), ("new", 2), ("old", 1), ("old", 2)]
    assert df["memory_bytes"].isna().tolist() == [True] * 4 and df["loss"].tolist() == [2001.0, 2002.0, 1001.0, 1002.0]


def test_truncated_and_foreign_files_are_reported_and_skipped(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    write(tmp_path, rows("good", "1", 1, 3, 0))
    good = steps.files(tmp_path)[0]
    truncated = good.with_name("1-0-000001.parquet")
    truncated.write_bytes(good.read_bytes()[:-40])
    foreign = good.with_name("foreign.parquet")
    pq.write_table(pa.table({"a": [1, 2], "b": ["x", "y"]}), foreign)
    nulls = good.with_name("nulls.parquet")  # steps' columns, but no run or step: not ours either
    pq.write_table(steps.table([{"loss": 1.0}]), nulls)
    with pytest.warns(UserWarning) as caught:
        df = steps.load_steps(tmp_path)
    assert df["step"].tolist() == [1, 2, 3]
    messages = [str(w.message) for w in caught]
    for path in (truncated, foreign, nulls):
        assert any(m.startswith(f"{path}: skipped") for m in messages), messages


def test_metrics_block_is_validated(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "r.yaml", {"name": "m", "metrics": {"flush_step": 5}})
    result = cli("validate", str(path))
    assert result.exit_code == 2, result.output
    assert "metrics.flush_step" in result.output and "Traceback" not in result.output
    bad = write_yaml(tmp_path / "b.yaml", {"name": "m", "metrics": {"flush_seconds": 0}})
    assert "metrics.flush_seconds" in cli("validate", str(bad)).output
    good = write_yaml(
        tmp_path / "g.yaml", {"name": "m", "metrics": {"flush_steps": 5, "per_rank_interval": 0, "tensorboard": True}}
    )
    assert cli("validate", str(good)).exit_code == 0


# --- real runs --------------------------------------------------------------------------------


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.lin(x), y)


def train_logging(ctx: tp.Any) -> None:
    """A small entrypoint that logs a value of its own each step."""
    torch.manual_seed(0)
    engine = ctx.setup(Tiny(), lambda params: torch.optim.SGD(params, lr=0.05))
    for step in ctx.steps():
        g = torch.Generator().manual_seed(step * 10 + ctx.rank)
        x = torch.randn(8, 4, generator=g)
        loss = engine.micro_step(x, x.sum(1, keepdim=True), last=True)
        engine.optimizer_step()
        ctx.record_loss(loss)
        ctx.log(half_step=(step + 1) / 2)


def scalars(directory: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    events = acc.Scalars(tag)
    assert len({e.step for e in events}) == len(events), f"{tag}: a step twice"
    return {e.step: e.value for e in events}


@pytest.mark.slow
def test_tensorboard_events_match_the_steps_table(tmp_path: Path) -> None:
    site = site_copy(tmp_path)
    job = {"kind": "entrypoint", "entrypoint": "tests.test_steps:train_logging", "pythonpath": [str(ROOT)]}
    rec = recipe(
        tmp_path,
        "tb",
        job=job,
        training={"steps": 12},
        checkpoint={"interval": 5},
        metrics={"flush_steps": 5, "tensorboard": True},
    )
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), "--wait", str(rec)))
    assert state(run_dir)["status"] == "completed"
    df = steps.load_steps(tmp_path / "results", run_id=run_dir.name)
    assert df["step"].tolist() == list(range(1, 13))
    assert df["loss"].tolist() == losses(run_dir)  # the global (mean over ranks) loss of each step
    assert df["lr"].tolist() == [0.05] * 12 and df["grad_norm"].notna().all()
    assert (df["step_time_min_s"] <= df["step_time_median_s"]).all() and (
        df["step_time_median_s"] <= df["step_time_max_s"]
    ).all()
    assert set(df["slowest_rank"]) <= {0, 1}
    assert [dict(e)["half_step"] for e in df["extra"]] == [s / 2 for s in range(1, 13)]
    board = run_dir / "tensorboard"
    for tag, column in (
        ("loss", df["loss"]),
        ("grad_norm", df["grad_norm"]),
        ("step_time_max_s", df["step_time_max_s"]),
    ):
        assert scalars(board, tag) == pytest.approx(dict(zip(df["step"], column)), rel=1e-6)
    assert scalars(board, "extra/half_step") == {s: s / 2 for s in range(1, 13)}
    progress = json.loads((run_dir / "progress.json").read_text())
    assert (progress["step"], progress["total"], progress["checkpoint_step"], progress["eta_s"]) == (12, 12, 12, 0.0)
    assert progress["loss"] == df["loss"].iloc[-1] and progress["job_id"] == df["job_id"].iloc[0]
    assert len(load(tmp_path / "results", run_id=run_dir.name)) == 1


def controller(run_dir: Path) -> int:
    return int(json.loads((run_dir / "jobs.json").read_text())[-1]["job_id"])


def newest_checkpoint(run_dir: Path) -> int:
    from hpcrun.runtime.checkpoint import latest

    found = latest(run_dir / "checkpoints")
    return found[0] if found else 0


def recorded(results: Path, run_id: str, job_id: str) -> int:
    """The newest step an attempt has in its written files so far."""
    return max(
        (
            s
            for p in steps.files(results)
            for s, j in zip(*steps.read([p]).select(["step", "job_id"]).to_pydict().values())
            if j == job_id and p.parent.name == run_id
        ),
        default=0,
    )


@pytest.mark.slow
def test_requeued_run_has_every_step_once(tmp_path: Path) -> None:
    """Stopped with SIGTERM and resumed (a requeue, locally), then killed outright past its newest
    checkpoint and resumed again: one curve, every step exactly once, in the table and in
    TensorBoard, and the losses those of the run's own lineage."""
    site = site_copy(tmp_path)
    results = tmp_path / "results"
    total = 40
    rec = recipe(
        tmp_path,
        "requeued",
        job=entrypoint_job(str(ROOT), 0.15),
        resources={"nodes": 1, "gpus_per_node": 1},  # one rank: the table's and TensorBoard's rows are rank 0's
        training={"steps": total, "micro_batch": 2, "seq_len": 32},
        checkpoint={"interval": 5},
        metrics={"flush_steps": 1, "tensorboard": True},
    )
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), str(rec)))
    wait_for(lambda: newest_checkpoint(run_dir) >= 5, "the first checkpoint")
    os.kill(controller(run_dir), signal.SIGTERM)  # forwarded to every rank, as SLURM's preemption
    wait_for(lambda: status(run_dir) is not None, "the stop")
    stopped = state(run_dir)
    assert stopped["status"] == "stopped" and 0 < stopped["step"] < total, stopped

    hpcrun("resume", "--site", str(site), run_dir.name)
    second = str(controller(run_dir))
    # kill once this attempt has written steps past its newest checkpoint (they are redone)
    wait_for(
        lambda: (
            newest_checkpoint(run_dir) > stopped["step"]
            and recorded(results, run_dir.name, second) >= newest_checkpoint(run_dir) + 2
        ),
        "steps past a checkpoint",
    )
    pids = [controller(run_dir), *map(int, os.popen(f"pgrep -P {controller(run_dir)}").read().split())]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    wait_for(
        lambda: all(
            not Path(f"/proc/{p}").exists() or "Z" in Path(f"/proc/{p}/stat").read_text().split(")")[-1].split()[:1]
            for p in pids
        ),
        "the kill",
    )

    hpcrun("resume", "--site", str(site), "--wait", run_dir.name)
    assert state(run_dir)["status"] == "completed"
    raw = steps.read(steps.files(results)).to_pandas()
    assert raw["job_id"].nunique() == 3 and len(raw) > total  # some steps were written twice
    df = steps.load_steps(results, run_id=run_dir.name)
    assert df["step"].tolist() == list(range(1, total + 1))
    assert df["loss"].tolist() == losses(run_dir)  # the last attempt's record of the whole lineage
    assert scalars(run_dir / "tensorboard", "loss") == pytest.approx(dict(zip(df["step"], df["loss"])), rel=1e-6)


def test_the_writer_ends_its_wait_for_a_stuck_write(capsys: pytest.CaptureFixture[str]) -> None:
    """A write that hangs (a stuck shared filesystem) holds the attempt's end for the wait given,
    then is a warning line: the process goes on to exit."""
    import threading
    import time

    from hpcrun.runtime.steps import Writer

    stuck = threading.Event()
    writer = Writer()
    writer.submit(lambda: stuck.wait(10))
    began = time.monotonic()
    writer.close(wait_s=0.5)
    assert time.monotonic() - began < 5
    assert "per-step metrics writer still busy after 0 s" in capsys.readouterr().err
    stuck.set()
