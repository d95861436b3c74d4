"""`hpcrun plan` beside what the site's own results measured: a real local run's row."""

from __future__ import annotations

import re
from pathlib import Path

from hpcrun.memory import estimate
from hpcrun.plan import plan
from hpcrun.recipe import load_recipe
from hpcrun.site import load_site
from tests.runs import hpcrun, recipe, rows, run_dir_of, site_copy


def test_plan_shows_the_measured_peak_of_a_run_of_the_same_shape(tmp_path: Path) -> None:
    site = site_copy(tmp_path)
    fields = {
        "resources": {"nodes": 1, "gpus_per_node": 1, "time": "00:10:00"},
        "training": {"steps": 3, "warmup_steps": 1, "micro_batch": 2, "seq_len": 32},
        "checkpoint": {"interval": 1000, "memory_interval": 0},
    }
    path = recipe(tmp_path, "measured", **fields)
    before = hpcrun("plan", "--site", str(site), str(path)).stdout
    assert "measured GB" not in before, before

    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), "--wait", str(path)))
    [row] = rows(tmp_path, run_dir).to_dict("records")
    assert row["plan_option"] == "ddp" and row["activation_checkpointing"] == 0
    out = hpcrun("plan", "--site", str(site), str(path)).stdout
    [line] = [line for line in out.splitlines() if line.startswith("ddp ")]
    measured, off = re.split(r"\s+", line)[2:4]
    assert float(measured) == round(row["peak_memory_bytes"] / 1e9, 1)
    spec = plan(load_site(str(site)), load_recipe(path).base, path, "check")
    [ddp] = [e for e in estimate(spec) if e.option.name == "ddp"]
    # on CPU the peak is the rank's resident set, interpreter and torch included: far above the tensors
    assert off == f"{ddp.gpu_gb * 1e9 / row['peak_memory_bytes'] - 1:+.0%}"
    assert "measured: the largest peak_memory_bytes" in out

    other = recipe(tmp_path, "other-shape", **{**fields, "training": {**fields["training"], "micro_batch": 3}})
    assert "measured GB" not in hpcrun("plan", "--site", str(site), str(other)).stdout
