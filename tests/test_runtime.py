"""The in-job runtime, for real: 2-process gloo jobs through submitit's local executor."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.runs import STRATEGIES, hpcrun, losses, recipe, rows, run_dir_of, site_copy, state, status

pytestmark = pytest.mark.slow

MEASURED = [
    "tokens_per_s",
    "wall_tokens_per_s",
    "tokens_per_s_per_gpu",
    "samples_per_s",
    "step_time_p50_s",
    "step_time_p95_s",
    "peak_memory_bytes",
    "parameters",
    "tflops_per_gpu",
    "mfu",
    "final_loss",
    "checkpoint_save_s",
    "checkpoint_stall_s",
    "checkpoint_write_s",
    "snapshot_stall_s",
    "recovery_overhead",
    "restart_wait_s",
    "start_time",
    "end_time",
]


# ddp (at 4 ranks), fsdp, zero2, zero3 and zero3-nvme-offload (at 2) train and are measured in
# tests/test_exact_resume.py (the last one's loss falling in tests/test_snapshot.py's shrink baseline)
MEASURED_ELSEWHERE = ("ddp", "fsdp", "zero2", "zero3", "zero3-nvme-offload")


@pytest.mark.parametrize("name", [n for n in STRATEGIES if n not in MEASURED_ELSEWHERE])
def test_strategy_trains(name: str, tmp_path: Path) -> None:
    site = site_copy(tmp_path)
    if "nvme" in name:  # a private NVMe stand-in, so parallel test runs cannot collide
        site = site_copy(
            tmp_path,
            storage={
                "runs_dir": str(tmp_path / "runs"),
                "results_dir": str(tmp_path / "results"),
                "nvme": {"path": str(tmp_path / "nvme"), "size_gb": 5},
            },
        )
    rec = recipe(
        tmp_path,
        name,
        strategy=STRATEGIES[name],
        training={"steps": 8, "lr": 0.003, "warmup_steps": 2},
        checkpoint={"interval": 4},
    )
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), "--wait", str(rec)))
    assert state(run_dir)["status"] == "completed"
    curve = losses(run_dir)
    assert len(curve) == 8 and curve[-1] < curve[0] - 0.05, curve
    (row,) = rows(tmp_path, run_dir).to_dict("records")
    missing = [c for c in MEASURED if row[c] is None or (isinstance(row[c], float) and math.isnan(row[c]))]
    assert not missing, f"unfilled measurements: {missing}"
    assert row["world_size"] == 2 and row["strategy"] == STRATEGIES[name]["name"]
    assert row["checkpoint_saves"] == 2 and row["steps_timed"] == 6
    assert 0 < row["mfu"] < 1
    assert [p.name for p in sorted((run_dir / "checkpoints").iterdir())] == ["step-00000004", "step-00000008"]


# 2 ranks follow 1 rank's curve (ddp, fsdp), and gradient accumulation the larger batch (ddp):
# tests/test_fault_tolerance.py, whose 2-rank run serves those tests and the resume of its
# checkpoint by 1 rank


def test_entrypoint_example(tmp_path: Path) -> None:
    site = site_copy(tmp_path)
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), "--wait", "jobs/entrypoint.yaml"))
    curve = losses(run_dir)
    assert len(curve) == 30 and curve[-1] < curve[0] / 2, curve
    (row,) = rows(tmp_path, run_dir).to_dict("records")
    assert row["job_kind"] == "entrypoint"
    assert dict(row["extra"]) == {"examples_seen": 32 * 2 * 30.0}
    assert (run_dir / "checkpoints" / "step-00000030" / "manifest.json").exists()


# a failing rank fails the job (rank 0 ending well after rank 1 failed): tests/test_provenance.py


def test_ctrl_c_at_wait_leaves_the_local_job_running_and_logs_follow_it_to_the_end(tmp_path: Path) -> None:
    """A Ctrl-C at `submit --wait` leaves the job running; `hpcrun logs --follow` started then keeps
    printing while it runs and returns once it has ended, with the job's last line (read after the
    end, not before it). One rank: neither needs more."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.delayed_training import entrypoint_job
    from tests.helpers import ROOT

    site = site_copy(tmp_path)
    steps = 40
    # >= 10 s of training on any CPU (a 0.25 s pause per step): >= 8 s left after the first checkpoint
    rec = recipe(
        tmp_path, "long", job=entrypoint_job(str(ROOT), 0.25), resources={"nodes": 1, "gpus_per_node": 1},
        training={"steps": steps, "lr": 0.003, "micro_batch": 2, "seq_len": 32, "log_interval": 5},
        checkpoint={"interval": 5},
    )
    cli = subprocess.Popen(
        [sys.executable, "-m", "hpcrun.cli", "submit", "--site", str(site), "--wait", str(rec)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        # Ctrl-C's default action, as at a terminal: pytest started in the background by a shell
        # without job control has SIGINT ignored, and Python keeps an inherited SIG_IGN
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    runs = tmp_path / "runs"
    deadline = time.time() + 120
    while time.time() < deadline and not any(runs.glob("*/checkpoints/step-*") if runs.exists() else []):
        time.sleep(0.1)
    os.killpg(cli.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    out, err = cli.communicate(timeout=60)
    assert cli.returncode == 130, out + err
    assert "left the job running; reattach with: hpcrun status" in err
    (run_dir,) = list(runs.iterdir())
    assert status(run_dir) is None, state(run_dir)  # still running: >= 8 s of its steps left
    started = time.time()
    follow = subprocess.run(
        [sys.executable, "-m", "hpcrun.cli", "logs", "--site", str(site), "--follow", run_dir.name],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert follow.returncode == 0, follow.stderr
    assert state(run_dir)["status"] == "completed" and len(losses(run_dir)) == steps  # it returned: the job ended
    lines = follow.stdout.splitlines()
    assert f"step {steps}/{steps}" in " ".join(lines[-3:]), lines[-5:]
    # it followed the job (it ran past the Ctrl-C's moment, to the last step), from the log's start
    assert "step 5/" in follow.stdout and time.time() - started > 1
    once = hpcrun("logs", "--site", str(site), run_dir.name)
    assert once.stdout.startswith(follow.stdout)  # the same log, not lines lost or repeated


OPTIONS = {
    "ddp-powersgd": ({"name": "ddp", "comm_hook": "powersgd"}, "fp32", False),
    "ddp-fp16-hook-static": ({"name": "ddp", "comm_hook": "fp16", "static_graph": True}, "fp32", False),
    "ddp-bf16-actckpt": ({"name": "ddp"}, "bf16-mixed", True),
    "fsdp-hybrid-bf16": ({"name": "fsdp", "sharding": "hybrid"}, "bf16-mixed", False),
    "fsdp-grad_op-post": ({"name": "fsdp", "sharding": "grad_op", "backward_prefetch": "post"}, "fp32", True),
    "fsdp-meta-init": ({"name": "fsdp", "meta_init": True}, "fp32", False),
    "zero2-cpu-offload-bf16": ({"name": "deepspeed", "stage": 2, "offload_optimizer": "cpu"}, "bf16-mixed", False),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_strategy_options_train(name: str, tmp_path: Path) -> None:
    strategy, precision, act_ckpt = OPTIONS[name]
    site = site_copy(tmp_path)
    rec = recipe(
        tmp_path,
        name,
        strategy=strategy,
        precision=precision,
        training={"steps": 6, "lr": 0.003, "activation_checkpointing": act_ckpt},
    )
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), "--wait", str(rec)))
    curve = losses(run_dir)
    assert state(run_dir)["status"] == "completed" and len(curve) == 6
    assert curve[-1] < curve[0] - 0.05 and all(c < 7 for c in curve), curve  # sane init, learning


def test_deepspeed_config_from_a_users_json(tmp_path: Path) -> None:
    import json

    config = tmp_path / "ds.json"
    config.write_text(json.dumps({
        "zero_optimization": {"stage": 1}, "gradient_clipping": 0.5, "zero_force_ds_cpu_optimizer": False,
        "train_micro_batch_size_per_gpu": 99, "steps_per_print": 1000000,
    }))
    site = site_copy(tmp_path)
    rec = recipe(
        tmp_path,
        "userjson",
        strategy={"name": "deepspeed", "config": str(config)},
        training={"steps": 4, "lr": 0.003, "micro_batch": 2},
    )
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), "--wait", str(rec)))
    assert state(run_dir)["status"] == "completed"
    used = json.loads((run_dir / "deepspeed-config.json").read_text())
    assert used["zero_optimization"] == {"stage": 1} and used["gradient_clipping"] == 0.5  # the user's
    assert used["train_micro_batch_size_per_gpu"] == 2 and used["train_batch_size"] == 4  # the recipe's batch wins
