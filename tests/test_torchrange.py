"""The supported torch range (hpcrun.torchrange): where a version stands, setup.cfg agreeing with
it, and a rank refusing a torch below it with one line and no traceback."""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrun import torchrange
from tests.helpers import ROOT


@pytest.mark.parametrize(
    ("version", "status"),
    [
        ("2.11.0+cu130", torchrange.OK),
        ("2.12.1", torchrange.OK),
        ("2.13.0+cpu", torchrange.OK),
        ("2.14.0a0+git1234abc", torchrange.NEWER),
        ("3.0.0", torchrange.NEWER),
        ("2.10.2+cu126", torchrange.REFUSED),
        ("2.9.0.dev20250801+cpu", torchrange.REFUSED),
        ("1.13.1", torchrange.REFUSED),
        ("unknown", torchrange.REFUSED),
    ],
)
def test_verdict_names_the_version_and_the_range(version: str, status: str) -> None:
    found = torchrange.verdict(version)
    assert found.status == status
    assert version in found.message and torchrange.SUPPORTED in found.message and "\n" not in found.message
    assert found.message.startswith(torchrange.REFUSED_PREFIX) == (status == torchrange.REFUSED)


def test_setup_cfg_asks_for_the_supported_torch() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = cfg["options.extras_require"]
    asked = {name: line for name in extras for line in extras[name].split() if line.startswith("torch")}
    assert asked and set(asked.values()) == {torchrange.REQUIREMENT}, asked


def older_torch(tmp: Path, version: str = "2.10.0+cu126") -> dict[str, str]:
    """An environment whose processes import a stand-in `torch` package that only says it is
    `version`: what a rank started on a cluster with that torch sees first."""
    fake = tmp / "older-torch" / "torch"
    fake.mkdir(parents=True, exist_ok=True)
    (fake / "__init__.py").write_text(f"__version__ = {version!r}\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), str(ROOT)])}


def test_a_rank_refuses_an_older_torch(tmp_path: Path) -> None:
    """A rank's real entry point, under a stand-in torch package that says it is 2.10: the rank
    exits with status 2 and one line before reading its run directory or importing the runtime
    (which a torch that old could fail to import, with a traceback)."""
    env = older_torch(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "hpcrun.launch", str(tmp_path / "run")], capture_output=True, text=True, env=env,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [torchrange.verdict("2.10.0+cu126").message], out.stderr
    assert "2.10.0+cu126" in out.stderr and "2.11 to 2.13" in out.stderr
