"""In-memory snapshots replicated to another node, for a restart inside the job: `Snapshots`, what
the training loop (hpcrun.runtime.context) uses, over the modules that do each part of the job.

When its cadence says (hpcrun.runtime.cadence) each rank writes its whole training state (what a disk
checkpoint holds: the engine's DCP state, saved with no collective so that the rank's directory
holds all it loads, and the trainer state: step, losses, RNG streams) into node-local scratch, a
tmpfs that outlives the training processes (hpcrun.runtime.snapshotdirs); where every rank's engine
state is the same (DDP) only each node's first rank writes it, and the node's other ranks load that
copy. On the training thread a snapshot is only a copy of the state into host buffers reused from
one snapshot to the next (hpcrun.runtime.snapshotbuffers; on a GPU pinned, and the copy on a side
stream the optimizer step waits for); a background thread writes it under a temporary name, its
manifest (each file's size and CRC-32, the attempt that wrote it) last, renames it into place
(hpcrun.runtime.snapshotfiles), then sends the files to its peer on the next node
(hpcrun.runtime.snapshotexchange). Once every rank holds both copies (an all-gather of the ranks'
reasons for failure, on the snapshots' own gloo group) each rank drops its older steps: a node
keeps one complete step of each rank directory it holds, plus the one being written.
A snapshot due while the previous one is still in flight, or before the first one's buffers are
allocated, is skipped (hpcrun.runtime.cadence). A snapshot that fails on any rank is counted on
every rank (`failures`, in rank 0's summary line and the results row) and said on rank 0's output,
the failing rank's reason on its stderr; the disk checkpoint stays.

At an attempt's start `restore` (collective, hpcrun.runtime.snapshotrestore) loads the newest step
every rank has a verified copy of, when it is newer than the newest disk checkpoint. Snapshots are
valid within one job start only; what earlier starts and killed attempts left on a node is removed
when a rank's snapshots are built (hpcrun.runtime.snapshotsweep). After `close` nothing is written:
a write racing with it creates no directory.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
import typing as tp
from concurrent.futures import Future
from pathlib import Path

from hpcrun import rundir, slurm
from hpcrun.runtime import checkpoint as ckpt
from hpcrun.runtime.env import DistEnv
from hpcrun.runtime.snapshotbuffers import BufferState, SnapshotBuffers
from hpcrun.runtime.snapshotdirs import RankDirs
from hpcrun.runtime.snapshotexchange import Peers, peer_of
from hpcrun.runtime.snapshotfiles import publish
from hpcrun.runtime.snapshotrestore import Restored, restore
from hpcrun.runtime.snapshotsurvivor import keep
from hpcrun.runtime.snapshotsweep import sweep, sweep_past, sweep_run

PREPARE_WAIT_S = 10.0  # at the end, for buffers still being allocated: a stop must fit in KillWait


class Snapshots:
    """One rank's in-memory snapshots of one run; `save`, `restore` and `close` are collective."""

    def __init__(self, scratch: Path, run_id: str, env: DistEnv, timeout_s: float, on_slurm: bool) -> None:
        self.env, self.run_id = env, run_id
        host = slurm.node_name(os.environ)
        # SLURM's requeue count, not hpcrun's attempt number: a restart inside the job finds the same directory
        self.dirs = RankDirs(rundir.snapshot_job_dir(scratch, env.allocation_id, env.slurm_requeues), run_id, host)
        self.peers = Peers(env, f"{host}:{os.path.realpath(scratch)}", timeout_s)  # ranks that share this scratch
        self.stalls: list[float] = []  # seconds each save held the training thread
        self.failures = 0  # snapshots that failed on some rank (every rank counts them alike)
        # the engine's, once `prepare` has asked it: until then this rank's own, not yet asked
        self.buffers = SnapshotBuffers()
        self._pending: Future[None] | None = None
        self._queue: queue.SimpleQueue[tuple[Future[None], tp.Callable[[], None]]] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        if env.local_rank == 0:  # before any rank of this attempt writes: the first `restore` waits for it
            sweep(scratch, env.allocation_id, env.slurm_requeues, others=on_slurm)
            sweep_run(scratch, self.job_dir, run_id, host)

    @property
    def job_dir(self) -> Path:
        return self.dirs.job_dir

    def rank_dir(self, rank: int) -> Path:
        return self.dirs.rank_dir(rank)

    def engine_rank(self, rank: int, engine: tp.Any) -> int:
        return self.peers.engine_rank(rank, engine)

    def restore(self, engine: tp.Any, newer_than: int) -> Restored | None:
        """Load the newest step every rank has a verified copy of, written by one attempt, if
        newer than `newer_than` (the newest disk checkpoint's step); None: resume from disk."""
        restored = restore(self.peers, self.dirs, engine, newer_than, self.info)
        if self.env.local_rank == 0:  # every rank's inventory was taken before the restore's first gather
            sweep_past(self.job_dir, self.run_id, self.dirs.host, self.held_here())
        return restored

    def held_here(self) -> set[int]:
        """The ranks whose snapshot directories this node holds: its own ranks', and those whose
        replicas it receives (each rank's peer on the next node)."""
        nodes, here = self.peers.nodes, self.peers.node
        held = set()
        for rank, node in enumerate(nodes):
            peer = peer_of(nodes, rank)
            if here == node or (peer is not None and nodes[peer] == here):
                held.add(rank)
        return held

    def keep_survivor(self, engine: tp.Any, step: int, trainer_state: dict[str, tp.Any]) -> str:
        """After a failure, this rank's live state as step `step` for every rank of the world, on this
        node, where every rank's engine state is the same (hpcrun.runtime.snapshotsurvivor); no collective.
        Returns what was done, for the log. The caller holds the engine's update lock."""
        if not getattr(engine, "replicated", False):
            return "not kept: a sharded state (a dead rank's shard is in its periodic snapshot only)"
        return keep(self.dirs, self.peers, engine, self.env.rank, self.env.world_size, self.env.attempt, self.run_id,
                    step, trainer_state)

    @property
    def busy(self) -> bool:
        """Whether the previous snapshot is still being written, sent or agreed on, or the first
        one's host buffers are still being allocated."""
        in_flight = self._pending is not None and not self._pending.done()
        return in_flight or self.buffers.state is BufferState.ALLOCATING

    @property
    def prepare_pending(self) -> bool:
        """Whether `prepare` is still to ask the engine for its buffers (or it could not answer yet)."""
        return self.buffers.state is BufferState.UNASKED

    @property
    def prepared(self) -> bool:
        """Whether this rank's buffers were allocated aside (`prepare`)."""
        return self.buffers.aside

    def prepare(self, engine: tp.Any) -> None:
        """Have `engine` allocate its snapshot buffers aside (`prepare_snapshot`), so that the
        first snapshot, like every later one, holds training only for its copy; until they are
        ready the snapshot is `busy` (one due is skipped). Called after each step until it could ask
        (`prepare_pending`); the first call is collective (every rank, the same step: it may learn the
        nodes), the later ones are not."""
        prepare = getattr(engine, "prepare_snapshot", None)
        if prepare is None:
            self.buffers.none_aside()
            return
        self.peers.learn_nodes()
        self.buffers = prepare(keep=self.engine_rank(self.env.rank, engine) == self.env.rank)

    def save(self, engine: tp.Any, step: int, trainer_state: dict[str, tp.Any]) -> float:
        """Snapshot `step`: copy the state to host buffers and leave the rest to the background
        thread. Returns the seconds the training thread was held. Called when no snapshot is in
        flight on any rank (hpcrun.runtime.cadence skips one due earlier)."""
        start = time.perf_counter()
        self.wait()  # nothing in flight by the cadence's agreement: returns at once
        self.peers.learn_nodes()
        state = {**trainer_state, "rng": ckpt.rng_state(), "rank": self.env.rank}
        staged = engine.snapshot_state(keep=self.engine_rank(self.env.rank, engine) == self.env.rank)
        self._pending = Future[None]()
        if self._worker is None:  # one thread for the run: starting one per snapshot held training ~1 ms more
            # a daemon: a thread stuck on a dead peer must not hold the process at exit
            self._worker = threading.Thread(target=self._work, name="hpcrun-snapshot", daemon=True)
            self._worker.start()
        self._queue.put((self._pending, lambda: self._complete(engine, staged, step, state)))
        self.stalls.append(time.perf_counter() - start)
        return self.stalls[-1]

    def _work(self) -> None:
        while True:
            pending, job = self._queue.get()
            try:
                job()
                pending.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - raised where the training thread waits
                pending.set_exception(exc)

    def _complete(self, engine: tp.Any, staged: dict[str, tp.Any] | None, step: int, state: dict[str, tp.Any]) -> None:
        """The background half of a save: publish, replicate, agree, prune. Never raises: a
        failed snapshot is reported and skipped (the disk checkpoint stays), and every rank still
        takes part in the exchange and the agreement, so that none waits for it forever."""
        rank, dirs = self.env.rank, self.dirs
        tmp, final = rundir.partial_step_dir(dirs.rank_dir(rank), step), rundir.step_dir(dirs.rank_dir(rank), step)
        published, why = False, None
        try:
            if dirs.claim(rank) and dirs.new_dir(tmp):
                rundir.trainer_state(tmp, rank).write_bytes(ckpt.serialise(state))
                if staged is not None:
                    engine.write_snapshot(staged, rundir.engine_state(tmp))
            if not dirs.closed:
                publish(tmp, final, step=step, rank=rank, world_size=self.env.world_size, run_id=self.run_id,
                        attempt=self.env.attempt)
                published = True
        except Exception as exc:  # noqa: BLE001 - reported, and the ranks still meet below
            why = f"{type(exc).__name__}: {exc}"
        if dirs.closed and not published:  # abandoned by a stop: what a write made after close goes too
            dirs.remove()
            return
        why = self.peers.replicate(dirs, final if published else None, step) or why
        try:
            reasons = dict(enumerate(self.peers.gather(why)))
        except Exception as exc:  # noqa: BLE001 - a peer gone: the training's own collectives will say so
            why = why or f"{type(exc).__name__}: {exc}"
            reasons = {rank: why}
        failed = {r: reason for r, reason in reasons.items() if reason}
        if dirs.closed:
            dirs.remove()
            return
        if not failed:  # every rank holds step `step` twice: older ones are of no more use
            dirs.prune(step)
            return
        self.failures += 1
        if why:
            print(f"[hpcrun rank {rank}] snapshot of step {step} failed: {why}", file=sys.stderr, flush=True)
        if self.env.is_main:  # on rank 0's output, where the run's own lines are read
            first, reason = next(iter(failed.items()))
            print(
                f"[hpcrun rank {rank}] snapshot of step {step} failed on rank{'s' if len(failed) > 1 else ''} "
                f"{', '.join(map(str, failed))} (rank {first}: {reason}); the disk checkpoint stays",
                flush=True,
            )

    def wait(self) -> None:
        """Until the snapshot in flight is published, replicated and agreed on."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self, abandon: bool) -> None:
        """Delete this rank's directories and, once empty, the job's: after the snapshot in flight
        is done, or with `abandon` at once (a stop must fit in SLURM's KillWait; the background
        thread writes nothing more, and removes what a write of its made after this)."""
        if not abandon:
            self.wait()
        self.dirs.close()
        self.buffers.wait(PREPARE_WAIT_S)  # a thread inside torch at interpreter exit can abort the process
        self.dirs.remove()

    def info(self, message: str) -> None:
        print(f"[hpcrun rank {self.env.rank}] {message}", file=sys.stderr, flush=True)
