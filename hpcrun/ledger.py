"""A sweep's ledger on disk: point -> run -> job. Every read-decide-submit-record cycle holds a
file lock, so a cron run and a manual run on the login node never submit a point twice."""

from __future__ import annotations

import contextlib
import json
import os
import typing as tp
from pathlib import Path

from filelock import FileLock

LEDGER = "ledger.json"


class Ledger:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LEDGER
        self.points: dict[str, dict[str, tp.Any]] = {}

    @classmethod
    @contextlib.contextmanager
    def locked(cls, directory: Path) -> tp.Iterator["Ledger"]:
        """The ledger, read under the lock; `save` it before leaving the block."""
        directory.mkdir(parents=True, exist_ok=True)
        with FileLock(str(directory / ".ledger.lock")):
            ledger = cls(directory)
            ledger.points = cls.read(directory)
            yield ledger

    @staticmethod
    def read(directory: Path) -> dict[str, dict[str, tp.Any]]:
        try:
            return dict(json.loads((directory / LEDGER).read_text())["points"])
        except (OSError, ValueError, KeyError):
            return {}

    def record(self, point_id: str, **fields: tp.Any) -> None:
        self.points[point_id] = {**self.points.get(point_id, {}), **fields}

    def save(self) -> None:
        tmp = self.path.with_name(f".{LEDGER}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"points": self.points}, indent=1, sort_keys=True))
        tmp.replace(self.path)
