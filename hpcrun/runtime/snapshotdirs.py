"""The rank directories one process writes snapshots into on its node (hpcrun.runtime.snapshot):
`<local_scratch>/hpcrun-<SLURM_JOB_ID>-<SLURM_RESTART_COUNT>/<run id>/<node>/rank-NNNNN/step-N/`
(`<node>`: SLURMD_NODENAME, so nodes stay apart even where the scratch is shared). Each is claimed
(its owner file share-locked) before anything lands there; once a step is held twice the older
ones are pruned; `close` ends all writing: a write racing with it creates no directory."""

from __future__ import annotations

import fcntl
import os
import shutil
import threading
from pathlib import Path

import torch

from hpcrun import rundir
from hpcrun.runtime.snapshotfiles import allocated, verify
from hpcrun.runtime.snapshotsweep import OWNER, remove_empty, remove_partial_steps

CLOSED = "abandoned: the snapshots were closed"


class RankDirs:
    """The rank directories of run `run_id` this process holds in `job_dir` on node `host`."""

    def __init__(self, job_dir: Path, run_id: str, host: str) -> None:
        self.job_dir, self.run_id, self.host = job_dir, run_id, host
        self._held: set[int] = set()  # the rank directories this process has written (`claim`)
        self._owners: dict[int, int] = {}  # their owner files' descriptors, share-locked until `close`
        # `closed` and what creates or removes directories, under one lock: once `close` has removed
        # them, a write racing with it (the background thread's) creates none again
        self._lock = threading.Lock()
        self.closed = False

    def rank_dir(self, rank: int) -> Path:
        return rundir.snapshot_rank_dir(self.job_dir, self.run_id, self.host, rank)

    def claim(self, rank: int) -> bool:
        """Hold `rank`'s directory as one this process writes (its owner file share-locked, made
        before anything lands there) and remove the partial steps there that no other live process
        writes; False once closed: nothing may be written then."""
        with self._lock:
            if self.closed:
                return False
            if rank not in self._owners:
                self.rank_dir(rank).mkdir(parents=True, exist_ok=True)
                self._owners[rank] = os.open(self.rank_dir(rank) / OWNER, os.O_RDONLY | os.O_CREAT, 0o600)
                self._held.add(rank)  # close removes what it holds
            self._remove_partial_steps(rank)
            return True

    def _remove_partial_steps(self, rank: int) -> None:
        """The partial steps in `rank`'s directory, unless another live process holds it too (a
        killed attempt's process not yet gone): with the owner file's lock exclusive for a moment."""
        fd = self._owners[rank]
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass
        else:
            remove_partial_steps(self.rank_dir(rank))
        finally:
            fcntl.flock(fd, fcntl.LOCK_SH)  # a conversion that failed dropped the lock: taken again

    def new_dir(self, path: Path) -> bool:
        """`path` made empty, unless closed (False)."""
        with self._lock:
            if self.closed:
                return False
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
            return True

    def allocated(self, path: Path, size: int) -> torch.Tensor | None:
        """hpcrun.runtime.snapshotfiles' `allocated`, unless closed (None)."""
        with self._lock:
            return None if self.closed else allocated(path, size)

    def settle(self, tmp: Path, final: Path) -> str | None:
        """A received copy verified against its manifest and renamed into place, or removed;
        returns why it was refused, or None."""
        why = verify(tmp)
        with self._lock:
            why = CLOSED if self.closed else why
            if why is None:
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
        return why

    def prune(self, step: int) -> None:
        """Every step older than `step` and every partial step of the directories held: once every
        rank holds `step` twice, older ones are of no more use."""
        with self._lock:
            if self.closed:
                return
            for rank in self._owners:
                for old, old_path in rundir.step_dirs(self.rank_dir(rank)).items():
                    if old < step:
                        shutil.rmtree(old_path, ignore_errors=True)
                self._remove_partial_steps(rank)

    def close(self) -> None:
        """From here on no directory is made (`claim`, `new_dir`, `allocated`)."""
        with self._lock:
            self.closed = True

    def remove(self) -> None:
        """The directories held and, once empty, the run's and the job's on this node."""
        with self._lock:
            for rank in self._held:
                shutil.rmtree(self.rank_dir(rank), ignore_errors=True)
            for fd in self._owners.values():
                os.close(fd)
            self._owners.clear()
            remove_empty(self.job_dir / self.run_id / self.host, self.job_dir / self.run_id, self.job_dir)
