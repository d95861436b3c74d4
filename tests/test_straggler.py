"""Slow ranks (hpcrun.runtime.straggler): the verdict over probe times, and the run's record of
it in state.json. The real slow node (a rank throttled by the kernel on the test cluster, named,
then excluded at the next requeue) is in tests/test_cluster_faults.py."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from hpcrun.rundir import CorruptStateError, RunDir
from hpcrun.runtime.straggler import PERSISTENT, PERSISTENT_S, PROBE_EVERY_S, Stragglers, probe, probe_interval
from hpcrun.status import run_notes

NODES = ["node1", "node1", "node2", "node2"]


def test_a_rank_slow_in_a_row_is_named_once_with_its_node() -> None:
    judge = Stragglers(2.0, NODES)
    for i in range(PERSISTENT - 1):
        assert judge.check([0.01, 0.011, 0.05, 0.01], now=i * PERSISTENT_S) == []  # slow, but not yet persistently
    named = judge.check([0.01, 0.011, 0.05, 0.01], now=PERSISTENT * PERSISTENT_S)
    assert [(s.rank, s.node) for s in named] == [(2, "node2")]
    assert named[0].ratio == pytest.approx(0.05 / 0.01)  # against the other ranks' median, not its own
    for i in (1, 2):  # named once; its verdict is kept fresh: the median ratio of its latest checks
        assert judge.check([0.01, 0.011, 0.06, 0.01], now=(PERSISTENT + i) * PERSISTENT_S) == []
    assert judge.describe() == "rank 2 on node2 (6.0x the others' median)"


def test_frequent_slow_checks_are_not_persistent_until_they_last() -> None:
    """Flushes every half second: PERSISTENT slow probes are a second of noise, not a node,
    until they have lasted PERSISTENT_S (an overloaded machine delayed one rank's probes so)."""
    judge = Stragglers(2.0, ["a", "b"])
    checks = int(PERSISTENT_S / 0.5)
    assert all(judge.check([0.04, 0.01], now=i * 0.5) == [] for i in range(checks))
    assert [s.rank for s in judge.check([0.04, 0.01], now=checks * 0.5)] == [0]


def test_a_slow_rank_fast_now_and_then_is_named() -> None:
    """A throttled rank whose probe fits its CPU quota one check in five (seen on the test
    cluster: a streak that one fast check reset never named it) is named all the same."""
    judge = Stragglers(2.0, ["a", "b"])
    found = [judge.check([0.01, 0.01 if i % 5 == 4 else 0.08], now=i * 0.5) for i in range(2 * int(PERSISTENT_S / 0.5))]
    assert [s.rank for s in sum(found, [])] == [1]


def test_noise_in_half_the_checks_is_not_a_node() -> None:
    judge = Stragglers(2.0, ["a", "b"])
    assert all(judge.check([0.05 if i % 2 else 0.01, 0.01], now=i * 0.5) == [] for i in range(100))
    assert judge.describe() is None


def test_one_fast_check_resets_the_count_and_noise_is_not_a_node() -> None:
    judge = Stragglers(2.0, NODES)
    # checks PERSISTENT_S apart, so a verdict rests on the last PERSISTENT: one fast check among
    # them (under SLOW_SHARE of them slow) is what keeps rank 2 from being named
    for i, times in enumerate(
        ([0.01, 0.01, 0.05, 0.01], [0.01, 0.01, 0.05, 0.01], [0.01, 0.01, 0.012, 0.01], [0.01, 0.01, 0.05, 0.01])
    ):
        assert judge.check(times, now=i * PERSISTENT_S) == []
    assert judge.check([0.01, 0.019, 0.01, 0.01], now=4 * PERSISTENT_S) == []  # under the factor
    assert judge.describe() is None


def test_two_ranks_each_compare_with_the_other() -> None:
    judge = Stragglers(2.0, ["a", "b"])
    found = [judge.check([0.01, 0.04], now=i * PERSISTENT_S) for i in range(PERSISTENT)]
    assert [s.rank for s in found[-1]] == [1] and found[0] == []  # the fast one is not named for being half


def test_probes_keep_to_their_share_of_the_ranks_time() -> None:
    """A CPU rank's ~40 ms probe at the default 0.5% comes every 8 s, not every 2.5 s (1.6% of the
    training at fast steps); a GPU's few ms keep the 2.5 s floor. The median decides: one slow rank
    (the one to be named) does not space the checks out."""
    assert probe_interval([0.04, 0.04, 0.05, 0.6], 0.005) == pytest.approx(9.0)
    assert probe_interval([0.003, 0.002], 0.005) == PROBE_EVERY_S
    assert probe_interval([0.04, 0.04], 0.05) == PROBE_EVERY_S


def test_probe_times_local_work() -> None:
    # its own cost in CPU time (0.04-0.2 s), which a busy machine does not stretch as it stretches the wall time
    began = time.process_time()
    seconds = probe(torch.device("cpu"))
    cpu = time.process_time() - began
    assert math.isfinite(seconds) and seconds > 0, seconds
    assert cpu < 2.0, f"the probe took {cpu:.2f} s of CPU"


def test_state_with_slow_ranks_of_the_wrong_type_is_refused(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    run_dir.state_file.write_text(json.dumps({"status": "completed", "slow_ranks": ["rank 1 on node2"]}))
    with pytest.raises(CorruptStateError, match="slow_ranks is not a JSON object"):
        run_dir.state()


def test_status_names_slow_ranks_and_exclusions() -> None:
    mark = {"slow_ranks": {"rank 1 on node2": 7.31}, "excluded_nodes": ["node2"]}
    assert run_notes("USR2 at step 40", mark) == "USR2 at step 40; slow: rank 1 on node2 (7.3x); excluding node2"
    assert run_notes("", mark) == "slow: rank 1 on node2 (7.3x); excluding node2"
