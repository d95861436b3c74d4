"""A sweep's ledger on disk: point -> run -> job. Every read-decide-submit-record cycle holds a
file lock, so a cron run and a manual run on the login node never submit a point twice. A point
is `submitting` (with its array's tag and the time) from before sbatch runs until its job is
recorded: one left so was sent without a recorded answer, and is looked up (hpcrun.campaign).

A ledger that exists but cannot be read is refused (CorruptStateError, one line, exit 2):
reading it as empty would submit every point again."""

from __future__ import annotations

import contextlib
import typing as tp
from pathlib import Path

from hpcrun.rundir import LEDGER, CorruptStateError, lock, read_json, write_json


class Ledger:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LEDGER
        self.points: dict[str, dict[str, tp.Any]] = {}

    @classmethod
    @contextlib.contextmanager
    def locked(cls, directory: Path) -> tp.Iterator[Ledger]:
        """The ledger, read under the lock; `save` it before leaving the block."""
        directory.mkdir(parents=True, exist_ok=True)
        with lock(directory / LEDGER):
            ledger = cls(directory)
            ledger.points = cls.read(directory)
            yield ledger

    @staticmethod
    def read(directory: Path) -> dict[str, dict[str, tp.Any]]:
        """The points recorded so far; {} only when there is no ledger yet."""
        path = directory / LEDGER
        data = read_json(path, {"points": {}})
        points = data.get("points") if isinstance(data, dict) else None
        if not isinstance(points, dict) or not all(isinstance(entry, dict) for entry in points.values()):
            raise CorruptStateError(path, "not a ledger: expected {\"points\": {point id: {...}}}")
        return dict(points)

    def record(self, point_id: str, **fields: tp.Any) -> None:
        self.points[point_id] = {**self.points.get(point_id, {}), **fields}

    def save(self) -> None:
        write_json(self.path, {"points": self.points})
