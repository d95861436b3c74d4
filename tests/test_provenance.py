"""Provenance taken once on the login node (hpcrun.provenance): the run's git commit is in its
RunSpec, bounded by a timeout; nothing in the allocation runs git, so a machine without git
records the same attempt with an empty git_sha."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import typing as tp
from pathlib import Path

from hpcrun.plan import RunSpec, plan
from hpcrun.recipe import load_recipe
from hpcrun.site import load_site
from tests.runs import hpcrun, recipe, rows, run_dir_of, site_copy, state

# rank 1 fails; rank 0 ends well after it: the job fails (exit 1), naming rank 1's status
SCRIPT = "import os,sys,time; r=os.environ['RANK']; time.sleep(2 if r=='0' else 0); sys.exit(3 if r=='1' else 0)"
COMMAND = {"kind": "command", "command": ["python", "-c", SCRIPT]}


def no_git_path(tmp_path: Path) -> str:
    """This PATH's programs (the first of each name, as the shell finds them) but git."""
    bin_dir = tmp_path / "bin-without-git"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    for folder in os.environ["PATH"].split(os.pathsep):
        for program in Path(folder).glob("*") if Path(folder).is_dir() else ():
            link = bin_dir / program.name
            if not program.name.startswith("git") and not link.exists() and os.access(program, os.X_OK):
                link.symlink_to(program)
    return str(bin_dir)


def test_the_plan_holds_the_commit_of_the_recipes_checkout(tmp_path: Path) -> None:
    checkout = tmp_path / "code"
    checkout.mkdir()
    path = recipe(checkout, "mine", job=COMMAND)
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    sha = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    site = load_site(str(site_copy(tmp_path)))
    spec = plan(site, load_recipe(path).base, path, "r1")
    assert spec.git_sha == sha
    outside = recipe(tmp_path, "loose", job=COMMAND)  # not a checkout
    assert plan(site, load_recipe(outside).base, outside, "r2").git_sha is None


def test_a_runspec_written_before_git_sha_still_loads(tmp_path: Path) -> None:
    """Runs on disk from before the field was added are requeued after an upgrade."""
    path = recipe(tmp_path, "old", job=COMMAND)
    spec = plan(load_site(str(site_copy(tmp_path))), load_recipe(path).base, path, "r1")
    old = json.loads(spec.model_dump_json())
    del old["git_sha"]
    assert RunSpec.model_validate_json(json.dumps(old)).git_sha is None


def test_a_machine_without_git_records_the_same_failed_attempt(tmp_path: Path) -> None:
    """With no git on PATH the job's failure is recorded as it is (rank 1's exit status), not
    hidden behind git's absence; only git_sha is empty."""
    site = site_copy(tmp_path)
    rec = recipe(tmp_path, "broken", job=COMMAND)
    env = {**os.environ, "PATH": no_git_path(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "hpcrun.cli", "submit", "--site", str(site), "--wait", str(rec)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    run_dir = run_dir_of(out)
    assert "exited with status 3 on rank 1" in state(run_dir)["reason"], state(run_dir)
    recorded = rows(tmp_path, run_dir).to_dict("records")
    assert any(r["status"] == "failed" and "exited with status 3 on rank 1" in r["reason"] for r in recorded), recorded
    assert all(r["git_sha"] is None for r in recorded), recorded
    # with git: also the failing rank's test (tests/test_runtime.py's, which ran this job once more)
    again = hpcrun("submit", "--site", str(site), "--wait", str(rec), check=False)
    assert again.returncode == 1, again.stdout + again.stderr
    with_git = run_dir_of(again)
    assert "exited with status 3 on rank 1" in state(with_git)["reason"], state(with_git)
    same = rows(tmp_path, with_git).to_dict("records")

    def failed(table: list[dict[str, tp.Any]]) -> list[tuple[tp.Any, ...]]:
        keys = ("reason", "first_step", "last_step", "job_kind", "world_size")
        return sorted(tuple(r[k] for k in keys) for r in table if r["status"] == "failed")

    assert failed(same) == failed(recorded)
