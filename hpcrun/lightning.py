"""hpcrun's side of a Lightning script it runs: a Trainer callback Lightning loads by itself.

hpcrun registers `callbacks` under Lightning's `lightning.pytorch.callbacks_factory` entry
point, so every `Trainer` built inside a command job run by hpcrun (HPCRUN_RUN_DIR set) gets
`HpcrunStop` without a line of the script changed; anywhere else the factory returns nothing.
hpcrun itself never imports this module (Lightning is an optional extra).

Who handles what, so that one signal means exactly one save and one requeue:
- hpcrun owns the requeue. SLURM sends USR2 (hpcrun's `--signal=USR2@lead`), never USR1, so
  Lightning's own auto-requeue (a USR1 handler that saves and runs `scontrol requeue` itself)
  never fires, and a job array is never requeued whole by it.
- During training this callback owns USR2 and SIGTERM: the handler only sets a flag. Lightning's
  own SIGTERM handler broadcasts inside the handler, which deadlocks when the signal reaches
  ranks at different points of a step (one in a collective, one not); this callback's flag is
  agreed on by all ranks at the end of every batch that ended an optimizer step (one tiny
  all-reduce; never between accumulated micro-batches), then all
  ranks save Lightning's HPC checkpoint (`hpc_ckpt_<n>.ckpt` in the Trainer's root, which hpcrun
  points at the run's directory) and leave `fit` by SystemExit, before any code after `fit`
  could take the stop for the end of training.
- On the requeued attempt Lightning resumes from that checkpoint by itself (under SLURM, with
  `ckpt_path=None`, it loads the newest HPC checkpoint): the global step continues.

It also reports rank 0's steps (global step, loss, total) to hpcrun through $HPCRUN_METRICS
(hpcrun.runtime.reported), so a Lightning run has hpcrun's per-step table and results row.
"""

from __future__ import annotations

import collections.abc
import json
import math
import os
import re
import shutil
import signal
import time
import typing as tp

import lightning.pytorch as pl

from hpcrun.rundir import LIGHTNING_PARTIAL

HPC_CHECKPOINT = re.compile(r"^hpc_ckpt_(\d+)\.ckpt$")  # Lightning's HPC checkpoint names


def callbacks() -> list[pl.Callback]:
    """The entry point: hpcrun's callback inside an hpcrun command job, nothing elsewhere."""
    return [HpcrunStop()] if "HPCRUN_RUN_DIR" in os.environ else []


class HpcrunStop(pl.Callback):
    def __init__(self) -> None:
        self.signum = 0
        self.previous: dict[int, tp.Any] = {}
        self.metrics = os.environ.get("HPCRUN_METRICS")
        self.reported_step = -1
        self.decided_step = -1

    def _handle(self, signum: int, frame: tp.Any) -> None:
        self.signum = signum

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after Lightning registered its handlers for this fit; its teardown restores the originals
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            self.previous[sig] = signal.signal(sig, self._handle)
        self.decided_step = self.reported_step = (
            trainer.global_step
        )  # steps done before this fit (a resume) are not new

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: tp.Any, batch: tp.Any, batch_idx: int
    ) -> None:
        if trainer.is_global_zero:
            self._report(trainer, outputs)
        if trainer.global_step == self.decided_step:
            return  # a batch that only accumulated gradients: a save here would lose them (every rank skips it alike)
        self.decided_step = trainer.global_step
        if not trainer.strategy.reduce_boolean_decision(bool(self.signum), all=False):
            return
        root = str(trainer.default_root_dir)
        final = os.path.join(root, f"hpc_ckpt_{next_version(root)}.ckpt")  # every rank, before anyone renames
        partial = os.path.join(root, LIGHTNING_PARTIAL)  # not an `hpc_ckpt_` name: Lightning never picks it
        trainer.save_checkpoint(partial)  # collective; returns after its barrier
        if trainer.is_global_zero:
            os.replace(partial, final)
            if _inside(root, os.environ["HPCRUN_RUN_DIR"]):  # never another run's files, in a root the script shares
                prune(root)
            print(
                f"[hpcrun] {signal.Signals(self.signum).name if self.signum else 'a peer'}'s stop: saved {final} "
                f"at global step {trainer.global_step}; leaving fit for requeue",
                flush=True,
            )
        raise SystemExit(0)

    def _report(self, trainer: pl.Trainer, outputs: tp.Any) -> None:
        if not self.metrics or trainer.global_step == self.reported_step:
            return  # only optimizer steps: batches accumulating gradients do not count
        self.reported_step = trainer.global_step
        line: dict[str, tp.Any] = {"step": trainer.global_step, "time": time.time()}
        loss = outputs.get("loss") if isinstance(outputs, collections.abc.Mapping) else outputs
        if loss is not None and hasattr(loss, "item"):
            line["loss"] = float(loss.item())
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else trainer.estimated_stepping_batches
        if isinstance(total, (int, float)) and math.isfinite(total):
            line["total"] = int(total)
        with open(self.metrics, "a") as f:
            f.write(json.dumps(line) + "\n")


def prune(root: str, keep: int = 2) -> None:
    """Remove all but the `keep` newest HPC checkpoints in `root`: one full checkpoint per requeue
    would fill the disk. Lightning resumes from the newest; the one before it stays as the
    fallback should the newest not have reached the disk whole (the save is not fsynced). A
    removal that fails is a line in the log: the stop goes on."""
    found = sorted(
        ((int(m.group(1)), name) for name in os.listdir(root) if (m := HPC_CHECKPOINT.match(name))), reverse=True
    )
    for _, name in found[keep:]:
        path = os.path.join(root, name)
        try:
            if os.path.isdir(path):  # a sharded (FSDP, DeepSpeed) checkpoint is a directory
                shutil.rmtree(path)
            else:
                os.remove(path)
        except OSError as exc:
            print(f"[hpcrun] could not remove the older checkpoint {path}: {exc}", flush=True)


def _inside(path: str, directory: str) -> bool:
    return os.path.realpath(path).startswith(os.path.realpath(directory) + os.sep)


def next_version(root: str) -> int:
    """The number Lightning's next HPC checkpoint in `root` takes (it resumes from the highest)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return 1
    found = [int(m.group(1)) for m in map(HPC_CHECKPOINT.match, names) if m]
    return max(found, default=0) + 1
