"""Polite polling (hpcrun.pollcache): one scheduler query per interval for all of a user's hpcrun
processes, the union of what they follow, back-off after failures and slow answers. Real
processes, a counting stand-in for the scheduler tool; the count on the real controller (SLURM's
own RPC statistics) is tests/test_cluster_campaign.py's."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
import typing as tp
from pathlib import Path

import pytest

from hpcrun import pollcache
from hpcrun.errors import HpcrunError


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """This test's cache directory (tests/conftest.py gives every test its own)."""
    return pollcache.cache_dir()


class Scheduler:
    """What the scheduler was asked (one line per query, in a file: processes share it)."""

    def __init__(self, log: Path, fail: bool = False, took_s: float = 0.0) -> None:
        self.log, self.fail, self.took_s = log, fail, took_s

    def __call__(self, ids: list[str]) -> str:
        with self.log.open("a") as f:
            f.write(",".join(ids) + "\n")
        time.sleep(self.took_s)
        if self.fail:
            raise HpcrunError("sacct failed: slurmdbd not responding")
        return "".join(f"{i}|RUNNING\n" for i in ids)

    def asked(self) -> list[list[str]]:
        return [line.split(",") for line in self.log.read_text().splitlines()] if self.log.exists() else []


def test_a_fresh_answer_is_shared_and_new_jobs_are_asked_with_the_others(tmp_path: Path) -> None:
    ask = Scheduler(tmp_path / "asked")
    assert pollcache.shared("sacct", ["1", "2"], 60, ask) == "1|RUNNING\n2|RUNNING\n"
    assert pollcache.shared("sacct", ["2"], 60, ask) == "1|RUNNING\n2|RUNNING\n"  # covered: not asked
    assert ask.asked() == [["1", "2"]]
    pollcache.shared("sacct", ["3"], 60, ask)  # not covered: asked at once, with the jobs others follow
    assert ask.asked() == [["1", "2"], ["1", "2", "3"]]


def past_the_next_query(max_age: float) -> None:
    """Sleep until the cached answer may be asked again: past `max_age` and SLOW_FACTOR times what
    the answer took, which a loaded machine can stretch (a file append held up 60 ms is 0.3 s)."""
    took = json.loads(pollcache.cache_file("sacct").read_text())["took_s"]
    time.sleep(max(max_age, pollcache.SLOW_FACTOR * took) + 0.1)


def test_an_old_answer_is_asked_again(tmp_path: Path) -> None:
    ask = Scheduler(tmp_path / "asked")
    pollcache.shared("sacct", ["1"], 0.2, ask)
    past_the_next_query(0.2)
    pollcache.shared("sacct", ["1"], 0.2, ask)
    assert len(ask.asked()) == 2


def _watcher(log: str, cache: str, seconds: float, start: tp.Any) -> None:
    os.environ["HPCRUN_CACHE_DIR"] = cache
    ask = Scheduler(Path(log))
    start.wait(60)  # all at once: ten processes started under load are ready seconds apart
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pollcache.shared("sacct", ["7", "8"], 1.0, ask)
        time.sleep(0.05)


def test_ten_processes_ask_as_often_as_one(tmp_path: Path, cache: Path) -> None:
    """Ten processes polling every 50 ms for 3 s with a 1 s interval: about 3 queries in all,
    not 600."""
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(10)
    procs = [ctx.Process(target=_watcher, args=(str(tmp_path / "asked"), str(cache), 3.0, start)) for _ in range(10)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    queries = len(Scheduler(tmp_path / "asked").asked())
    assert 2 <= queries <= 8, queries  # 3 or 4; 600 unshared


def test_a_failing_scheduler_is_not_asked_again_during_the_back_off(tmp_path: Path) -> None:
    good, bad = Scheduler(tmp_path / "asked"), Scheduler(tmp_path / "asked", fail=True)
    pollcache.shared("sacct", ["1"], 0.01, good)
    past_the_next_query(0.01)
    with pytest.raises(HpcrunError, match="slurmdbd not responding"):
        pollcache.shared("sacct", ["1"], 0.01, bad)
    assert pollcache.shared("sacct", ["1"], 0.01, bad) == "1|RUNNING\n"  # the last good answer, not a new query
    with pytest.raises(HpcrunError, match=r"slurmdbd not responding \(not asked again before \d\d:\d\d:\d\d\)"):
        pollcache.shared("sacct", ["2"], 0.01, bad)  # not covered, and the back-off holds: no query either
    assert len(good.asked()) == 2  # one good query, one failed; none during the back-off


def test_a_slow_answer_spaces_the_next_query(tmp_path: Path) -> None:
    ask = Scheduler(tmp_path / "asked", took_s=0.3)
    pollcache.shared("sacct", ["1"], 0.01, ask)
    time.sleep(0.5)  # past max_age, within SLOW_FACTOR x 0.3 s
    pollcache.shared("sacct", ["1"], 0.01, ask)
    assert len(ask.asked()) == 1


def test_a_job_nobody_follows_leaves_the_query(tmp_path: Path, cache: Path) -> None:
    ask = Scheduler(tmp_path / "asked")
    pollcache.shared("sacct", ["old"], 0.01, ask)
    path = pollcache.cache_file("sacct")
    data = json.loads(path.read_text())
    data["wanted"]["old"] -= pollcache.KEEP_S + 1  # last asked for long ago
    path.write_text(json.dumps(data))
    time.sleep(0.3)
    pollcache.shared("sacct", ["new"], 0.01, ask)
    assert ask.asked()[-1] == ["new"]


def test_a_torn_cache_is_asked_again_not_read(tmp_path: Path) -> None:
    ask = Scheduler(tmp_path / "asked")
    pollcache.shared("sacct", ["1"], 60, ask)
    pollcache.cache_file("sacct").write_text('{"ids": ["1"], "text": "1|RUN')
    assert pollcache.shared("sacct", ["1"], 60, ask) == "1|RUNNING\n"
    assert len(ask.asked()) == 2


def test_a_lock_held_for_good_is_a_warning_not_a_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Another process holds the cache's lock (stopped with it): after LOCK_WAIT_S this one asks
    alone, with a warning line naming the lock, instead of waiting for it."""
    import subprocess
    import sys

    monkeypatch.setattr(pollcache, "LOCK_WAIT_S", 0.5)
    path = pollcache.cache_file("sacct")
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_file = path.with_name(f".{path.name}.lock")
    hold = f"import filelock, time; h = filelock.FileLock({str(lock_file)!r}); h.acquire(); print('held', flush=True); "
    hold += "time.sleep(8)"
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        ask = Scheduler(tmp_path / "asked")
        began = time.monotonic()
        assert pollcache.shared("sacct", ["1"], 60, ask) == "1|RUNNING\n"
        assert time.monotonic() - began < 4
        assert ask.asked() == [["1"]]
        assert f"{lock_file} held by another process" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
