"""SLURM's tools for a container's ranks: hpcrun.slurm.run, finding a tool missing, asks the batch
script, which runs it beside SLURM's clients (templates/sbatch.sh.j2). Here the rendered script's
own loop serves a client whose PATH has every SLURM tool shadowed (tests/cluster/noslurm)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT, cli, load_yaml, write_yaml

CLIENT = """
import sys
from hpcrun import slurm
from hpcrun.errors import HpcrunError
for cmd in (["sacct", "--version"], ["srun", "--version"]):
    try:
        out = slurm.run(cmd, timeout=20)
        print(cmd[0], out.returncode, out.stdout.strip())
    except HpcrunError as exc:
        print(cmd[0], "error", exc.format_message())
"""


def tool_loop(tmp: Path) -> str:
    """The rendered script's loop for a container site, from its comment to its pid's line."""
    recipe = write_yaml(tmp / "r.yaml", load_yaml(ROOT / "jobs" / "quickstart.yaml"))
    out = cli("render", "--site", "slingshot", str(recipe))
    assert out.exit_code == 0, out.output
    script = out.stdout
    start, end = script.index("# SLURM's tools for the ranks"), script.index("slurm_tools=$!")
    return script[start:end] + "slurm_tools=$!\n"


def test_a_tool_missing_in_the_container_is_run_by_the_batch_script(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    loop = tool_loop(tmp_path)
    shell = subprocess.Popen(
        ["bash", "-c", f'set -eo pipefail\n{loop}\necho "$HPCRUN_SLURM_PROXY"\nwait'],
        env={**os.environ, "run_dir": str(run_dir), "SLURM_JOB_ID": "42"}, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert shell.stdout is not None
        proxy = shell.stdout.readline().strip()
        assert proxy == str(run_dir / ".slurm-tools" / "42"), proxy
        noslurm = ROOT / "tests" / "cluster" / "noslurm" / "bin"
        env = {**os.environ, "PATH": f"{noslurm}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
               "HPCRUN_SLURM_PROXY": proxy}
        here = subprocess.run([sys.executable, "-c", CLIENT], env=env, capture_output=True, text=True, timeout=60)
        assert here.returncode == 0, here.stderr
        found = {line.split()[0]: line for line in here.stdout.splitlines()}
        version = subprocess.run(["sacct", "--version"], capture_output=True, text=True, check=True).stdout.strip()
        assert found["sacct"] == f"sacct 0 {version}", here.stdout  # run by the loop, outside the shadowed PATH
        assert found["srun"].startswith("srun error srun was not found"), here.stdout  # not a tool the loop runs
        without = subprocess.run(
            [sys.executable, "-c", CLIENT], env={**env, "HPCRUN_SLURM_PROXY": ""}, capture_output=True, text=True,
            timeout=60,
        )
        assert without.returncode == 0 and "sacct error sacct was not found" in without.stdout, without.stdout
        assert not [p.name for p in Path(proxy).iterdir()], "requests or answers left behind"
    finally:
        shell.kill()
        shell.wait()
