"""Frictions a new user hit (issue 27), each checked the way that user met it: a recipe naming a
module that does not exist, the log of a rank the run does not have, and cancelling a run that
had already ended."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.helpers import cli, write_yaml


def entrypoint_recipe(tmp_path: Path, entrypoint: str, pythonpath: list[str]) -> Path:
    job = {"kind": "entrypoint", "entrypoint": entrypoint, "pythonpath": pythonpath}
    return write_yaml(
        tmp_path / "recipe.yaml", {"name": "frictions", "job": job, "resources": {"nodes": 1, "gpus_per_node": 2}}
    )


def test_validate_looks_the_entrypoint_module_up(tmp_path: Path) -> None:
    missing = entrypoint_recipe(tmp_path, "no_such_module_here.train:main", [])
    out = cli("validate", "--site", "local", str(missing))
    assert out.exit_code == 2, out.output
    assert f"{missing}: job.entrypoint: module 'no_such_module_here.train' not found" in out.output
    assert "Traceback" not in out.output
    # found through the recipe's pythonpath (relative to the recipe), as the job will find it, and never imported
    (tmp_path / "code" / "mine").mkdir(parents=True)
    (tmp_path / "code" / "mine" / "__init__.py").write_text("")
    (tmp_path / "code" / "mine" / "train.py").write_text("raise SystemExit('imported')\n")
    found = entrypoint_recipe(tmp_path, "mine.train:main", ["code"])
    ok = cli("validate", "--site", "local", str(found))
    assert ok.exit_code == 0 and ok.output.startswith("ok "), ok.output
    # a module of the submitting directory (tests/ in this repository) and an installed one
    assert (
        cli(
            "validate", "--site", "local", str(entrypoint_recipe(tmp_path, "tests.delayed_training:train", []))
        ).exit_code
        == 0
    )
    assert cli("validate", "--site", "local", str(entrypoint_recipe(tmp_path, "json.decoder:x", []))).exit_code == 0
    # a submodule of a plain module does not exist
    assert (
        cli("validate", "--site", "local", str(entrypoint_recipe(tmp_path, "tests.helpers.nothing:x", []))).exit_code
        == 2
    )


def ended_local_run(tmp_path: Path, status: str) -> Path:
    """A local 2-rank run whose controller (a process that has exited) left state.json saying `status`."""
    from hpcrun.plan import plan
    from hpcrun.recipe import load_recipe
    from hpcrun.site import load_site

    recipe = write_yaml(tmp_path / "recipe.yaml", {"name": "frictions", "resources": {"nodes": 1, "gpus_per_node": 2}})
    spec = plan(load_site("local"), load_recipe(recipe).base, recipe, "frictions-20261125-000000-abcd")
    controller = subprocess.Popen(["true"])
    assert controller.wait() == 0
    run_dir = tmp_path / spec.run_id
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "runspec.json").write_text(spec.model_dump_json())
    (run_dir / "jobs.json").write_text(
        json.dumps([{"job_id": str(controller.pid), "scheduler": "local", "submitted": 1.0}])
    )
    (run_dir / "state.json").write_text(
        json.dumps({"status": status, "job_id": str(controller.pid), "attempt": 0})
    )
    for rank in range(2):
        (run_dir / "logs" / f"{controller.pid}_{rank}_log.out").write_text(f"rank {rank} trained\n")
    return run_dir


def test_logs_of_a_rank_the_run_does_not_have(tmp_path: Path) -> None:
    run_dir = ended_local_run(tmp_path, "completed")
    assert cli("logs", str(run_dir), "--rank", "1").output == "rank 1 trained\n"
    out = cli("logs", str(run_dir), "--rank", "7")
    assert out.exit_code == 2, out.output
    assert "--rank: the run has ranks 0-1, so no log for --rank 7" in out.output


def test_cancelling_a_run_that_has_ended_cancels_nothing(tmp_path: Path) -> None:
    run_dir = ended_local_run(tmp_path, "completed")
    out = cli("cancel", str(run_dir))
    assert out.exit_code == 2, out.output
    assert f"{run_dir.name} had already ended (COMPLETED, job " in out.output and "cancelled " not in out.output
