"""Slow ranks (hpcrun.runtime.straggler): the verdict over probe times, and the run's record of
it in state.json. The real slow node (a rank throttled by the kernel on the test cluster, named,
then excluded at the next requeue) is in tests/test_cluster_faults.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpcrun.rundir import CorruptStateError, RunDir
from hpcrun.runtime.straggler import PERSISTENT, Stragglers, probe
from hpcrun.status import run_notes

NODES = ["node1", "node1", "node2", "node2"]


def test_a_rank_slow_in_a_row_is_named_once_with_its_node() -> None:
    judge = Stragglers(2.0, NODES)
    for _ in range(PERSISTENT - 1):
        assert judge.check([0.01, 0.011, 0.05, 0.01]) == []  # slow, but not yet persistently
    named = judge.check([0.01, 0.011, 0.05, 0.01])
    assert [(s.rank, s.node) for s in named] == [(2, "node2")]
    assert named[0].ratio == pytest.approx(0.05 / 0.01)  # against the other ranks' median, not its own
    assert judge.check([0.01, 0.011, 0.06, 0.01]) == []  # named once; its verdict is kept fresh
    assert judge.describe() == "rank 2 on node2 (6.0x the others' median)"


def test_one_fast_check_resets_the_count_and_noise_is_not_a_node() -> None:
    judge = Stragglers(2.0, NODES)
    for times in ([0.01, 0.01, 0.05, 0.01], [0.01, 0.01, 0.05, 0.01], [0.01, 0.01, 0.012, 0.01], [0.01, 0.01, 0.05, 0.01]):
        assert judge.check(times) == []
    assert judge.check([0.01, 0.019, 0.01, 0.01]) == []  # under the factor
    assert judge.describe() is None


def test_two_ranks_each_compare_with_the_other() -> None:
    judge = Stragglers(2.0, ["a", "b"])
    found = [judge.check([0.01, 0.04]) for _ in range(PERSISTENT)]
    assert [s.rank for s in found[-1]] == [1] and found[0] == []  # the fast one is not named for being half


def test_probe_times_local_work() -> None:
    seconds = probe(torch.device("cpu"))
    assert 0 < seconds < 5


def test_state_with_slow_ranks_of_the_wrong_type_is_refused(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    run_dir.state_file.write_text(json.dumps({"status": "completed", "slow_ranks": ["rank 1 on node2"]}))
    with pytest.raises(CorruptStateError, match="slow_ranks is not a JSON object"):
        run_dir.state()


def test_status_names_slow_ranks_and_exclusions() -> None:
    mark = {"slow_ranks": {"rank 1 on node2": 7.31}, "excluded_nodes": ["node2"]}
    assert run_notes("USR2 at step 40", mark) == "USR2 at step 40; slow: rank 1 on node2 (7.3x); excluding node2"
    assert run_notes("", mark) == "slow: rank 1 on node2 (7.3x); excluding node2"
