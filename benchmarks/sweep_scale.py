"""Sweep scale: plan and render a 1,000-point sweep; count sbatch calls for it (one per array
chunk, not per point) with sbatch faked at the process boundary; and sacct calls per status
poll of all 1,000 runs (one).

    python benchmarks/sweep_scale.py
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import yaml
from scratch import scratch, scratch_site  # benchmarks/scratch.py


def tool(bindir: Path, name: str, body: str) -> None:
    path = bindir / name
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def main() -> None:
    tmp = scratch("sweep-scale-")
    bindir = tmp / "bin"
    bindir.mkdir()
    log = tmp / "calls"
    tool(bindir, "sbatch", f'echo sbatch >>{log}; echo $((RANDOM + 1000))')
    tool(bindir, "sacct", f'echo sacct >>{log}')
    tool(bindir, "srun", "exit 0")
    tool(bindir, "scontrol", 'echo "MaxArraySize = 1001"')
    tool(bindir, "sacctmgr", "exit 0")
    tool(bindir, "squeue", "exit 0")
    os.environ["PATH"] = f"{bindir}:{os.environ['PATH']}"
    scratch_site(tmp, "mycluster")
    recipe = {
        "name": "scale",
        "job": {"kind": "benchmark", "model": "tiny"},
        "resources": {"gpus_per_node": 8, "time": "01:00:00"},
        "sweep": {
            "axes": {
                "strategy": [
                    "ddp",
                    {"name": "fsdp"},
                    {"name": "deepspeed", "stage": 2},
                    {"name": "deepspeed", "stage": 3},
                ],
                "resources.nodes": [1, 2, 4, 8, 16],
                "training.micro_batch": [1, 2, 4, 8, 16],
                "training.seed": list(range(10)),
            },
            "max_concurrent": 50,
        },
    }
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe))

    from hpcrun.plan import runs_of
    from hpcrun.recipe import load_recipe
    from hpcrun.render import render
    from hpcrun.site import load_site

    start = time.perf_counter()
    s, rf = load_site(str(tmp / "site.yaml")), load_recipe(tmp / "recipe.yaml")
    specs = runs_of(s, rf, "bench")
    scripts = [render(spec) for spec in specs]
    plan_render = time.perf_counter() - start
    print(f"plan + render {len(specs)} points: {plan_render:.2f} s (target < 2 s: {plan_render / 2:.2f} of the budget)")
    assert len(scripts) == 1000

    from hpcrun.campaign import schedule

    start = time.perf_counter()
    out = schedule(s, rf)
    submit_time = time.perf_counter() - start
    sbatch_calls = log.read_text().count("sbatch")
    print(
        f"hpcrun sweep: {len(out.submitted)} points in {sbatch_calls} sbatch calls ({len(out.arrays)} arrays), "
        f"{submit_time:.1f} s"
    )

    from hpcrun.status import statuses

    log.write_text("")
    os.environ["HPCRUN_CACHE_DIR"] = str(scratch("pollcache-"))  # a cold poll: no answer shared yet (hpcrun.pollcache)
    run_dirs = sorted(p for p in (tmp / "runs").iterdir() if (p / "runspec.json").exists())
    start = time.perf_counter()
    statuses(run_dirs)
    poll = time.perf_counter() - start
    print(f"status poll of {len(run_dirs)} runs: {log.read_text().count('sacct')} sacct call(s), {poll:.2f} s")


if __name__ == "__main__":
    main()
