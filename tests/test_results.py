"""Parquet results: schema round trip, many concurrent writers, compaction during writes, bad
files, and the comparison and check commands (the report: tests/test_report.py)."""

from __future__ import annotations

import datetime as dt
import multiprocessing
import random
import time
import typing as tp
import uuid
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hpcrun.results import COLUMNS, compact, files, load, table, write_attempt
from tests.helpers import cli


def row(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "run_id": "r1", "site": "local", "strategy": "ddp", "nodes": 1, "world_size": 2, "status": "completed",
        "tokens_per_s": 1000.0, "tokens_per_s_per_gpu": 500.0, "mfu": 0.4, "peak_memory_bytes": 2**30,
        "step_time_p50_s": 0.1, "start_time": dt.datetime(2026, 11, 1, tzinfo=dt.timezone.utc), "extra": {"a": 1.5},
    }
    base.update(over)
    return base


def test_schema_round_trip(tmp_path: Path) -> None:
    full = {name: None for name in COLUMNS}
    values = {pa.string(): "x", pa.int64(): 7, pa.float64(): 0.25}
    for name, kind in COLUMNS.items():
        full[name] = values.get(kind, dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc))
    full["attempt_id"] = "a1"
    full["extra"] = {"user_metric": 3.5}
    write_attempt(tmp_path, full)
    df = load(tmp_path)
    assert len(df) == 1
    got = df.iloc[0]
    for name in COLUMNS:
        assert got[name] == full[name], name
    assert dict(got["extra"]) == {"user_metric": 3.5}
    assert str(df["nodes"].dtype) == "Int64" and str(df["mfu"].dtype) == "Float64"
    assert str(df["strategy"].dtype).startswith("string") and str(df["start_time"].dtype) == "datetime64[us, UTC]"


def test_wall_clock_columns_time_the_steps_tokens_per_s_times() -> None:
    """A loop of 2 warm-up steps and 4 timed ones, 1 s each: a 5 s save after step 2 (warm-up), a
    0.5 s snapshot after step 3 and the final 2 s save. The wall clock runs from the end of step 2,
    its save included, to the end of step 6, the final save included; the stall sums are the
    attempt's. An attempt no longer than its warm-up is timed whole; one whose loop hpcrun does not
    run (a command job) has no wall clock."""
    import dataclasses

    from hpcrun.runtime.metrics import Measurements, summarise

    m = Measurements()
    saves, snapshots = {2: 5.0, 6: 2.0}, {3: 0.5}
    at = {0: 0.0}  # the end of each step, its stall included, on a clock made for the test
    m.mark(2)
    for step in range(1, 7):
        m.step_times.append(1.0)
        m.checkpoint_saves += [saves[step]] if step in saves else []
        m.snapshot_stalls += [snapshots[step]] if step in snapshots else []
        m.mark(2)
        at[step] = at[step - 1] + 1.0 + saves.get(step, 0.0) + snapshots.get(step, 0.0)
    assert m.started and m.warm and m.latest and (m.warm.steps, m.warm.saves, m.latest.snapshots) == (2, 1, 1)
    m.started, m.warm, m.latest = (dataclasses.replace(k, at=at[k.steps]) for k in (m.started, m.warm, m.latest))
    row = summarise(m, 2, 100, 1, 2, None, None)
    assert row["tokens_per_s"] == 100.0 and row["wall_tokens_per_s"] == pytest.approx(400 / 6.5)
    assert row["recovery_overhead"] == pytest.approx(2.5 / 6.5)
    assert (row["checkpoint_stall_s"], row["snapshot_stall_s"]) == (7.0, 0.5)
    short = summarise(m, 6, 100, 1, 2, None, None)  # no more steps than the warm-up: all of them
    assert short["wall_tokens_per_s"] == pytest.approx(600 / 13.5) and short["recovery_overhead"] == pytest.approx(
        7.5 / 13.5
    )
    untimed = summarise(Measurements(step_times=[1.0]), 2, 100, 1, 2, None, None)
    assert (untimed["wall_tokens_per_s"], untimed["recovery_overhead"], untimed["snapshot_stall_s"]) == (None, None, 0)


def test_unknown_column_is_refused() -> None:
    with pytest.raises(ValueError, match="not in the results schema"):
        table([{"run_id": "x", "bogus": 1}])


ROUNDS: tp.Any = None  # in writer processes: how many checks the test has done so far
WRITTEN: tp.Any = None  # in writer processes: how many rows all writers have written so far


def _share_counters(rounds: tp.Any, written: tp.Any) -> None:
    global ROUNDS, WRITTEN
    ROUNDS, WRITTEN = rounds, written


def _writer(args: tuple[str, int, int]) -> list[str]:
    directory, index, count = args
    ids = []
    for k in range(count):
        deadline = time.time() + 60  # the test fails on its own count if the checks stop
        while ROUNDS is not None and ROUNDS.value < k and time.time() < deadline:
            time.sleep(0.002)  # row k waits for check k: writes and checks interleave
        attempt = uuid.uuid4().hex
        write_attempt(directory, row(run_id=f"w{index}", attempt_id=attempt, attempt=k))
        if WRITTEN is not None:
            with WRITTEN.get_lock():
                WRITTEN.value += 1
        ids.append(attempt)
        time.sleep(random.random() * 0.01)
    return ids


def test_200_concurrent_writers_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(200) as pool:
        written = [a for ids in pool.map(_writer, [(str(tmp_path), i, 1) for i in range(200)]) for a in ids]
    df = load(tmp_path)
    assert len(written) == 200 and sorted(df["attempt_id"]) == sorted(written)
    assert not list(tmp_path.glob(".tmp-*"))


def test_compaction_during_writes_loses_nothing(tmp_path: Path) -> None:
    """Compactions that merge files while writers are still writing: each writer's k-th row waits
    for the k-th check, and each check for a row written since the one before, so the checks
    below really run between writes, however fast or slow this machine is (under CI's load the
    writers' pool once started after ten checks had run, and two merges were all there was)."""
    ctx = multiprocessing.get_context("fork")
    rounds, written_rows = ctx.Value("i", 0), ctx.Value("i", 0)
    merges = 0
    with ctx.Pool(20, initializer=_share_counters, initargs=(rounds, written_rows)) as pool:
        pending = pool.map_async(_writer, [(str(tmp_path), i, 10) for i in range(20)])
        seen = checked_after = 0
        while not pending.ready():
            deadline = time.time() + 60
            while written_rows.value == checked_after and not pending.ready():
                assert time.time() < deadline, "no row written in 60 s"
                time.sleep(0.002)
            checked_after = written_rows.value
            merged, _ = compact(tmp_path)
            df = load(tmp_path)
            assert df["attempt_id"].is_unique  # a reader never sees a row twice
            assert len(df) >= seen  # ... nor loses one it saw
            seen = len(df)
            merges += merged > 0
            rounds.value += 1
        written = [a for ids in pending.get(timeout=60) for a in ids]
    assert rounds.value >= 10 and merges >= 5, (rounds.value, merges)  # the checks ran between the writes
    compact(tmp_path)
    assert sorted(load(tmp_path)["attempt_id"]) == sorted(written)
    assert len(files(tmp_path)) == 1
    assert compact(tmp_path) == (0, 0)  # idempotent


def test_bad_files_are_reported_and_skipped(tmp_path: Path) -> None:
    write_attempt(tmp_path, row(attempt_id="good"))
    good = files(tmp_path)[0]
    (tmp_path / "truncated.parquet").write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
    pq.write_table(pa.table({"something": [1, 2]}), tmp_path / "foreign.parquet")
    with pytest.warns(UserWarning) as caught:
        df = load(tmp_path)
    assert list(df["attempt_id"]) == ["good"]
    messages = " ".join(str(w.message) for w in caught)
    assert "truncated.parquet: skipped" in messages and "foreign.parquet: skipped" in messages
    out = cli("results", "--dir", str(tmp_path), "--format", "csv")
    assert out.exit_code == 0 and "warning: " in out.stderr and "good" in out.stdout


def test_compare_scaling_efficiency(tmp_path: Path) -> None:
    for nodes, per_gpu, strategy in [
        (1, 500.0, "ddp"),
        (2, 450.0, "ddp"),
        (1, 400.0, "fsdp"),
        (2, 400.0, "fsdp"),
        (2, 1.0, "ddp"),
    ]:
        status = "failed" if per_gpu == 1.0 else "completed"
        write_attempt(tmp_path, row(strategy=strategy, nodes=nodes, tokens_per_s_per_gpu=per_gpu, status=status))
    out = cli("results", "--dir", str(tmp_path), "--compare", "strategy,nodes", "--format", "json")
    assert out.exit_code == 0, out.output
    table_ = pd.read_json(__import__("io").StringIO(out.stdout))
    eff = {(r.strategy, r.nodes): round(r.scaling_efficiency, 3) for r in table_.itertuples()}
    assert eff == {("ddp", 1): 1.0, ("ddp", 2): 0.9, ("fsdp", 1): 1.0, ("fsdp", 2): 1.0}
    assert list(table_["runs"]) == [1, 1, 1, 1]  # the failed run is not averaged in
    md = cli("results", "--dir", str(tmp_path), "--compare", "strategy,nodes", "--format", "markdown").stdout
    assert md.splitlines()[1].startswith("|--")


def test_check_against_baseline(tmp_path: Path) -> None:
    write_attempt(tmp_path, row(tokens_per_s=1000.0))
    ok = tmp_path / "ok.yaml"
    ok.write_text("references:\n- {match: {strategy: ddp}, metric: tokens_per_s, value: 1050, tolerance: 0.1}\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("references:\n- {match: {strategy: ddp}, metric: tokens_per_s, value: 1200, tolerance: 0.1}\n")
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("references:\n- {match: {strategy: ddp}, metric: tokens_per_s, value: 1200, tolerence: 0.1}\n")
    assert cli("results", "check", "--dir", str(tmp_path), "--baseline", str(ok)).exit_code == 0
    out = cli("results", "check", "--dir", str(tmp_path), "--baseline", str(bad))
    assert out.exit_code == 1 and "REGRESSION strategy=ddp: tokens_per_s 1000" in out.output
    out = cli("results", "check", "--dir", str(tmp_path), "--baseline", str(wrong))
    assert out.exit_code == 2 and f"{wrong}: references.0.tolerence: unknown key" in out.output


def _many_writer(args: tuple[str, int, int]) -> list[str]:
    directory, index, count = args
    ids = []
    for k in range(count):
        attempt = uuid.uuid4().hex
        write_attempt(directory, row(run_id=f"m{index}", attempt_id=attempt, attempt=k))
        ids.append(attempt)
    return ids


def test_readers_compact_when_files_accumulate(tmp_path: Path) -> None:
    """No manual step keeps reads fast, and no job pays for it: 4 processes write 700 attempts at
    once and merge nothing (a job's end, after SIGTERM, has only KillWait left); the first read
    that finds more than AUTO_COMPACT_FILES files merges them. Every attempt is there once."""
    from hpcrun.results import AUTO_COMPACT_FILES

    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(4) as pool:
        written = [a for ids in pool.map(_many_writer, [(str(tmp_path), i, 175) for i in range(4)]) for a in ids]
    assert len(files(tmp_path)) == 700  # the writers merged nothing
    df = load(tmp_path)
    assert len(written) == 700 and df["attempt_id"].is_unique and sorted(df["attempt_id"]) == sorted(written)
    assert [p.name.startswith("compacted-") for p in files(tmp_path)] == [True]
    assert len(files(tmp_path)) <= AUTO_COMPACT_FILES


def older_and_newer_files(directory: Path) -> tuple[set[str], dict[str, bytes]]:
    """A file from an earlier hpcrun (fewer columns), one from a later one (a column more), a
    torn copy and a foreign Parquet file. Returns the attempt ids of the readable rows and the
    bytes of the unreadable files by name."""
    good = table([row(attempt_id="old-1"), row(attempt_id="old-2")])
    older = good.drop_columns(
        ["slow_ranks", "checkpoint_write_s", "wall_tokens_per_s", "snapshot_stall_s", "recovery_overhead", "extra"]
    )
    pq.write_table(older, directory / "r0__1__0__older.parquet")
    newer = table([row(attempt_id="new-1")]).append_column("energy_j", pa.array([12.5]))
    pq.write_table(newer, directory / "r0__2__0__newer.parquet")
    whole = (directory / "r0__1__0__older.parquet").read_bytes()
    unreadable = {"torn.parquet": whole[: len(whole) // 2], "foreign.parquet": b""}
    (directory / "torn.parquet").write_bytes(unreadable["torn.parquet"])
    pq.write_table(pa.table({"something": [1, 2]}), directory / "foreign.parquet")
    unreadable["foreign.parquet"] = (directory / "foreign.parquet").read_bytes()
    return {"old-1", "old-2", "new-1"}, unreadable


def test_compaction_keeps_every_row_and_every_unreadable_byte(tmp_path: Path) -> None:
    """Files of earlier and later hpcrun versions, a torn file and a foreign one, while 4 processes
    write 400 attempts and `hpcrun results compact` runs beside them: every readable row loads
    afterwards, the older file's missing columns as nulls, and the unreadable files' bytes are
    all under unreadable/ (once an unreadable file sent reads file by file, where an older file
    was skipped too, and compaction deleted every input it had listed)."""
    readable, unreadable = older_and_newer_files(tmp_path)
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(4) as pool:
        pending = pool.map_async(_many_writer, [(str(tmp_path), i, 100) for i in range(4)])
        compactions = 0
        while not pending.ready() or compactions < 2:
            out = cli("results", "compact", "--dir", str(tmp_path))
            assert out.exit_code == 0, out.output
            compactions += 1
        written = [a for ids in pending.get(timeout=120) for a in ids]
    assert cli("results", "compact", "--dir", str(tmp_path)).exit_code == 0
    df = load(tmp_path)
    assert df["attempt_id"].is_unique and set(df["attempt_id"]) == readable | set(written)
    old = df[df["attempt_id"] == "old-1"].iloc[0]
    assert old["tokens_per_s"] == 1000.0 and pd.isna(old["slow_ranks"]) and pd.isna(old["checkpoint_write_s"])
    assert {p.name: p.read_bytes() for p in (tmp_path / "unreadable").iterdir()} == unreadable
    # the newer file is read (without its new column) but not merged: merging would drop that column
    assert (tmp_path / "r0__2__0__newer.parquet").exists()
    assert "energy_j" in pq.read_schema(tmp_path / "r0__2__0__newer.parquet").names


def test_compaction_leaves_what_it_did_not_merge(tmp_path: Path) -> None:
    """Compaction removes exactly the files whose rows it wrote: an older file is merged (its
    rows, missing columns and all, are in the merged file), a newer one stays."""
    readable, _ = older_and_newer_files(tmp_path)
    write_attempt(tmp_path, row(attempt_id="current"))
    with pytest.warns(UserWarning, match="torn.parquet: not a readable Parquet file"):
        merged, rows = compact(tmp_path)
    assert (merged, rows) == (2, 3)  # the older file and the current one
    assert sorted(p.name for p in files(tmp_path))[1:] == ["r0__2__0__newer.parquet"]
    df = load(tmp_path)
    assert set(df["attempt_id"]) == readable | {"current"}
    older = df[df["attempt_id"].isin(["old-1", "old-2"])]
    assert older[["wall_tokens_per_s", "snapshot_stall_s", "recovery_overhead"]].isna().all().all()


def test_compaction_merges_only_files_it_may_remove() -> None:
    """In a results directory a group shares (sticky, like /tmp), a user may not remove another's
    files: compaction merges only its own, and never writes a merged copy of rows it cannot
    remove (which every later read would merge again)."""
    import os
    import subprocess
    import sys
    import tempfile

    from tests.runs import ROOT
    from tests.slurmstats import run_as

    shared = Path(tempfile.mkdtemp(prefix="hpcrun-shared-results-"))
    try:
        shared.chmod(0o1777)
        theirs = [write_attempt(shared, row(attempt_id=f"root-{i}")) for i in range(2)]
        for i in range(2):
            os.chown(write_attempt(shared, row(attempt_id=f"nobody-{i}")), 65534, 65534)
        merge = "from hpcrun.results import compact; print(*compact(__import__('sys').argv[1]))"
        out = subprocess.run(
            [*run_as("65534"), sys.executable, "-c", merge, str(shared)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(shared)},
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["2", "2"]  # its own two files, nobody else's
        assert all(p.exists() for p in theirs)
        assert sorted(load(shared)["attempt_id"]) == ["nobody-0", "nobody-1", "root-0", "root-1"]
        assert len(files(shared)) == 3
    finally:
        subprocess.run(["rm", "-rf", str(shared)], check=True)


def test_compare_groups_by_the_reports_strategy_labels(tmp_path: Path) -> None:
    """ZeRO stages and offloads are separate rows (as in the report), a group that averages runs
    measuring different things says so, and the table reads in one unit per column."""
    for stage, offload, model, rate in [
        (1, "none", "tiny", 11990.0),
        (2, "none", "tiny", 9920.0),
        (3, "cpu", "tiny", 8000.0),
        (3, "nvme", "tiny", 7000.0),
        (3, "nvme", "small", 3000.0),
    ]:
        write_attempt(
            tmp_path,
            row(
                run_id=f"z{stage}{offload}{model}",
                strategy="deepspeed",
                zero_stage=stage,
                offload_optimizer=offload,
                offload_param="none",
                model=model,
                tokens_per_s=rate,
                # ZeRO-3's rows as files written before the wall clock was measured
                wall_tokens_per_s=0.9 * rate if stage < 3 else None,
                recovery_overhead=0.0053 if stage < 3 else None,
            ),
        )
    out = cli("results", "--dir", str(tmp_path), "--compare", "strategy,nodes", "--format", "json")
    assert out.exit_code == 0, out.output
    table_ = pd.read_json(__import__("io").StringIO(out.stdout))
    assert list(table_["strategy"]) == ["zero1", "zero2", "zero3+cpu", "zero3+nvme"]
    assert list(table_["runs"]) == [1, 1, 1, 2] and list(table_["mixes"].fillna("")) == ["", "", "", "model"]
    assert "warning: strategy=zero3+nvme, nodes=1 averages runs that differ in model" in out.stderr
    assert list(table_.columns[2:5]) == ["tokens_per_s", "wall_tokens_per_s", "recovery_overhead"]
    assert list(table_["wall_tokens_per_s"][:2]) == [10791.0, 8928.0] and table_["wall_tokens_per_s"][2:].isna().all()
    shown = cli("results", "--dir", str(tmp_path), "--compare", "strategy,nodes").stdout
    assert "12 k" in shown and "9.92 k" in shown and "e+0" not in shown, shown
    header, _, zero1, *_, zero3 = shown.splitlines()
    assert header.split()[2:5] == ["tokens_per_s", "wall_tokens_per_s", "recovery_overhead"], shown
    assert zero1.split()[2:8] == ["12", "k", "10.8", "k", "0.53", "%"], shown
    assert zero3.split()[4:6] == ["–", "–"], shown  # not measured: a dash, never nan


def test_files_compaction_leaves_do_not_make_every_read_compact(tmp_path: Path) -> None:
    """Files a compaction must leave as they are (here a column of another type: not merged, a
    warning each time it is read for merging) do not count towards the next compaction, so a
    directory with more of them than the limit is not merged again at every read."""
    from hpcrun.results import compact_when_many

    for i in range(4):
        odd = table([row(attempt_id=f"odd-{i}")]).set_column(
            list(COLUMNS).index("nodes"), "nodes", pa.array(["two"])
        )  # a string where hpcrun writes an integer
        pq.write_table(odd, tmp_path / f"r{i}__1__0__odd.parquet")
    with pytest.warns(UserWarning, match="left as it is, not merged"):
        compact_when_many(tmp_path, limit=3)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second merge attempt would warn again
        compact_when_many(tmp_path, limit=3)
    for i in range(4):
        write_attempt(tmp_path, row(attempt_id=f"new-{i}"))
    with pytest.warns(UserWarning, match="left as it is, not merged"):  # four new files: time to merge
        compact_when_many(tmp_path, limit=3)
    assert sum(p.name.startswith("compacted-") for p in files(tmp_path)) == 1


def test_compare_names_a_shrunk_attempt_among_full_size_runs(tmp_path: Path) -> None:
    """A completed attempt that shrank from 3 nodes to 2 after a lost node (its global batch the
    3-node run's) is not averaged silently with 2-node runs: `mixes` says global_batch."""
    from hpcrun.compare import compare

    measured = {"wall_tokens_per_s": 900.0, "recovery_overhead": 0.01}
    table = pd.DataFrame([row(run_id="a", nodes=2, world_size=4, global_batch=8, **measured),
                          row(run_id="b", nodes=2, world_size=4, global_batch=12, **measured)])
    assert compare(table, ["strategy", "nodes"])["mixes"].tolist() == ["global_batch"]
    assert compare(table.iloc[:1], ["strategy", "nodes"])["mixes"].tolist() == [""]
