"""The engines strategies build (hpcrun.strategies): torch's DDP/FSDP or a DeepSpeed engine
behind one small interface (hpcrun.strategies.contract `Engine`): a micro-step, an optimizer
step, a save/load of the full training state into a directory, and the whole model's weights
for export."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
import typing as tp
from concurrent.futures import Future
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.staging import AsyncStager

from hpcrun.rundir import ENGINE_STATE, UNIVERSAL, fsync_dir, fsync_tree
from hpcrun.runtime import checkpoint
from hpcrun.runtime.env import DistEnv
from hpcrun.runtime.snapshotbuffers import BufferState, SnapshotBuffers

if tp.TYPE_CHECKING:  # the shapes strategies and engines agree on; the recipe itself is not known here
    from hpcrun.strategies.contract import Settings

CONVERSION_WAIT_S = 2 * 3600  # the longest rank 0 may take to convert a checkpoint for another world size
AUTOCAST = {"fp32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def block_classes(model: nn.Module) -> set[type[nn.Module]]:
    """Transformer blocks are what sits in a ModuleList; FSDP wraps each one on its own."""
    return {type(child) for m in model.modules() if isinstance(m, nn.ModuleList) for child in m}


class TorchEngine:
    """DDP or FSDP with torch's own optimizer, autocast and (fp16) loss scaling."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        recipe: Settings,
        env: DistEnv,
        raw: nn.Module,
        settle_buckets: bool = False,
        replicated: bool = False,
    ) -> None:
        self.model, self.optimizer, self.recipe, self.env, self.raw = model, optimizer, recipe, env, raw
        self.replicated = replicated  # every rank holds the same state: a snapshot keeps one copy per node (Option)
        self.unsettled = settle_buckets  # DDP: its buckets are laid out again before the attempt's first real step
        self.dtype = AUTOCAST[recipe.precision]
        self.scaler = torch.amp.GradScaler(env.device.type) if recipe.precision == "fp16-mixed" else None
        # what each micro-batch's loss is divided by: the recipe's accumulation, or after a shrink every
        # micro-batch of the global batch over the ranks left (hpcrun.runtime.context)
        self.accum: float = recipe.training.grad_accum
        self.sync_every = False  # reduce every micro-batch's gradients (a shrunk sharded state: no_sync's
        # full gradients on top of larger shards would not fit where the plan said)
        self._stager: AsyncStager | None = None
        self._snapshot_stager: AsyncStager | None = None
        self.snapshot_buffers = SnapshotBuffers()  # what snapshots copy into, and where they are in their life
        # CUDA: snapshots copy to host on a stream of their own, beside the next step's forward and
        # backward; the optimizer step (the first to change the parameters) waits for the copy, and
        # so does the forward of a model with buffers (running statistics, DDP's broadcast change them).
        # Parameters changed outside optimizer_step (an EMA in a user's loop) are not waited for.
        self._buffers_change = any(True for _ in raw.buffers())
        self._snapshot_stream = torch.cuda.Stream(env.device) if env.device.type == "cuda" else None
        self._snapshot_copied: torch.cuda.Event | None = None
        self.grad_norm: torch.Tensor | None = None  # of the last optimizer step, when clipping computes it
        # held through each optimizer step, which `updates` counts: a survivor's save (hpcrun.runtime.snapshotsurvivor)
        # from another thread takes it, and so never reads a half-updated state
        self.update_lock = threading.Lock()
        self.updates = 0
        self.torn = False  # an optimizer step raised partway: the state is no step's
        # CUDA: where the last optimizer step's writes end, for a survivor's copy on a stream of its own
        # (the default stream may wait on a collective that never completes)
        self._updated: torch.cuda.Event | None = None

    def micro_step(self, tokens: torch.Tensor, targets: torch.Tensor, last: bool, weight: float = 1.0) -> float:
        """One micro-batch's forward and backward; `weight` 0: its gradients count for nothing (a shrunk
        sharded state's padding, hpcrun.runtime.context `padding`)."""
        if self._snapshot_copied is not None and self._buffers_change:  # forward writes buffers the copy reads
            torch.cuda.current_stream(self.env.device).wait_event(self._snapshot_copied)
        if self.unsettled:
            self.unsettled = False
            self.settle_buckets(tokens, targets)
        # skip the gradient all-reduce on all but the last micro-batch of an accumulation
        sync = (
            contextlib.nullcontext() if last or self.accum == 1 or self.sync_every
            else tp.cast(tp.Any, self.model).no_sync()
        )  # DDP and FSDP both have it
        with sync:
            with self.autocast():
                loss = self.model(tokens, targets)
            scaled = loss / self.accum if weight == 1.0 else loss * weight / self.accum
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        return loss.item()

    def autocast(self) -> tp.ContextManager[tp.Any]:
        return torch.autocast(self.env.device.type, dtype=self.dtype) if self.dtype else contextlib.nullcontext()

    def settle_buckets(self, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        """One forward and backward whose results are thrown away, so that DDP lays its gradient
        buckets out for good before the attempt's first real step. DDP reduces its first iteration
        in one layout (all parameters in one bucket) and re-lays its buckets at the next forward,
        in the order gradients became ready; the summation order of every element depends on the
        layout, so without this a resumed attempt's first step would reduce in another layout
        than the same step of a run never stopped (at 3 or more ranks: other last bits, then
        drift). Every attempt, the first included, settles the same way, so every real step of
        every attempt reduces in the same layout. The step then computes exactly what it would
        have: the RNG streams and module buffers (batch-norm statistics) the throwaway pass may
        advance are put back, its gradients dropped, the optimizer untouched."""
        rng = checkpoint.rng_state()  # every stream a checkpoint restores, Python's `random` included
        buffers = [b.detach().clone() for b in self.model.buffers()]
        with self.autocast():
            loss = self.model(tokens, targets)
        loss.backward()
        checkpoint.set_rng_state(rng)
        with torch.no_grad():
            for buffer, saved in zip(self.model.buffers(), buffers):
                buffer.copy_(saved)
        self.model.zero_grad(set_to_none=True)

    def optimizer_step(self) -> None:
        with self.update_lock:
            try:
                self._optimizer_step()
            except BaseException:
                self.torn = True
                raise
            self.updates += 1
            if self.env.device.type == "cuda":
                self._updated = torch.cuda.Event()
                self._updated.record()

    def _optimizer_step(self) -> None:
        if self._snapshot_copied is not None:  # a snapshot's copy to host still reads the state
            torch.cuda.current_stream(self.env.device).wait_event(self._snapshot_copied)
        clip = self.recipe.training.grad_clip
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        if clip:  # the norm before clipping, kept (a tensor: no sync here) for the steps table
            if hasattr(self.model, "clip_grad_norm_"):  # FSDP: the norm spans every shard
                self.grad_norm = tp.cast(tp.Any, self.model).clip_grad_norm_(clip)
            else:
                self.grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _state(self) -> dict[str, tp.Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state: dict[str, tp.Any] = {"model": model_sd, "optim": optim_sd}
        if self.scaler:
            state["scaler"] = self.scaler.state_dict()
        return state

    def save(self, directory: Path) -> None:
        """Sharded with torch.distributed.checkpoint: every rank writes its part, and the result
        loads at another world size."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(), storage_writer=checkpoint.DcpWriter(directory))

    def save_async(self, directory: Path, group: tp.Any) -> Future[tp.Any]:
        """`save` with only the copy to host memory on the caller's time; the write runs in a
        background thread whose collectives use `group` (gloo). The future completes on every
        rank once every rank's part is durable and DCP's metadata is written."""
        import torch.distributed.checkpoint as dcp

        if self._stager is None:  # one per engine: its host buffers are reused from save to save
            from torch.distributed.fsdp import FullyShardedDataParallel

            self._stager = checkpoint.host_stager(sharded_tensors=isinstance(self.model, FullyShardedDataParallel))
        return dcp.async_save(
            self._state(),
            storage_writer=checkpoint.DcpWriter(directory),
            process_group=group,
            async_stager=self._stager,
        )  # type: ignore[return-value]

    def prepare_snapshot(self, keep: bool = True) -> SnapshotBuffers:
        """Allocate the host buffers of the first snapshot on a thread of their own, before it is
        due: on a GPU they are pinned, and pinning a 1.3b model's 15.6 GB held the training
        thread ~4 s (torch.empty releases the GIL while it allocates). The thread sees only the
        state's shapes and dtypes (meta tensors), never the live optimizer. Returns the buffers,
        whose state says where they are: READY with nothing allocated aside where another rank
        keeps this node's copy, FSDP's stager keeps its own buffers, or they exist; UNASKED while
        the optimizer has no state yet (an fp16 run's skipped first step): taking the state then
        would step it."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        buffers = self.snapshot_buffers
        if not keep or isinstance(self.model, FullyShardedDataParallel) or buffers.tensors is not None:
            buffers.none_aside()
        elif self.optimizer.state and buffers.state is BufferState.UNASKED:
            shapes = checkpoint.meta_like(self._state())
            pinned = self.env.device.type == "cuda"
            buffers.allocate(lambda: checkpoint.allocate_like(shapes, pinned))
        return buffers

    def snapshot_state(self, keep: bool = True) -> dict[str, tp.Any] | None:
        """This rank's state for an in-memory snapshot (hpcrun.runtime.snapshot), copied into host
        buffers reused from snapshot to snapshot: once this returns training may change the
        state, and the copy stays as it is until the next snapshot, which starts only after the
        previous one is written. Plain tensors are copied one `copy_` each (DCP's DefaultStager
        took ~3 ms for the built-in tiny model's 112 tensors, the snapshot's whole stall budget);
        FSDP's ShardedTensors go through the stager of a disk save. Without `keep` (another rank
        keeps this node's copy) nothing is copied, but the state is still taken: torch's
        get_state_dict gives an optimizer with no state yet a zero step, which every rank must take."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        state = self._state()
        if not keep:
            return None
        buffers = self.snapshot_buffers
        try:
            buffers.take()  # those allocated aside: ready by the cadence's agreement (`Snapshots.busy` until then)
        except Exception as exc:  # noqa: BLE001 - copy_into allocates them here instead
            print(f"[hpcrun rank {self.env.rank}] snapshot buffers not allocated aside: {exc}", flush=True)
        if isinstance(self.model, FullyShardedDataParallel):
            if self._snapshot_stager is None:
                self._snapshot_stager = checkpoint.host_stager(sharded_tensors=True)
            return tp.cast(dict[str, tp.Any], self._snapshot_stager.stage(state))
        if self._snapshot_stream is None:
            buffers.tensors = checkpoint.copy_into(state, buffers.tensors)
            return tp.cast(dict[str, tp.Any], buffers.tensors)
        self._snapshot_stream.wait_stream(torch.cuda.current_stream(self.env.device))  # the step's last writes
        with torch.cuda.stream(self._snapshot_stream):
            buffers.tensors = checkpoint.copy_into(state, buffers.tensors, non_blocking=True)
            self._snapshot_copied = torch.cuda.Event()
            self._snapshot_copied.record(self._snapshot_stream)
        return tp.cast(dict[str, tp.Any], buffers.tensors)

    def write_survivor(self, directory: Path, threads: int) -> None:
        """A survivor's save (hpcrun.runtime.snapshotsurvivor), holding `update_lock`: the live state
        written as `write_snapshot` writes a snapshot, with no collective. On CUDA it is first copied
        to host on a stream of its own that waits only for the last optimizer step's writes: the
        default stream may wait on a collective that never completes."""
        state = self._state()
        if self._updated is not None:
            side = torch.cuda.Stream(self.env.device)
            side.wait_event(self._updated)
            with torch.cuda.stream(side):
                state = checkpoint.copy_into(state, None)
            side.synchronize()
        self.write_snapshot(state, directory, threads=threads)

    def write_snapshot(self, state: dict[str, tp.Any], directory: Path, threads: int = 1) -> None:
        """Write a `snapshot_state` into `directory` on node-local scratch: the same DCP save as a
        checkpoint, with no collective (`no_dist`), so each rank's directory holds all that rank
        loads (a collective save writes DDP's replicated tensors once, on rank 0's node)."""
        import torch.distributed.checkpoint as dcp

        if self._snapshot_copied is not None:  # the side stream's copy into these buffers
            self._snapshot_copied.synchronize()
        # tmpfs: no fsync, and by default one thread (a memcpy) that leaves the cores to training
        dcp.save(state, storage_writer=checkpoint.DcpWriter(directory, sync_files=False, threads=threads), no_dist=True)

    def load(self, directory: Path, local: bool = False) -> None:
        """Restore from a checkpoint (collective), or with `local` from this rank's snapshot."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state()
        dcp.load(state, checkpoint_id=str(directory), no_dist=local)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if self.scaler:
            self.scaler.load_state_dict(state["scaler"])

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict on CPU under the unwrapped model's names (collective:
        FSDP gathers its shards)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # cpu_offload on a CPU-only FSDP1 model segfaults in torch 2.13 (and gains nothing there)
        options = StateDictOptions(full_state_dict=True, cpu_offload=torch.cuda.is_available())
        state = tp.cast(dict[str, torch.Tensor], get_model_state_dict(self.model, options=options))
        return {k: v.detach().cpu() for k, v in state.items()}


class DeepSpeedEngine:
    """A DeepSpeed engine: it owns accumulation, clipping, loss scaling and its checkpoints."""

    def __init__(self, engine: tp.Any, accum: float) -> None:
        self.engine = engine
        self.model = engine
        self.optimizer = engine.optimizer
        # what each micro-batch's loss is divided by in all: as TorchEngine's (hpcrun.runtime.context sets it
        # after a shrink); DeepSpeed divides by its own accumulation steps, the rest is made up in micro_step
        self.accum = accum

    def micro_step(self, tokens: torch.Tensor, targets: torch.Tensor, last: bool, weight: float = 1.0) -> float:
        loss = self.engine(tokens, targets)
        scale = weight * self.engine.gradient_accumulation_steps() / self.accum  # 1 unless shrunk, 0 for padding
        self.engine.backward(loss if scale == 1.0 else loss * scale)
        self.engine.step()  # applies the update only at the accumulation boundary
        return loss.item()

    def optimizer_step(self) -> None:
        """Done inside `micro_step` by the engine itself."""

    @property
    def grad_norm(self) -> float | None:
        """The global gradient norm of the last optimizer step, as DeepSpeed computed it."""
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def save(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(directory), tag=ENGINE_STATE)

    def load(self, directory: Path) -> None:
        from hpcrun.runtime import zeroinfinity

        tag, swapping = ENGINE_STATE, self.engine.zero_nvme_offload_optimizer()
        if self.engine.load_universal_checkpoint():  # saved by another world size (DeepSpeed.build): converted
            tag = self.universal(directory)
            if swapping:  # DeepSpeed's own loader of it fails on a swapped sub-group
                zeroinfinity.reshard(self.engine, directory / tag)
                return
        path, _ = self.engine.load_checkpoint(str(directory), tag=tag)
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint in {directory}")
        if swapping:  # what DeepSpeed's own load leaves out
            zeroinfinity.restore(self.engine, directory / tag)

    def universal(self, directory: Path) -> str:
        """The checkpoint in `directory` as DeepSpeed's universal checkpoint, which loads at any world
        size (ZeRO-1, -2, -3): converted by rank 0 with DeepSpeed's own tool beside the saved files (kept for
        a later shrink of the same checkpoint), then every rank goes on. Returns its tag."""
        import datetime as dt

        import torch.distributed as dist

        from hpcrun.runtime import zeroinfinity

        # a large model's conversion takes minutes (the tool reads every partition): the others wait in a
        # barrier of their own that long; a failed conversion ends rank 0, and their barrier with it
        waiting = dist.new_group(backend="gloo", timeout=dt.timedelta(seconds=CONVERSION_WAIT_S))
        target = directory / UNIVERSAL
        if dist.get_rank() == 0 and not target.exists():
            for left in [*directory.glob(f"{UNIVERSAL}.partial-*"), *directory.glob(f"{UNIVERSAL}.filled-*")]:
                shutil.rmtree(left, ignore_errors=True)
            partial = directory / f"{UNIVERSAL}.partial-{os.getpid()}"
            tool, began = "deepspeed.checkpoint.ds_to_universal", time.monotonic()
            # --inject_missing_state: the metadata only a Megatron-style client saves, empty for a plain model
            with zeroinfinity.readable(directory / ENGINE_STATE, directory, f"{UNIVERSAL}.filled-", True) as saved:
                out = subprocess.run(
                    [sys.executable, "-m", tool, "--input_folder", str(saved), "--output_folder", str(partial),
                     "--inject_missing_state"],
                    capture_output=True, text=True,
                )
            if out.returncode != 0:
                raise RuntimeError(f"{tool} failed (exit {out.returncode}): {out.stderr.strip()[-2000:]}")
            # durable before it is named: a later attempt trusts `target` without converting again
            fsync_tree(partial)
            os.rename(partial, target)
            fsync_dir(directory)
            (directory / "latest_universal").unlink(missing_ok=True)  # the tool's pointer to the partial name
            print(f"[hpcrun rank 0] {directory.parent.name} converted to DeepSpeed's universal checkpoint for "
                  f"{dist.get_world_size()} ranks in {time.monotonic() - began:.1f} s", file=sys.stderr, flush=True)
        dist.barrier(group=waiting)
        dist.destroy_process_group(waiting)
        return UNIVERSAL

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on CPU (collective: ZeRO-3 gathers its partitions)."""
        import deepspeed

        module = self.engine.module
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}

