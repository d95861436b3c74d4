"""A benchmark's scratch directory, removed when the script exits however it exits (the
checkpoint benchmark alone writes ~6 GB per run), and shipped sites pointed into it."""

from __future__ import annotations

import atexit
import shutil
import tempfile
import typing as tp
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def scratch(prefix: str, parent: str | None = None) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def scratch_site(tmp: Path, base: str, **changes: tp.Any) -> Path:
    """`sites/<base>.yaml` with runs and results under `tmp` (and top-level `changes`), as
    `tmp/site.yaml`: a benchmark's runs never mix with a user's."""
    site = yaml.safe_load((ROOT / "sites" / f"{base}.yaml").read_text())
    site["storage"] = {"runs_dir": str(tmp / "runs"), "results_dir": str(tmp / "results")}
    site.update(changes)
    path = tmp / "site.yaml"
    path.write_text(yaml.safe_dump(site))
    return path
