"""SLURM's tools for a container's ranks: hpcrun.slurm.run, finding a tool missing, asks the batch
script, which runs it beside SLURM's clients (templates/sbatch.sh.j2). Here the rendered script's
own loop serves a client whose PATH has every SLURM tool shadowed (tests/cluster/noslurm), with a
stand-in `sacct` on the loop's PATH (no SLURM needed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import ROOT, cli, load_yaml, write_yaml

CLIENT = """
from hpcrun import slurm
for cmd in (["sacct", "--version", "two words"], ["sbatch", "--version"]):
    out = slurm.run(cmd, timeout=20)
    print(cmd[0], out.returncode, repr(out.stdout.strip()))
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
    run_dir, host = tmp_path / "run", tmp_path / "host"
    run_dir.mkdir()
    host.mkdir()
    stale = run_dir / ".slurm-tools" / "42-0"  # a start the requeue's SIGKILL left behind: its EXIT trap never ran
    stale.mkdir(parents=True)
    (stale / "old.rc").write_text("0\n")
    (host / "sacct").write_text('#!/bin/sh\nprintf "host sacct:"; printf " [%s]" "$@"; echo\n')
    (host / "sacct").chmod(0o755)
    shell = subprocess.Popen(
        ["bash", "-c", f'set -eo pipefail\n{tool_loop(tmp_path)}\necho "$HPCRUN_SLURM_PROXY"\nwait'],
        env={**os.environ, "run_dir": str(run_dir), "SLURM_JOB_ID": "42", "PATH": f"{host}:{os.environ['PATH']}"},
        stdout=subprocess.PIPE, text=True, start_new_session=True,  # the loop is its own subshell: killed as a group
    )
    try:
        assert shell.stdout is not None
        proxy = Path(shell.stdout.readline().strip())
        assert proxy == run_dir / ".slurm-tools" / "42-0", proxy
        assert proxy.stat().st_mode & 0o777 == 0o700, oct(proxy.stat().st_mode)  # no one else's requests
        noslurm = ROOT / "tests" / "cluster" / "noslurm" / "bin"
        env = {**os.environ, "PATH": f"{noslurm}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
               "HPCRUN_SLURM_PROXY": str(proxy)}
        here = subprocess.run([sys.executable, "-c", CLIENT], env=env, capture_output=True, text=True, timeout=60)
        assert here.returncode == 0, here.stderr
        found = {line.split()[0]: line for line in here.stdout.splitlines()}
        # run by the loop with the host's PATH, every word as sent; sbatch is not a tool the client sends it
        assert found["sacct"] == "sacct 0 'host sacct: [--version] [two words]'", here.stdout
        assert found["sbatch"] == "sbatch 127 ''", here.stdout
        without = subprocess.run(
            [sys.executable, "-c", CLIENT], env={**env, "HPCRUN_SLURM_PROXY": ""}, capture_output=True, text=True,
            timeout=60,
        )
        assert "sacct 127 ''" in without.stdout, without.stdout
        # a request for anything else, written by hand, is refused by the loop itself
        (proxy / "raw.part").write_bytes(b"sh\0-c\0touch pwned\0")
        os.replace(proxy / "raw.part", proxy / "raw.req")
        deadline = time.time() + 30
        while time.time() < deadline and not (proxy / "raw.rc").exists():
            time.sleep(0.1)
        assert (proxy / "raw.rc").read_text().strip() == "126", (proxy / "raw.err").read_text()
        assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()
        left = sorted(p.name for p in proxy.iterdir())
        assert left == ["raw.err", "raw.out", "raw.rc"], f"requests or answers left behind: {left}"
    finally:
        os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()
