"""A benchmark's scratch directory, removed when the script exits however it exits (the
checkpoint benchmark alone writes ~6 GB per run)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path


def scratch(prefix: str, parent: str | None = None) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
