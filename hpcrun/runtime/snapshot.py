"""In-memory snapshots replicated to another node, for a restart inside the job.

When its cadence says (hpcrun.runtime.schedule) each rank writes its whole training state (what a disk
checkpoint holds: the engine's DCP state, saved with no collective so that the rank's directory
holds all it loads, and the trainer state: step, losses, RNG streams) into node-local scratch, a
tmpfs that outlives the training processes; where every rank's engine state is the same (DDP)
only each node's first rank writes it, and the node's other ranks load that copy:
`<local_scratch>/hpcrun-<SLURM_JOB_ID>-<SLURM_RESTART_COUNT>/<run id>/<node>/rank-NNNNN/step-N/`
(`<node>`: SLURMD_NODENAME, so nodes stay apart even where the scratch is shared).
On the training thread a snapshot is only a copy of the state into host buffers reused from one
snapshot to the next, allocated on a thread of their own after the attempt's first step (on a GPU
pinned, and the copy on a side stream the optimizer step waits for); a background
thread writes it under a temporary name, its manifest (each file's size and CRC-32, the attempt
that wrote it) last, renames it into place, then sends the files to the rank of the same position
on the next node (its peer) as they lie in memory (tmpfs pages, mapped: no pickles, no copies),
which receives them straight into their files and checks them against the manifest. Once every
rank holds both copies (an all-gather of the ranks' reasons for failure, on the snapshots' own gloo
group) each rank drops its older steps: a node keeps one complete step of each rank directory it
holds, plus the one being written.
A snapshot due while the previous one is still in flight, or before the first one's buffers are
allocated, is skipped (hpcrun.runtime.schedule). A snapshot that fails on any rank is counted on
every rank (`failures`, in rank 0's summary line) and said on rank 0's output, the failing rank's
reason on its stderr; the disk checkpoint stays.

At an attempt's start (`restore`, collective) the ranks exchange what their nodes hold, pick the
newest step of which every rank has a verified copy written by one attempt on some node (ranks
of different attempts never make one state), have a holder send the files
of any rank whose node lacks them (a lost node's ranks, started on another node), and load it
when it is newer than the newest disk checkpoint. A torn copy (a file short or changed, no
manifest) is never used: that rank's files come from another holder, or an older step, or the
disk checkpoint is used (a copy that fails to arrive sends the restart to disk). Snapshots are
valid within one job start only (requeues and new jobs resume from disk, the durable
checkpoint); the batch script removes the job's directory on every node when the job ends, and
the next job on a node removes what an ended job could not (`sweep`). Every process holds a shared
lock on a file in each rank directory it writes (`OWNER`; the kernel drops it when the process
dies), so that what no live process writes is known: a run's next attempt or job on a node removes
the partial steps killed attempts left, and the run's directories of earlier job starts
(`sweep_run`). After `close` nothing is written: a write racing with it creates no directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import fcntl
import json
import os
import queue
import shutil
import sys
import threading
import time
import typing as tp
import zlib
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist

from hpcrun import rundir, slurm
from hpcrun.errors import HpcrunError
from hpcrun.runtime import checkpoint as ckpt
from hpcrun.runtime.env import DistEnv


@dataclasses.dataclass(frozen=True)
class Restored:
    """Where an attempt resumed from: `memory` (every rank's own node held its files) or
    `replica` (some rank's files came from another node), the step, and this rank's trainer state."""

    source: str
    step: int
    state: dict[str, tp.Any]


CHUNK = 1 << 24  # bytes read at a time to check a file
CLOSED = "abandoned: the snapshots were closed"


def file_hashes(directory: Path) -> dict[str, str]:
    """`<size>:<CRC-32>` of every file below `directory` but its manifest, by relative path.
    CRC-32 finds a torn or changed file at ~3.5 GiB/s on one core (sha256: ~1.5): it guards
    against accidents, not against an adversary, who could write the manifest too."""
    found = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.name != rundir.MANIFEST:
            found[path.relative_to(directory).as_posix()] = _checksum(path)
    return found


def _checksum(path: Path) -> str:
    crc, size = 0, 0
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return _tag(size, crc)


def _tag(size: int, crc: int) -> str:
    return f"{size}:{crc:08x}"


OWNER = ".owner"  # in a rank directory: share-locked by every live process that writes there


@contextlib.contextmanager
def unowned(rank_dir: Path) -> tp.Iterator[bool]:
    """Whether no live process writes in `rank_dir`; while true, none can begin to (`_claim`
    waits)."""
    fd = None
    try:
        fd = os.open(rank_dir / OWNER, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        free = True
    except FileNotFoundError:  # no process has written there yet: the owner file comes first
        free = True
    except OSError:  # a live owner holds it (BlockingIOError), or none can be told: one is assumed
        free = False
    try:
        yield free
    finally:
        if fd is not None:
            os.close(fd)


def remove_partial_steps(rank_dir: Path) -> None:
    for leftover in rundir.partial_step_dirs(rank_dir):
        shutil.rmtree(leftover, ignore_errors=True)


def remove_empty(*paths: Path) -> None:
    for path in paths:
        try:
            path.rmdir()
        except OSError:  # not empty: another rank's or run's directories are still there
            pass


def publish(tmp: Path, final: Path, **fields: tp.Any) -> None:
    """Write `tmp`'s manifest (the hashes of its files) last, then rename it to `final`."""
    manifest = {**fields, "files": file_hashes(tmp), "complete": True}
    rundir.write_json(rundir.manifest(tmp), manifest)
    shutil.rmtree(final, ignore_errors=True)  # the same step written before a restart
    os.rename(tmp, final)


def manifest_of(step_dir: Path) -> dict[str, tp.Any] | None:
    """A snapshot's manifest; None when it has none, so is incomplete. An unreadable one is
    reported by `verify`; here it makes the snapshot count as absent (the disk stays)."""
    try:
        manifest = rundir.read_json(rundir.manifest(step_dir), missing=None)
    except rundir.CorruptStateError:
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("complete") else None


def verify(step_dir: Path) -> str | None:
    """Why the snapshot in `step_dir` may not be used, or None: its manifest lists exactly the
    files there, each with its size and CRC-32."""
    manifest = manifest_of(step_dir)
    if manifest is None:
        return f"{rundir.manifest(step_dir)}: missing or unreadable"
    try:
        found = file_hashes(step_dir)
    except OSError as exc:
        return f"{step_dir}: {exc}"
    listed = manifest.get("files", {})
    wrong = sorted(name for name in set(listed) | set(found) if listed.get(name) != found.get(name))
    return f"{step_dir}: files differ from the manifest: {', '.join(wrong)}" if wrong else None


PREPARE_WAIT_S = 10.0  # at the end, for buffers still being allocated: a stop must fit in KillWait
SEND_CHUNK = 1 << 28  # one message's most bytes: gloo's ibverbs transport refuses 1 GiB and more


def mapped(path: Path, size: int) -> torch.Tensor:
    """The bytes of `path` as a tensor over its pages: on tmpfs a send reads the file's memory
    and a receive writes into it, with no copy in the process."""
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)


def allocated(path: Path, size: int) -> torch.Tensor:
    """A new file of `size` bytes, its blocks reserved (a full tmpfs is ENOSPC here, not a fault
    while a receive writes into the mapping), mapped."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        if size:
            os.posix_fallocate(f.fileno(), 0, size)
    return mapped(path, size)


def chunks(data: torch.Tensor) -> list[torch.Tensor]:
    """`data` as views of at most SEND_CHUNK bytes, sent and received in the same order."""
    return list(data.split(SEND_CHUNK)) if data.numel() else []


def nodes_ranks(nodes: list[str]) -> list[list[int]]:
    """The ranks on each node, nodes in the order of their first rank."""
    order: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        order.setdefault(node, []).append(rank)
    return list(order.values())


def peer_of(nodes: list[str], rank: int) -> int | None:
    """Where `rank` sends its snapshots: the rank at its position on the next node (rank r ->
    r + tasks per node, modulo the world, for SLURM's block layout); None on a single node."""
    groups = nodes_ranks(nodes)
    if len(groups) < 2:
        return None
    index = next(i for i, g in enumerate(groups) if rank in g)
    nxt = groups[(index + 1) % len(groups)]
    return nxt[groups[index].index(rank) % len(nxt)]


def sweep(scratch: Path, allocation_id: str, slurm_requeues: int, others: bool) -> None:
    """Remove what earlier job starts left in this node's scratch: this job's before its latest
    requeue and, with `others` (a SLURM job), any job of this user SLURM no longer lists (a batch
    shell killed before its exit cleared its nodes: a preemption past its grace time). Only on
    an answer that lists this job too; without SLURM's tools here (a container), only this job's."""
    for n in range(slurm_requeues):
        shutil.rmtree(rundir.snapshot_job_dir(scratch, allocation_id, n), ignore_errors=True)
    ended = {job: paths for job, paths in rundir.snapshot_job_dirs(scratch).items() if job != allocation_id}
    if not others or not ended:
        return
    try:
        listed = slurm.run(slurm.my_allocations())
    except HpcrunError:
        return
    running = set(listed.stdout.split())
    if listed.returncode != 0 or allocation_id not in running:  # an answer that misses this job is not one
        return
    for job, paths in ended.items():
        if job not in running:
            for path in paths:
                shutil.rmtree(path, ignore_errors=True)


def sweep_run(scratch: Path, job_dir: Path, run_id: str, host: str) -> None:
    """Remove what this node holds of run `run_id` that no live process writes and no restore can
    use: in this job start's directory `job_dir` the partial steps of killed attempts (on a tight
    tmpfs they would make every later snapshot fail), in other job starts' directories (another job
    of the run, a requeue's whose exit could not clear the node) the whole rank directories, as
    snapshots never serve across job starts (a requeue or a new job resumes from disk)."""
    for paths in rundir.snapshot_job_dirs(scratch).values():
        for start in paths:
            current = start.name == job_dir.name
            for rank_dir in rundir.snapshot_ranks(start, run_id, host).values():
                with unowned(rank_dir) as free:
                    if free and current:
                        remove_partial_steps(rank_dir)
                    elif free:
                        shutil.rmtree(rank_dir, ignore_errors=True)
            if not current:
                remove_empty(start / run_id / host, start / run_id, start)


Copy = tuple[int, int, int]
"""A snapshot copy: (rank, step, attempt that wrote it)."""


class Snapshots:
    """One rank's in-memory snapshots of one run; `save`, `restore` and `close` are collective."""

    def __init__(self, scratch: Path, run_id: str, env: DistEnv, timeout_s: float, on_slurm: bool) -> None:
        self.env, self.run_id = env, run_id
        # SLURM's requeue count, not hpcrun's attempt number: a restart inside the job finds the same directory
        self.job_dir = rundir.snapshot_job_dir(scratch, env.allocation_id, env.slurm_requeues)
        self.host = slurm.node_name(os.environ)
        self.node = f"{self.host}:{os.path.realpath(scratch)}"  # ranks that share this scratch
        distributed = dist.is_initialized() and env.world_size > 1
        # a group of its own: the background thread's sends and agreement never interleave with
        # training's; with the job's collective timeout, so that a dead peer ends the attempt in time
        timeout = dt.timedelta(seconds=timeout_s)
        self.group = dist.new_group(backend="gloo", timeout=timeout) if distributed else None
        self.nodes: list[str] = [self.node]
        self.stalls: list[float] = []  # seconds each save held the training thread
        self.failures = 0  # snapshots that failed on some rank (every rank counts them alike)
        self.prepared = False  # whether this rank's buffers were allocated aside (`prepare`)
        self.prepare_pending = True  # until `prepare` has asked the engine and it could answer
        self._pending: Future[None] | None = None
        self._preparing: Future[tp.Any] | None = None  # the engine's first host buffers, being allocated
        self._queue: queue.SimpleQueue[tuple[Future[None], tp.Callable[[], None]]] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._held: set[int] = set()  # the rank directories this rank has written on its node (`_claim`)
        self._owners: dict[int, int] = {}  # their owner files' descriptors, share-locked until `close`
        # `_closed` and what creates or removes directories, under one lock: once `close` has removed
        # them, a write racing with it (the background thread's) creates none again
        self._lock = threading.Lock()
        self._closed = False
        if env.local_rank == 0:  # before any rank of this attempt writes: the first `restore` waits for it
            sweep(scratch, env.allocation_id, env.slurm_requeues, others=on_slurm)
            sweep_run(scratch, self.job_dir, run_id, self.host)

    def rank_dir(self, rank: int) -> Path:
        return rundir.snapshot_rank_dir(self.job_dir, self.run_id, self.host, rank)

    def _claim(self, rank: int) -> bool:
        """Hold `rank`'s directory as one this process writes (its owner file share-locked, made
        before anything lands there) and remove the partial steps there that no other live process
        writes; False once closed: nothing may be written then."""
        with self._lock:
            if self._closed:
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

    def _new_dir(self, path: Path) -> bool:
        """`path` made empty, unless closed (False)."""
        with self._lock:
            if self._closed:
                return False
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
            return True

    def _allocated(self, path: Path, size: int) -> torch.Tensor | None:
        """`allocated`, unless closed (None)."""
        with self._lock:
            return None if self._closed else allocated(path, size)

    def _remove(self) -> None:
        """This rank's directories and, once empty, the run's and the job's on this node."""
        with self._lock:
            for rank in self._held:
                shutil.rmtree(self.rank_dir(rank), ignore_errors=True)
            for fd in self._owners.values():
                os.close(fd)
            self._owners.clear()
            remove_empty(self.job_dir / self.run_id / self.host, self.job_dir / self.run_id, self.job_dir)

    def engine_rank(self, rank: int, engine: tp.Any) -> int:
        """The rank whose snapshot directory holds `rank`'s engine state: its own, or where every
        rank holds the same state (DDP, `engine.replicated`) its node's first rank's, one copy per
        node (a restart keeps SLURM's block layout, so the same rank is first again)."""
        if not getattr(engine, "replicated", False):  # an engine that does not say keeps its own
            return rank
        return next(group[0] for group in nodes_ranks(self.nodes) if rank in group)

    def _learn_nodes(self) -> None:
        """Where every rank runs, if no restore learnt it. Collective."""
        if len(self.nodes) != self.env.world_size:
            self.nodes = self._gather(self.node)

    def _gather(self, value: tp.Any) -> list[tp.Any]:
        if self.group is None:
            return [value]
        out: list[tp.Any] = [None] * self.env.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def inventory(self) -> list[Copy]:
        """(rank, step, attempt) of every complete snapshot of this run's world size on this node."""
        found = []
        for rank, path in rundir.snapshot_ranks(self.job_dir, self.run_id, self.host).items():
            for step, step_path in rundir.step_dirs(path).items():
                manifest = manifest_of(step_path)
                if manifest and manifest.get("world_size") == self.env.world_size and manifest.get("step") == step:
                    found.append((rank, step, int(manifest.get("attempt", -1))))
        return found

    def restore(self, engine: tp.Any, newer_than: int) -> Restored | None:
        """Load the newest step every rank has a verified copy of, written by one attempt, if
        newer than `newer_than` (the newest disk checkpoint's step); None: resume from disk."""
        gathered = self._gather((self.node, self.inventory()))
        self.nodes = [node for node, _ in gathered]
        holders: dict[Copy, list[int]] = {}
        for group in nodes_ranks(self.nodes):  # one holder per node: its first rank
            for copy in gathered[group[0]][1]:
                holders.setdefault(tuple(copy), []).append(group[0])
        world = self.env.world_size
        for step, attempt in sorted({(s, a) for _, s, a in holders if s > newer_than}, reverse=True):
            plan = self._plan(step, attempt, holders, world)
            if plan is None:
                continue
            source = "memory" if all(self.nodes[h] == self.nodes[r] for r, h in plan.items()) else "replica"
            refused = self._gather(self._fetch(step, plan))
            # after that gather every rank's files of this step are on its own node, its node's
            # first rank's too (the engine state of a rank that keeps none, DDP's)
            shared = rundir.step_dir(self.rank_dir(self.engine_rank(self.env.rank, engine)), step)
            if not any(refused):
                missing = None if rundir.engine_state(shared).exists() else f"{shared}: no engine state"
                refused = self._gather(missing)
            if any(refused):
                why = "; ".join(w for w in refused if w)
                self.info(f"snapshot of step {step} not usable: {why}; resuming from disk")
                return None
            path = rundir.step_dir(self.rank_dir(self.env.rank), step)
            engine.load(rundir.engine_state(shared), local=True)
            state = torch.load(rundir.trainer_state(path, self.env.rank), weights_only=True)
            ckpt.set_rng_state(state["rng"])
            return Restored(source, step, state)
        return None

    def _plan(self, step: int, attempt: int, holders: dict[Copy, list[int]], world: int) -> dict[int, int] | None:
        """Which rank's node serves each rank's files of `step` as `attempt` wrote it: the rank's
        own node where it holds a verified copy, else another holder; None when some rank has no
        verified copy of that attempt anywhere."""
        refused: set[tuple[int, int]] = set()  # (holder, rank) whose copy failed verification
        while True:
            plan = {}
            for rank in range(world):
                usable = [h for h in holders.get((rank, step, attempt), []) if (h, rank) not in refused]
                if not usable:
                    return None
                own = [h for h in usable if self.nodes[h] == self.nodes[rank]]
                plan[rank] = (own or usable)[0]
            mine = [r for r, h in plan.items() if h == self.env.rank]
            checked = [(r, verify(rundir.step_dir(self.rank_dir(r), step))) for r in mine]
            bad = [(holder, r, why) for holder, found in enumerate(self._gather(checked)) for r, why in found if why]
            if not bad:
                return plan
            for holder, rank, why in bad:
                self.info(f"snapshot of rank {rank} at step {step} on {self.nodes[holder]} not used: {why}")
                refused.add((holder, rank))

    def _fetch(self, step: int, plan: dict[int, int]) -> str | None:
        """Send and receive the files of ranks whose node lacks them (point to point over the
        snapshots' group); returns why a received copy was refused, or None."""
        moves = [(h, r) for r, h in sorted(plan.items()) if self.nodes[h] != self.nodes[r]]
        mine = self.env.rank
        outgoing: list[tuple[int, Path | None]] = [
            (rank, rundir.step_dir(self.rank_dir(rank), step)) for holder, rank in moves if holder == mine
        ]
        return self._exchange(outgoing, [(holder, mine) for holder, rank in moves if rank == mine], step)

    def _exchange(
        self, outgoing: list[tuple[int, Path | None]], incoming: list[tuple[int, int]], step: int
    ) -> str | None:
        """Send each outgoing step directory to its rank (None: nothing, this rank's snapshot
        failed) and receive each incoming (sender, rank) copy as step `step` of that rank's
        directory here: a header (the files and sizes), then every file's bytes straight from
        and into its mapped pages, written under a temporary name, verified, renamed. Returns
        why a received copy was refused, or None."""
        sends: list[tuple[tp.Any, torch.Tensor]] = []  # each send with its tensor, kept alive until it completes
        for to, directory in outgoing:
            pieces, files = [], []
            try:  # every file mapped before the header goes: an error after it would leave the peer short
                for path in [] if directory is None else sorted(p for p in directory.rglob("*") if p.is_file()):
                    length = path.stat().st_size
                    files.append((path.relative_to(tp.cast(Path, directory)).as_posix(), length))
                    pieces += chunks(mapped(path, length)) if length else []
            except OSError:
                pieces, files = [], []  # the peer is told "nothing" and counts the copy missing
            header = torch.frombuffer(bytearray(json.dumps({"files": files}).encode()), dtype=torch.uint8)
            size = torch.tensor([header.numel()], dtype=torch.int64)
            sends += [(dist.isend(t, to, group=self.group), t) for t in (size, header, *pieces)]
        why = None
        for sender, rank in incoming:
            size = torch.zeros(1, dtype=torch.int64)
            dist.recv(size, sender, group=self.group)
            header = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(header, sender, group=self.group)
            files = json.loads(header.numpy().tobytes())["files"]
            if not files:
                why = why or f"rank {sender} sent no snapshot of rank {rank}"
                continue
            tmp = rundir.partial_step_dir(self.rank_dir(rank), step)
            refused = None
            try:
                if not (self._claim(rank) and self._new_dir(tmp)):
                    refused = CLOSED
            except OSError as exc:
                refused = f"{self.rank_dir(rank)}: {exc}"
            for name, length in files:
                target = None
                if refused is None:
                    try:  # a full tmpfs or a close: still take every byte the sender sends
                        target = self._allocated(tmp / name, length)
                        refused = CLOSED if target is None else None
                    except OSError as exc:
                        refused = f"{tmp / name}: {exc}"
                if target is None:  # drained through one chunk's buffer, piece by piece as they were sent
                    scratch = torch.empty(min(length, SEND_CHUNK), dtype=torch.uint8)
                    pieces = [scratch[: min(SEND_CHUNK, length - at)] for at in range(0, length, SEND_CHUNK)]
                else:
                    pieces = chunks(target)
                for piece in pieces:
                    dist.recv(piece, sender, group=self.group)
            if refused:
                shutil.rmtree(tmp, ignore_errors=True)
                why = why or refused
                continue
            why = self._settle(tmp, rundir.step_dir(self.rank_dir(rank), step)) or why
        for work, _ in sends:
            work.wait()
        return why

    def _settle(self, tmp: Path, final: Path) -> str | None:
        """A received copy verified against its manifest and renamed into place, or removed."""
        why = verify(tmp)
        with self._lock:
            why = CLOSED if self._closed else why
            if why is None:
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
        return why

    @property
    def busy(self) -> bool:
        """Whether the previous snapshot is still being written, sent or agreed on, or the first
        one's host buffers are still being allocated."""
        in_flight = self._pending is not None and not self._pending.done()
        return in_flight or (self._preparing is not None and not self._preparing.done())

    def prepare(self, engine: tp.Any) -> None:
        """Have `engine` allocate its snapshot buffers aside (`prepare_snapshot`), so that the
        first snapshot, like every later one, holds training only for its copy; until they are
        ready the snapshot is `busy` (one due is skipped). Called after each step until it could ask
        (`prepare_pending`); the first call is collective (every rank, the same step: it may learn the
        nodes), the later ones are not."""
        prepare = getattr(engine, "prepare_snapshot", None)
        if prepare is None:
            self.prepare_pending = False
            return
        self._learn_nodes()
        prepared = prepare(keep=self.engine_rank(self.env.rank, engine) == self.env.rank)
        self.prepare_pending = prepared is False  # the engine cannot yet: asked again after the next step
        self._preparing = prepared or None
        self.prepared = self.prepared or self._preparing is not None

    def save(self, engine: tp.Any, step: int, trainer_state: dict[str, tp.Any]) -> float:
        """Snapshot `step`: copy the state to host buffers and leave the rest to the background
        thread. Returns the seconds the training thread was held. Called when no snapshot is in
        flight on any rank (hpcrun.runtime.schedule skips one due earlier)."""
        start = time.perf_counter()
        self.wait()  # nothing in flight by the schedule's agreement: returns at once
        self._learn_nodes()
        self._preparing = None  # the engine has taken its buffers
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
        rank = self.env.rank
        tmp, final = rundir.partial_step_dir(self.rank_dir(rank), step), rundir.step_dir(self.rank_dir(rank), step)
        published, why = False, None
        try:
            if self._claim(rank) and self._new_dir(tmp):
                rundir.trainer_state(tmp, rank).write_bytes(ckpt.serialise(state))
                if staged is not None:
                    engine.write_snapshot(staged, rundir.engine_state(tmp))
            if not self._closed:
                publish(tmp, final, step=step, rank=rank, world_size=self.env.world_size, run_id=self.run_id,
                        attempt=self.env.attempt)
                published = True
        except Exception as exc:  # noqa: BLE001 - reported, and the ranks still meet below
            why = f"{type(exc).__name__}: {exc}"
        if self._closed and not published:  # abandoned by a stop: what a write made after close goes too
            self._remove()
            return
        why = self._replicate(final if published else None, step) or why
        try:
            reasons = dict(enumerate(self._gather(why)))
        except Exception as exc:  # noqa: BLE001 - a peer gone: the training's own collectives will say so
            why = why or f"{type(exc).__name__}: {exc}"
            reasons = {rank: why}
        failed = {r: reason for r, reason in reasons.items() if reason}
        if self._closed:
            self._remove()
            return
        if not failed:  # every rank holds step `step` twice: older ones are of no more use
            self._prune(step)
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

    def _replicate(self, published: Path | None, step: int) -> str | None:
        peer = peer_of(self.nodes, self.env.rank)
        if peer is None:
            return None
        senders = [r for r in range(self.env.world_size) if peer_of(self.nodes, r) == self.env.rank]
        try:
            return self._exchange([(peer, published)], [(sender, sender) for sender in senders], step)
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            return f"{type(exc).__name__}: {exc}"

    def _prune(self, step: int) -> None:
        with self._lock:
            if self._closed:
                return
            for rank in self._owners:
                for old, old_path in rundir.step_dirs(self.rank_dir(rank)).items():
                    if old < step:
                        shutil.rmtree(old_path, ignore_errors=True)
                self._remove_partial_steps(rank)

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
        with self._lock:
            self._closed = True  # from here on no directory is made (`_claim`, `_new_dir`, `_allocated`)
        if self._preparing is not None:  # a thread inside torch at interpreter exit can abort the process
            futures.wait([self._preparing], timeout=PREPARE_WAIT_S)
        self._remove()

    def info(self, message: str) -> None:
        print(f"[hpcrun rank {self.env.rank}] {message}", file=sys.stderr, flush=True)
