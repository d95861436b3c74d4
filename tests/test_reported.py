"""Metrics a command job's script reports (HPCRUN_METRICS): parsed line by line, a line still
being written left for the next read, a bad line skipped with one warning, written as per-step
batches and progress.json like a built-in job's."""

from __future__ import annotations

import json
from pathlib import Path

from hpcrun import steps as dataset
from hpcrun.runtime.reported import Reported, parse

IDS = {
    "run_id": "r1",
    "sweep_id": None,
    "point_id": None,
    "stage": None,
    "strategy": "ddp",
    "job_id": "7",
    "attempt": 1,
}


def test_parse_known_columns_extra_and_time() -> None:
    line = parse(
        '{"step": 12, "loss": 2.5, "lr": 0.1, "time": 100.0, "total": 50, "accuracy": 0.75, "note": "x", "bad": NaN}',
        read_at=5.0,
    )
    assert line is not None
    assert (line.step, line.time, line.total) == (12, 100.0, 50)
    assert line.values == {"loss": 2.5, "lr": 0.1}
    assert line.extra == {"accuracy": 0.75}  # numbers only; NaN and strings dropped
    assert parse('{"step": 3}', read_at=5.0).time is None  # type: ignore[union-attr]


def test_parse_refuses_what_is_not_a_step() -> None:
    for text in ("not json", "[1, 2]", '{"loss": 1.0}', '{"step": "3"}', '{"step": 2.5}', '{"step": true}'):
        assert parse(text, read_at=0.0) is None, text


def test_poll_writes_batches_and_progress_and_waits_for_whole_lines(tmp_path: Path) -> None:
    metrics, progress = tmp_path / "m.jsonl", tmp_path / "progress.json"
    warnings: list[str] = []
    reader = Reported(metrics, str(tmp_path / "results"), progress, IDS, warnings.append)
    reader.poll()  # no file yet: nothing, no error
    assert not dataset.files(tmp_path / "results")
    with open(metrics, "w") as f:
        f.write(
            '{"step": 11, "loss": 3.0, "time": 100.0, "total": 20}\n'
            '{"step": 12, "loss": 2.0, "time": 102.0}\nnonsense\n{"step": 13, "lo'
        )
    reader.poll()
    assert [line.step for line in reader.lines] == [11, 12]
    assert len(warnings) == 1 and "nonsense" in warnings[0]
    written = dataset.read(dataset.files(tmp_path / "results")).to_pylist()
    assert [(r["step"], r["loss"], r["step_time_s"], r["job_id"]) for r in written] == [
        (11, 3.0, None, "7"),
        (12, 2.0, 2.0, "7"),
    ]
    shown = json.loads(progress.read_text())
    assert (shown["step"], shown["total"], shown["loss"], shown["step_time_s"], shown["eta_s"]) == (
        12,
        20,
        2.0,
        2.0,
        16.0,
    )
    with open(metrics, "a") as f:
        f.write('ss": 1.5, "time": 106.0}\nalso bad\n')  # the half line completed
    reader.poll()
    assert [line.step for line in reader.lines] == [11, 12, 13] and len(warnings) == 1  # one warning per attempt
    assert reader.step_times() == [2.0, 4.0]
    assert len(dataset.files(tmp_path / "results")) == 2


def test_odd_numbers_neither_stop_the_reader_nor_reach_the_tables(tmp_path: Path) -> None:
    """A clock in milliseconds, numbers too large for a float or an int64, a step past int64:
    each once raised in the launcher (fromtimestamp's ValueError, float's OverflowError) and ended
    the attempt with the script still running. Now the time is dropped (the line is timed when
    read), the number skipped, the line without a usable step refused, and what is left written."""
    huge = "1" + "0" * 400
    assert parse('{"step": 3, "time": 1763800000000}', read_at=5.0).time is None  # type: ignore[union-attr]
    line = parse(f'{{"step": 3, "loss": {huge}, "seen": {huge}, "total": {huge}}}', read_at=5.0)
    assert line is not None and (line.values, line.extra, line.total) == ({}, {}, None)
    assert parse(f'{{"step": {2**63}}}', read_at=0.0) is None and parse('{"step": -1}', read_at=0.0) is None
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(
        f'{{"step": 1, "loss": 2.0, "time": 1763800000000}}\n{{"step": 2, "loss": {huge}, "time": 1e400}}\n'
    )
    warnings: list[str] = []
    reader = Reported(metrics, str(tmp_path / "results"), tmp_path / "progress.json", IDS, warnings.append)
    reader.poll()
    assert not warnings, warnings
    written = dataset.read(dataset.files(tmp_path / "results")).to_pylist()
    assert [(r["step"], r["loss"]) for r in written] == [(1, 2.0), (2, None)]


def test_a_failed_write_is_one_warning_and_its_rows_are_written_later(tmp_path: Path) -> None:
    """The tables are the run's record, not a reason to end its training: a results directory
    that cannot be written (here a file stands where it should be) warns once however many
    flushes fail, reading goes on, and the rows of the failed writes go with the next one."""
    results = tmp_path / "results"
    results.write_text("not a directory")
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 1, "loss": 2.0, "time": 100.0}\n')
    warnings: list[str] = []
    reader = Reported(metrics, str(results), tmp_path / "progress.json", IDS, warnings.append)
    reader.poll()
    with open(metrics, "a") as f:
        f.write('{"step": 2, "loss": 1.5, "time": 101.0}\n')
    reader.poll()
    assert len(warnings) == 1 and "could not record" in warnings[0], warnings
    assert [line.step for line in reader.lines] == [1, 2]
    results.unlink()  # the disk has room again
    with open(metrics, "a") as f:
        f.write('{"step": 3, "loss": 1.0, "time": 103.0}\n')
    reader.poll()
    written = dataset.read(dataset.files(results)).to_pylist()
    assert [(r["step"], r["step_time_s"]) for r in written] == [(1, None), (2, 1.0), (3, 2.0)] and len(warnings) == 1
    assert json.loads((tmp_path / "progress.json").read_text())["step"] == 3


def test_a_line_the_tables_cannot_store_does_not_stop_the_record(tmp_path: Path) -> None:
    """A key JSON allows but the tables cannot store (a lone surrogate, "\\ud800") is dropped with
    the line's other values kept; the steps after it are written as they come (it once stayed in
    every later batch, and nothing more was recorded for the attempt)."""
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 1, "loss": 2.0, "\\ud800": 1.0, "ok": 3.0, "time": 100.0}\n')
    warnings: list[str] = []
    reader = Reported(metrics, str(tmp_path / "results"), tmp_path / "progress.json", IDS, warnings.append)
    reader.poll()
    with open(metrics, "a") as f:
        f.write('{"step": 2, "loss": 1.5, "time": 101.0}\n')
    reader.poll()
    written = dataset.read(dataset.files(tmp_path / "results")).to_pylist()
    assert [(r["step"], r["loss"], dict(r["extra"])) for r in written] == [
        (1, 2.0, {"ok": 3.0}),
        (2, 1.5, {}),
    ] and not warnings, (written, warnings)
    assert json.loads((tmp_path / "progress.json").read_text())["step"] == 2
