"""Golden files of rendered scripts for every shipped site x a few recipes.

Regenerate after an intended template change with:
    HPCRUN_REGEN_GOLDEN=1 python -m pytest tests/test_render_golden.py
and review the diff of tests/golden/.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, cli

SITES = ["local", "mycluster", "aws-efa", "slingshot", "testcluster"]
RECIPES = ["quickstart", "zero-infinity", "staged", "torchrun"]
GOLDEN = ROOT / "tests" / "golden"
RUN_ID = "20260101-000000-0000-golden"


@pytest.fixture(autouse=True)
def _stable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Machine-specific inputs pinned: the interpreter, the user and home in expanded paths."""
    monkeypatch.setattr(sys, "executable", "/usr/bin/python3")
    monkeypatch.setenv("USER", "golden")
    monkeypatch.setenv("HOME", "/home/golden")


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_golden(site: str, recipe: str) -> None:
    result = cli("render", "--site", site, "--run-id", RUN_ID, f"jobs/{recipe}.yaml")
    golden = GOLDEN / f"{site}__{recipe}.sh"
    if site == "slingshot" and recipe == "zero-infinity":
        assert result.exit_code == 2, result.output
        assert "storage.nvme" in result.output and "strategy.offload_" in result.output
        return
    assert result.exit_code == 0, result.output
    if os.environ.get("HPCRUN_REGEN_GOLDEN"):
        golden.write_text(result.stdout)
    assert golden.exists(), f"no golden file {golden.name}; regenerate with HPCRUN_REGEN_GOLDEN=1"
    assert result.stdout == golden.read_text()
    subprocess.run(["bash", "-n"], input=result.stdout, text=True, check=True)


def test_golden_directory_has_no_orphans() -> None:
    expected = {f"{s}__{r}.sh" for s in SITES for r in RECIPES} - {"slingshot__zero-infinity.sh"}
    assert {p.name for p in GOLDEN.glob("*.sh")} == expected
