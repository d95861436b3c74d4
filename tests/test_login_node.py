"""Login-node discipline: the submit/render/status path never imports torch or deepspeed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT

PROBE = """
import sys
from hpcrun.cli import main
try:
    main({args!r}, standalone_mode=False)
finally:
    heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed'))
    print('HEAVY=' + ','.join(heavy))
"""


@pytest.mark.parametrize(
    "args",
    [
        ["render", "--site", "mycluster", "jobs/quickstart.yaml"],
        ["render", "--site", "local", "jobs/zero-infinity.yaml"],
        [
            "validate",
            "--site",
            "testcluster",
            "jobs/quickstart.yaml",
            "jobs/gpt-strategies.yaml",
            "sites/mycluster.yaml",
        ],
        ["sites"],
        ["submit", "--dry-run", "--site", "testcluster", "jobs/quickstart.yaml"],
        ["status"],
    ],
    ids=lambda a: " ".join(a[:2]),
)
def test_no_torch_import(args: list[str]) -> None:
    out = subprocess.run([sys.executable, "-c", PROBE.format(args=args)], capture_output=True, text=True, cwd=ROOT)
    assert "HEAVY=" in out.stdout, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "HEAVY=", out.stdout + out.stderr


def test_probe_detects_torch() -> None:
    """The probe itself: importing the runtime does pull torch in, so the test above can fail."""
    code = "import sys, hpcrun.runtime.trainer; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "True", out.stderr
