"""A stop signal to the batch shell itself (`scancel --signal=USR2 --batch` or `--full`, a site's
`--signal=B:USR2@N`, a wrapper) is passed to the ranks' step and the shell keeps waiting for it:
bash's default action for USR2 and TERM would end the script and the job as FAILED. The rendered
script runs here with SLURM's tools stubbed at the process boundary (the cluster test of the
same is tests/test_cluster_requeue.py)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import cli
from tests.runs import site_copy

# The ranks' step: says it started, runs until the stop reaches it (the stub scancel leaves a
# file), then exits 7 with srun's message for a failed task, so the failure step must follow.
SRUN = """#!/bin/bash
trap '' USR2 TERM  # a real srun handles these itself (it forwards them), it does not die of them
case " $* " in
  *" -m hpcrun.runtime.failure "*) echo "failure step: ${@: -1}" >>"$FAKE_DIR/log"; exit 0 ;;
esac
touch "$FAKE_DIR/started"
for _ in $(seq 300); do [ -e "$FAKE_DIR/stopped" ] && break; sleep 0.1; done
echo "srun: error: node1: task 0: Exited with exit code 7" >&2
exit 7
"""
SCANCEL = """#!/bin/bash
echo "scancel $*" >>"$FAKE_DIR/log"; touch "$FAKE_DIR/stopped"
"""


def stub(bindir: Path, name: str, text: str) -> None:
    path = bindir / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("sig", [signal.SIGUSR2, signal.SIGTERM], ids=["USR2", "TERM"])
@pytest.mark.parametrize("whole", [False, True], ids=["shell", "every-process"])
@pytest.mark.parametrize("array", [False, True], ids=["job", "array-task"])
def test_a_stop_signal_to_the_batch_shell_reaches_the_step(
    sig: signal.Signals, whole: bool, array: bool, tmp_path: Path
) -> None:
    """`whole`: the signal reaches every process of the batch step, as `scancel --full` sends it
    (the stub srun, like a real one, lives on: the script's own subshell and tee must too).
    `array`: the job is task 3 of array 120, and only that task is signalled, not the sweep."""
    site = site_copy(tmp_path, "testcluster")
    # a run id of its own: the cases run at once under xdist, and the run directory is the site's
    script = cli("render", "--site", str(site), "--run-id", f"r-sig-{tmp_path.name}", "jobs/quickstart.yaml").stdout
    assert script.startswith("#!/bin/bash"), script
    (tmp_path / "job.sh").write_text(script)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    stub(bindir, "srun", SRUN)
    stub(bindir, "scancel", SCANCEL)
    stub(bindir, "scontrol", "#!/bin/sh\necho node1\n")
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "FAKE_DIR": str(tmp_path), "HOME": str(tmp_path),
           "SLURM_JOB_ID": "123", "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_NUM_NODES": "1", "SLURMD_NODENAME": "node1",
           **({"SLURM_ARRAY_JOB_ID": "120", "SLURM_ARRAY_TASK_ID": "3"} if array else {})}
    shell = subprocess.Popen(["bash", str(tmp_path / "job.sh")], env=env, cwd=tmp_path, start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "started").exists() and time.monotonic() < deadline and shell.poll() is None:
        time.sleep(0.05)
    assert (tmp_path / "started").exists(), shell.communicate()
    if whole:
        os.killpg(shell.pid, sig)
    else:
        os.kill(shell.pid, sig)  # the batch shell alone, as `scancel --batch` signals it
    _, err = shell.communicate(timeout=30)
    # the shell lived on: the step got the stop (steps only: no --batch, no --full), ended, and
    # the script went on to its failure step and ended with the step's status
    assert shell.returncode == 7, (shell.returncode, err)
    log = (tmp_path / "log").read_text().splitlines()
    target = "120_3" if array else "123"
    passed = f"scancel -Q --state=RUNNING --signal={sig.name.removeprefix('SIG')} {target}"  # of a running job only
    assert log == [passed, "failure step: 7"], f"{log}\n{err}"
