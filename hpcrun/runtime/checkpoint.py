"""Checkpoint directories: `<run>/checkpoints/step-NNNNNNNN/`, visible only when complete.

Every rank writes into `.tmp-step-NNNNNNNN/`; once every rank's part is durable, rank 0 writes
`manifest.json` last and renames the directory into place, so a reader sees a whole checkpoint
or none. Leftovers of a killed save are removed before the next save and never picked on resume.

Saves are asynchronous where the engine can be (DCP: DDP and FSDP): training stalls only while
the state is copied to host memory; the write runs in a background thread over a gloo group of
its own (collectives of two threads on one group would interleave). A save is made visible
between steps once it is done, and the next save, a stop and the end of training wait for it.
How DCP saves are staged and written (`host_stager`, `DcpWriter`) is here too: torch's public
staging and writer classes, configured, with no private torch names.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import hashlib
import json
import os
import random
import shutil
import time
import typing as tp
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import AsyncStager, BlockingAsyncStager, DefaultStager, StagingOptions

from hpcrun import __version__, rundir, torchrange
from hpcrun.rundir import CorruptStateError, RunDir, atomic_path, atomic_write, fsync_dir, read_json
from hpcrun.runtime import zeroinfinity
from hpcrun.runtime.env import DistEnv

WRITER_THREADS = 4  # copy + write against the disk: 2 threads 0.48, 4 threads 0.63, 8 threads 0.29 (RESULTS.md)
# From this release DefaultStager stages again and again into its host buffers. 2.11's closes its
# copier after every stage (dropping its buffers and its copy table: the second stage raised
# `KeyError: <class 'type'>`, reducing the state dict's own class); 2.12 was not tried.
DEFAULT_STAGER_REUSABLE = (2, 13)


def complete(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first: named `step-N` with a manifest. Only a missing manifest
    means incomplete (it is written last, atomically); one that cannot be read (EIO, EACCES,
    ESTALE on a shared filesystem) or parsed is a CorruptStateError naming it: taken as absent,
    the run would silently resume from an older checkpoint, or from step 0."""
    found = []
    for step, path in rundir.step_dirs(root).items():
        manifest = read_json(rundir.manifest(path), missing=None)
        if manifest is None:
            continue
        if not isinstance(manifest, dict) or "step" not in manifest:
            raise CorruptStateError(rundir.manifest(path), "not a checkpoint manifest")
        if manifest.get("complete") and int(manifest["step"]) == step:
            found.append((step, path))
    return sorted(found)


def latest(root: Path) -> tuple[int, Path] | None:
    found = complete(root)
    return found[-1] if found else None


def saved_world_size(root: Path) -> int | None:
    """How many ranks saved the newest complete checkpoint under `root`; None without one."""
    found = latest(root)
    if found is None:
        return None
    manifest = read_json(rundir.manifest(found[1]), missing=None)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("world_size"), int):
        raise CorruptStateError(rundir.manifest(found[1]), "no world_size in the checkpoint manifest")
    return int(manifest["world_size"])


def rng_state() -> dict[str, tp.Any]:
    state: dict[str, tp.Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def seed_step(seed: int, step: int, rank: int) -> None:
    """Seed every stream `rng_state` holds from (seed, step, rank) alone, at each step's start: a
    rank's draws then follow from the step it is at, so a rank restored from another's state (a
    survivor's save, hpcrun.runtime.snapshotsurvivor) draws what it would have. Blake2b: Python's
    `hash` of a str changes from process to process."""
    value = int.from_bytes(hashlib.blake2b(f"{seed}:{step}:{rank}".encode(), digest_size=8).digest(), "little")
    torch.default_generator.manual_seed(value)  # torch.manual_seed asks every backend: ~0.3 ms, this ~3 us
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(value)
    random.seed(value)


def set_rng_state(state: dict[str, tp.Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def host_stager(sharded_tensors: bool = False) -> AsyncStager:
    """Stages the state of an asynchronous DCP save into host memory, synchronously: when `stage`
    returns, training may change the state in place and the checkpoint still holds this step's.

    torch's DefaultStager keeps the host copy of every tensor storage it has seen and copies into
    it at the next save (buffers allocated once: no fresh pages to fault in, host memory flat);
    reuse is safe because a save starts only after the previous one is written. Pinned, with
    non-blocking device-to-host copies, only where CUDA is available: StagingOptions' defaults
    (pinned, shared, a staging thread) assume an accelerator, and a staging thread would let
    training change the state while it is still being copied.

    FSDP's sharded state dicts hold ShardedTensors, which DefaultStager cannot copy (it asks them
    for a `data_ptr`): those go through BlockingAsyncStager, which reuses pinned buffers where
    CUDA is available and, since it always pins what it caches, copies into fresh host buffers
    on CPU-only torch.

    Before DEFAULT_STAGER_REUSABLE, DefaultStager cannot stage twice, so plain tensors go through
    ReusingStager: the same one copy per save into reused host buffers, hpcrun's own."""
    cuda = torch.cuda.is_available()
    if sharded_tensors:
        return BlockingAsyncStager(cache_staged_state_dict=cuda)
    found = torchrange.release(torch.__version__)
    if found is not None and found < DEFAULT_STAGER_REUSABLE:
        return ReusingStager()
    options = StagingOptions(
        use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
    )
    return DefaultStager(options)


def copy_into(source: tp.Any, buffers: tp.Any, non_blocking: bool = False) -> tp.Any:
    """A copy of a state dict into host memory that reuses `buffers` (the previous copy's)
    wherever a tensor's shape and dtype are unchanged; other values are copied anew. From a GPU
    into pinned buffers; with `non_blocking` the copies are only queued on the current stream,
    and the caller waits for them (a snapshot's side stream) before anyone reads the buffers."""
    if isinstance(source, torch.Tensor):
        pinned = source.device.type == "cuda"
        queued = non_blocking and pinned
        if isinstance(buffers, torch.Tensor) and buffers.shape == source.shape and buffers.dtype == source.dtype:
            return buffers.copy_(source.detach(), non_blocking=queued)
        host = torch.empty_like(source, device="cpu", pin_memory=pinned)
        return host.copy_(source.detach(), non_blocking=queued)
    if isinstance(source, dict):
        old = buffers if isinstance(buffers, dict) else {}
        return {key: copy_into(value, old.get(key), non_blocking) for key, value in source.items()}
    if isinstance(source, (list, tuple)):
        same = isinstance(buffers, (list, tuple)) and len(buffers) == len(source)
        olds = list(buffers) if same else [None] * len(source)
        return type(source)(copy_into(value, old, non_blocking) for value, old in zip(source, olds))
    return copy.deepcopy(source)


def meta_like(source: tp.Any) -> tp.Any:
    """`source`'s structure with each tensor's shape and dtype only (meta tensors, no memory) and
    None for any other value: what `allocate_like` needs, safe to hand to another thread."""
    if isinstance(source, torch.Tensor):
        return torch.empty_like(source, device="meta")
    if isinstance(source, dict):
        return {key: meta_like(value) for key, value in source.items()}
    if isinstance(source, (list, tuple)):
        return [meta_like(value) for value in source]
    return None


def allocate_like(shapes: tp.Any, pinned: bool) -> tp.Any:
    """Host buffers for `copy_into` to fill, one per tensor of `shapes` (`meta_like`'s), pinned
    for a state on a GPU; None for any other value. Unpinned buffers are zeroed, so that the first
    copy into them faults in no fresh pages."""
    if isinstance(shapes, torch.Tensor):
        if pinned:
            return torch.empty(shapes.shape, dtype=shapes.dtype, pin_memory=True)
        return torch.zeros(shapes.shape, dtype=shapes.dtype)
    if isinstance(shapes, dict):
        return {key: allocate_like(value, pinned) for key, value in shapes.items()}
    if isinstance(shapes, list):
        return [allocate_like(value, pinned) for value in shapes]
    return None


class ReusingStager(AsyncStager):
    """An asynchronous save's stager for state dicts of plain tensors: `stage` copies the state
    into the previous save's host buffers (`copy_into`) and returns them, the copy done. Reuse is
    safe for the reason DefaultStager's is: a save starts only after the previous one is written."""

    def __init__(self) -> None:
        self._buffers: tp.Any = None

    def stage(self, state_dict: dict[str, tp.Any]) -> dict[str, tp.Any]:
        self._buffers = copy_into(state_dict, self._buffers)
        return tp.cast(dict[str, tp.Any], self._buffers)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: `stage` returns once its copy is done."""

    def close(self) -> None:
        self._buffers = None


class DcpWriter(FileSystemWriter):
    """DCP's file writer, fsynced (a checkpoint must survive the node), with several threads.
    torch.save's per-record CRC32 stays on: it is what lets a load notice a damaged record, and
    turning it off is a process-wide switch that a writer thread cannot flip without racing every
    other torch.save (benchmarks/RESULTS.md records what it costs)."""

    def __init__(self, directory: Path, sync_files: bool = True, threads: int = WRITER_THREADS) -> None:
        super().__init__(str(directory), sync_files=sync_files, thread_count=threads)

    def write_data(self, plan: tp.Any, planner: tp.Any) -> tp.Any:
        future = super().write_data(plan, planner)
        # A helper thread of FileSystemWriter that raises dies alone and its items are silently
        # missing from the results: count them, so that the save fails on every rank (DCP
        # gathers this error) rather than publishing a checkpoint with holes.
        written = len(future.wait())
        if written != len(plan.items):
            raise OSError(f"{self.path}: checkpoint writer lost {len(plan.items) - written} of {len(plan.items)} items")
        return future


@dataclasses.dataclass
class _Save:
    """A save whose files may still be being written."""

    step: int
    tmp: Path
    final: Path
    started: float
    future: Future[tp.Any] | None = None  # None: written synchronously, complete on every rank
    durable_at: float | None = None


class Checkpoints:
    """Save and find checkpoints of one run; collective: every rank calls `save` and `load`."""

    def __init__(self, root: Path, env: DistEnv, keep: int, strategy: str, asynchronous: bool = False,
                 timeout_s: float | None = None) -> None:
        self.root, self.env, self.keep, self.strategy = root, env, keep, strategy
        self.asynchronous = asynchronous
        # the writer group's: the recipe's fault.collective_timeout_s, so a peer lost mid-write ends
        # the save in time, not after torch's 30-minute default (None)
        self.timeout_s = timeout_s
        self.write_times: list[float] = []  # seconds from each save's start until it was durable
        self._pending: _Save | None = None
        self._group: tp.Any = None

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def _writer_group(self) -> tp.Any:
        """Created at the first asynchronous save, which every rank reaches at the same step."""
        if self._group is None and dist.is_initialized():
            timeout = dt.timedelta(seconds=self.timeout_s) if self.timeout_s is not None else None
            self._group = dist.new_group(backend="gloo", timeout=timeout)
        return self._group

    def save(self, engine: tp.Any, step: int, trainer_state: dict[str, tp.Any], block: bool = False) -> float:
        """Start a checkpoint of `step` (and finish the previous one first); with `block`, or
        when the engine writes synchronously, return only once it is visible. Returns the seconds
        training was stalled."""
        start = time.perf_counter()
        self.wait()
        final = rundir.step_dir(self.root, step)
        tmp = rundir.partial_step_dir(self.root, step)
        if self.env.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a killed save of the same step
            tmp.mkdir()
        self._barrier()
        # this rank's small state first: the engine's write completes after it on every rank
        buffer = serialise({**trainer_state, "rng": rng_state(), "rank": self.env.rank})
        atomic_write(rundir.trainer_state(tmp, self.env.rank), buffer)
        pending = _Save(step, tmp, final, start)
        if self.asynchronous and hasattr(engine, "save_async"):
            pending.future = engine.save_async(rundir.engine_state(tmp), self._writer_group())
            pending.future.add_done_callback(lambda _: setattr(pending, "durable_at", time.perf_counter()))
        else:
            engine.save(rundir.engine_state(tmp))
            self._barrier()
        self._pending = pending
        if block or pending.future is None:
            self.wait()
        return time.perf_counter() - start

    @property
    def busy(self) -> bool:
        """Whether a save is still being written, now (as `Snapshots.busy`): one written but not yet
        made visible by `poll` is not."""
        pending = self._pending
        return pending is not None and (pending.future is None or not pending.future.done())

    def poll(self) -> None:
        """Between steps, no collective: make a finished background save visible. A failed one
        is left for the next `save`/`wait`, where every rank raises its error at the same step."""
        pending = self._pending
        if pending and pending.future and pending.future.done() and pending.future.exception() is None:
            self._complete()

    def wait(self) -> None:
        """Block until the save in flight, if any, is visible; raise what its write raised."""
        if self._pending:
            self._complete()

    def _complete(self) -> None:
        pending, self._pending = self._pending, None
        assert pending is not None
        if pending.future is not None:
            # DCP's coordinator finishes (and every rank's future completes) only after it has
            # gathered every rank's write result: done here means all ranks' files are durable,
            # and a failure on any rank is raised on every rank.
            pending.future.result()
        self.write_times.append((pending.durable_at or time.perf_counter()) - pending.started)
        if self.env.is_main:
            self._publish(pending)
        if pending.future is None:
            self._barrier()

    def _publish(self, pending: _Save) -> None:
        manifest = {
            "step": pending.step,
            "complete": True,
            "world_size": self.env.world_size,
            "strategy": self.strategy,
            "hpcrun": __version__,
            "created": time.time(),
        }
        atomic_write(rundir.manifest(pending.tmp), json.dumps(manifest, indent=1))
        if pending.final.exists():  # the same step saved before a requeue: keep the old, equal one
            shutil.rmtree(pending.tmp)
        else:
            os.rename(pending.tmp, pending.final)
        fsync_dir(self.root)
        self._prune()

    def _prune(self) -> None:
        for _, path in complete(self.root)[: -self.keep]:
            shutil.rmtree(path, ignore_errors=True)
        for leftover in rundir.partial_step_dirs(self.root):
            shutil.rmtree(leftover, ignore_errors=True)

    def load(self, engine: tp.Any, path: Path) -> dict[str, tp.Any]:
        """Restore `engine` and this rank's RNG from `path`; returns the trainer state. At another
        world size (resharding) the RNG of rank 0 is not forced on other ranks: only the model,
        optimizer and step carry over."""
        engine.load(rundir.engine_state(path))
        manifest = json.loads(rundir.manifest(path).read_text())
        same_world = manifest["world_size"] == self.env.world_size
        state = torch.load(rundir.trainer_state(path, self.env.rank if same_world else 0), weights_only=True)
        if same_world:
            set_rng_state(state["rng"])
        return state


def state_digest(state: tp.Mapping[str, torch.Tensor]) -> str:
    """sha256 over a full state dict's tensors in name order (as fp32): equal weights, equal digest."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().cpu().contiguous().float().numpy().tobytes())
    return h.hexdigest()


def consolidate(run_dir: Path, step: int | None = None) -> tuple[Path, str]:
    """One fp32 state dict (`consolidated-step-N.pt`) from the newest complete checkpoint (or
    `step`): ZeRO partitions through DeepSpeed's zero_to_fp32, DCP shards through torch's
    converter. Runs on one process, without the job's world size. Returns (file, digest).
    The file appears whole or not at all, and a failure leaves no temporary file behind."""
    run = RunDir(run_dir)
    root = run.checkpoints
    found = dict(complete(root))
    if not found:
        raise FileNotFoundError(f"{root}: no complete checkpoint")
    chosen = step if step is not None else max(found)
    path = found[chosen]
    manifest = json.loads(rundir.manifest(path).read_text())
    out = run.consolidated(chosen)
    with atomic_path(out) as tmp:
        if manifest["strategy"] == "deepspeed":
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            tag_dir = rundir.engine_state(path) / rundir.ENGINE_STATE
            with zeroinfinity.readable(tag_dir, out.parent, f".{out.name}.") as saved:  # it reads no swap file
                state = get_fp32_state_dict_from_zero_checkpoint(str(saved.parent), tag=saved.name)
        else:
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

            # torch's converter writes the whole checkpoint (optimizer too) to one file; the
            # model part then replaces it under the same temporary name
            dcp_to_torch_save(str(rundir.engine_state(path)), str(tmp))
            state = torch.load(tmp, weights_only=True)["model"]
        torch.save(state, tmp)
    return out, state_digest(state)


def serialise(obj: tp.Any) -> bytes:
    """torch.save's bytes of `obj` (a rank's trainer state), for an atomic write."""
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
