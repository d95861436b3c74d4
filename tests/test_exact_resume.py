"""Exact resume: a run stopped politely and resumed ends with the same weights (sha256 of
`checkpoint.export_final`) and the same per-step losses as a run never stopped, for DDP at world
size 4 and FSDP, ZeRO-3, ZeRO-2 and ZeRO-Infinity (optimizer and weights on NVMe) at 2; the DDP run
is also killed outright after a later checkpoint and resumed again. What a kill adds (a resume from
an older checkpoint than the last step, steps trained twice and their losses recorded once) is
hpcrun's, not the strategy's: every strategy saves into a step directory hpcrun commits, so one
strategy proves it (CI time: a 4-rank DeepSpeed attempt costs this machine ~50 s of CPU).

At 2 ranks a sum of two numbers has one order, so 2-rank tests cannot see a reduction whose order
changes after a restart; at 4 ranks DDP's default bucketed all-reduce does (its buckets are
rebuilt after the first iteration, so a resumed run's first step reduces in another layout).
FSDP and DeepSpeed reduce over flat buffers laid out once, the same before and after a restart,
so 4 ranks would prove nothing more for them than 2 (at twice the CPU: they ran at 4 while CI
had room, and again from f5915f1 until it had none); ZeRO-2 (DeepSpeed's stage 1-2 optimizer,
not stage 3's) proves its own save and load. The uninterrupted FSDP and ZeRO-3 runs' last
checkpoints are also consolidated on one process (`hpcrun checkpoint consolidate`) into the
weights they ended with."""

from __future__ import annotations

import math
import os
import random
import signal
import time
from pathlib import Path

import pytest

from tests.delayed_training import entrypoint_job
from tests.helpers import ROOT
from tests.runs import STRATEGIES, hpcrun, losses, recipe, rows, run_dir_of, site_copy, state, status, wait_for
from tests.test_fault_tolerance import alive, checkpoint_after, controller, ranks, weights
from tests.test_runtime import MEASURED

pytestmark = pytest.mark.slow

TRAINING = {"steps": 12, "lr": 0.003, "micro_batch": 2, "seq_len": 32}
STEP_DELAY_S = 0.5  # the stopped job lasts >= 6 s: time to signal, then to kill it, after a checkpoint


def trained_and_measured(tmp_path: Path, name: str, run_dir: Path, strategy: dict[str, object], world: int) -> None:
    """The uninterrupted run trained (its loss fell) and filled every measured column of its
    results row: for these five strategies this replaces a separate 2-rank training test
    (tests/test_runtime.py `test_strategy_trains` covers the others, and the columns derived from
    the built-in model's size, which an entrypoint job like this one does not declare)."""
    assert state(run_dir)["status"] == "completed"
    curve = losses(run_dir)
    # the small model's loss (SWAPPING) moves within noise in 12 steps; its run is there for its exactness
    assert len(curve) == TRAINING["steps"] and (name in SWAPPING or curve[-1] < curve[0] - 0.05), curve
    (row,) = rows(tmp_path, run_dir).to_dict("records")
    sized = ("tokens_per_s", "wall_tokens_per_s", "tokens_per_s_per_gpu", "parameters", "tflops_per_gpu", "mfu")
    missing = [
        c for c in MEASURED if c not in sized and row[c] is None or (isinstance(row[c], float) and math.isnan(row[c]))
    ]
    assert not missing, f"unfilled measurements: {missing}"
    assert row["world_size"] == world and row["strategy"] == strategy["name"]
    assert row["checkpoint_saves"] == TRAINING["steps"] // 2 and row["steps_timed"] == TRAINING["steps"] - 2


def interrupted(tmp_path: Path, name: str, strategy: dict[str, object], world: int, kill: bool) -> tuple[Path, Path]:
    """An uninterrupted run of `world` ranks, and the same recipe stopped politely (USR2 to one rank only,
    at a random moment after the first checkpoint: all ranks must agree, save and stop), resumed,
    then (`kill`) SIGKILLed whole (no chance to save) after a later checkpoint, and resumed to
    the end."""
    rng = random.Random(name)
    # `world` rank processes on this machine's cores, whatever their number (oversubscribed is slower, not different)
    partition = {
        "max_nodes": 1,
        "gpus_per_node": 0,
        "cpus_per_node": 4,
        "memory_gb": 16,
        "max_time": "1-00:00:00",
        "cpu_peak_tflops_per_rank": 0.05,
    }
    storage = {"runs_dir": str(tmp_path / "runs"), "results_dir": str(tmp_path / "results")}
    if name in SWAPPING:  # a private NVMe stand-in
        storage["nvme"] = {"path": str(tmp_path / "nvme"), "size_gb": 5}
    site = site_copy(tmp_path, partitions={"local": partition}, storage=storage)
    resources = {"nodes": 1, "gpus_per_node": world, "time": "00:10:00"}  # CPU ranks
    kwargs = {
        "strategy": strategy,
        "training": TRAINING,
        "resources": resources,
        "checkpoint": {"interval": 2, "export_final": True},
    }
    model = SWAPPING.get(name, "tiny")
    whole = recipe(tmp_path, f"{name}-whole", job=entrypoint_job(str(ROOT), 0.0, model), **kwargs)
    # the uninterrupted run trains while the interrupted one waits out its pauses and signals
    baseline = run_dir_of(hpcrun("submit", "--site", str(site), str(whole)))
    cut = recipe(tmp_path, f"{name}-cut", job=entrypoint_job(str(ROOT), STEP_DELAY_S, model), **kwargs)
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), str(cut)))
    wait_for(lambda: checkpoint_after(run_dir, 0), what="the first checkpoint")
    wait_for(lambda: len(ranks(run_dir)) == world, what=f"the {world} ranks")
    time.sleep(rng.uniform(0, 0.2))
    os.kill(rng.choice(ranks(run_dir)), signal.SIGUSR2)
    wait_for(lambda: status(run_dir) is not None, what="the stop")
    stopped = state(run_dir)
    assert stopped["status"] == "stopped" and 0 < stopped["step"] < TRAINING["steps"], stopped
    if kill:
        hpcrun("resume", "--site", str(site), run_dir.name)
        wait_for(lambda: checkpoint_after(run_dir, stopped["step"]), what="a checkpoint of the resumed job")
        time.sleep(rng.uniform(0, 0.2))
        pids = [controller(run_dir), *ranks(run_dir)]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not any(alive(p) for p in pids), what="the kill")
    hpcrun("resume", "--site", str(site), "--wait", run_dir.name)
    assert state(run_dir)["status"] == "completed", state(run_dir)
    hpcrun("status", "--site", str(site), "--wait", baseline.name)
    trained_and_measured(tmp_path, name, baseline, strategy, world)
    if name in CONSOLIDATED:
        consolidated(site, baseline)
    return baseline, run_dir


# `hpcrun checkpoint consolidate` of a finished run: DCP shards through torch's converter (FSDP) and
# ZeRO partitions through DeepSpeed's zero_to_fp32 (ZeRO-3), on the uninterrupted run's
# checkpoint (a test of its own once trained a run for each)
CONSOLIDATED = ("fsdp", "zero3", "zero3-nvme-offload")
# ZeRO-Infinity's optimizer on NVMe with a model whose partitions DeepSpeed swaps (>= 1 MiB a rank; the tiny
# model's stay in memory): its own resume loses Adam's moments (hpcrun.runtime.zeroinfinity)
SWAPPING = {"zero3-nvme-offload": "small"}


def consolidated(site: Path, run_dir: Path) -> None:
    """One process merges the run's last checkpoint into the weights the job ended with."""
    out = hpcrun("checkpoint", "consolidate", "--site", str(site), run_dir.name)
    assert out.stdout.split()[-1] == weights(run_dir)
    assert (run_dir / f"consolidated-step-{TRAINING['steps']:08d}.pt").exists()


@pytest.mark.parametrize(
    ("name", "world", "kill"),
    [
        # on the newest torch the cluster tests resume 4 DDP ranks bit-identically after each kind of fault
        pytest.param("ddp", 4, True, marks=[pytest.mark.oldest_torch, pytest.mark.oldest_only]),
        ("fsdp", 2, False),
        # DeepSpeed's, the longest of the tests off the cluster (~70-120 s each under CI's load): run beside it
        pytest.param("zero3", 2, False, marks=pytest.mark.beside_cluster),
        pytest.param("zero2", 2, False, marks=pytest.mark.beside_cluster),
        pytest.param("zero3-nvme-offload", 2, False, marks=pytest.mark.beside_cluster),
    ],
)
def test_resume_bit_identical(name: str, world: int, kill: bool, tmp_path: Path) -> None:
    started = time.monotonic()
    baseline, run_dir = interrupted(tmp_path, name, STRATEGIES[name], world, kill)
    assert losses(run_dir) == losses(baseline)
    assert weights(run_dir) == weights(baseline)
    if name in SWAPPING:  # swapped out, and saved from NVMe with each checkpoint
        assert list((run_dir / "checkpoints").glob("*/state/state/offloaded_tensors/rank01/exp_avg-*.tensor.swp"))
    print(f"{name}: {time.monotonic() - started:.0f} s")
