"""The training loop's side of a run attempt: what a user's `module:function` receives.

The built-in benchmark is written against the same Context, so every strategy and every user
job share one loop and one fault-tolerance path: resume, periodic checkpoints, and the collective
decision to stop at a step boundary when a signal arrived.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import signal
import sys
import time
import typing as tp

import torch
import torch.distributed as dist

from hpcrun.plan import RunSpec
from hpcrun.recipe import EntrypointJob
from hpcrun.rundir import RunDir, local_scratch, nvme_job_dir
from hpcrun.runtime import checkpoint as ckpt
from hpcrun.runtime import schedule, snapshot
from hpcrun.runtime.env import DistEnv
from hpcrun.runtime.metrics import Measurements
from hpcrun.runtime.schedule import SaveSchedule
from hpcrun.runtime.steps import StepRecorder
from hpcrun.runtime.watchdog import Watchdog
from hpcrun.signals import SignalFlag
from hpcrun.strategies.contract import Engine, OptimizerFactory


class Context:
    """What a user's `module:function` receives: ranks, device, `setup`, `steps`, `log`."""

    def __init__(self, spec: RunSpec, env: DistEnv, flag: SignalFlag) -> None:
        self.spec, self.env, self.flag = spec, env, flag
        self.run_dir = RunDir(spec.run_dir)
        self.recipe = spec.recipe
        self.args: dict[str, tp.Any] = spec.recipe.job.args if isinstance(spec.recipe.job, EntrypointJob) else {}
        self.rank, self.local_rank, self.world_size, self.device = env.rank, env.local_rank, env.world_size, env.device
        checkpoint = spec.recipe.checkpoint
        self.checkpoints = ckpt.Checkpoints(
            self.run_dir.checkpoints, env, checkpoint.keep, spec.strategy.name, checkpoint.asynchronous
        )
        self.snapshots: snapshot.Snapshots | None = None  # built by `setup`, for an engine that keeps them
        self.resumed_from: str | None = None  # memory, replica or disk: the results row's `resumed_from`
        self.measured = Measurements()
        self.engine: tp.Any = None
        self.start_step = 0
        self.step = 0
        self.stopped: str | None = None
        self.started = dt.datetime.now(dt.timezone.utc)
        self.restored_losses: list[float] = []  # global losses of earlier attempts
        self.step_metrics: dict[str, float] = {}  # what `log` was given during the current step
        self.recorder: StepRecorder | None = None
        # the training thread's time in each part of hpcrun's per-step work, saves apart
        self.own_s = dict.fromkeys(("stop vote", "checkpoint poll", "metrics", "watchdog"), 0.0)
        self.vote = StopVote(env, flag)
        self.cadence: list[SaveSchedule] = []  # how this attempt spaces its saves (`steps`)
        # run once the attempt's results row and state.json are written (a function job's result
        # pickle: whoever sees the result finds the run's record already there)
        self.when_recorded: list[tp.Callable[[], None]] = []

    @property
    def nvme_dir(self) -> str | None:
        """This job's own directory on node-local NVMe, when the strategy swaps to it."""
        if self.spec.nvme_dir is None:
            return None
        return nvme_job_dir(self.spec.nvme_dir, self.env.allocation_id)

    def setup(self, model: torch.nn.Module, make_optimizer: OptimizerFactory) -> Engine:
        """Wrap `model` in the recipe's strategy, build the optimizer, and resume from the newest
        complete checkpoint of this run if there is one."""
        found = ckpt.latest(self.checkpoints.root)
        if not found and self.spec.init_weights:  # a stage starting from the previous stage's weights
            model.load_state_dict(torch.load(self.spec.init_weights, map_location="cpu", weights_only=True))
            self.info(f"initialised from {self.spec.init_weights}")
        self.engine = self.recipe.strategy.build(
            model, make_optimizer, self.recipe, self.env, self.spec.run_dir, self.nvme_dir
        )
        if self.spec.takes_snapshots:
            self.snapshots = self.snapshots_of(self.engine)
        restored = self.snapshots.restore(self.engine, found[0] if found else 0) if self.snapshots else None
        if restored:
            state, self.resumed_from = restored.state, restored.source
        elif found:
            state, self.resumed_from = self.checkpoints.load(self.engine, found[1]), "disk"
        if restored or found:
            self.start_step = int(state["step"])
            self.restored_losses = list(state.get("losses", []))
            if "rank_losses" in state:  # a snapshot's: the mean over ranks, as global_losses takes it
                self.measured.losses = list(state["rank_losses"])
                self.restored_losses = self.global_losses()
                self.measured.losses = []
            where = f"{restored.source} snapshot" if restored else f"disk checkpoint {found[1]}" if found else ""
            if self.env.is_main:  # one line on stderr, where a restart is looked for
                print(f"[hpcrun rank 0] resumed from {where} (step {self.start_step})", file=sys.stderr, flush=True)
        return self.engine

    def steps(self) -> tp.Iterator[int]:
        """Step numbers from where this run left off. Between steps: the step's metrics
        (hpcrun.runtime.steps), disk checkpoints and in-memory snapshots when their cadence
        (hpcrun.runtime.schedule) says, and the collective decision to stop on a signal
        (checkpoint, then leave the loop)."""
        total = self.recipe.training.steps
        self.recorder = recorder = StepRecorder(self, total)
        env = self.env
        watchdog = Watchdog(
            self.run_dir, env.job_id, env.attempt, env.rank, env.world_size, self.recipe.fault.hang_timeout_s
        )
        disk, memory = self.schedules()
        warmup = self.recipe.training.warmup_steps
        try:
            self.measured.mark(warmup)  # the wall clock the results row's wall_tokens_per_s is measured on
            for step in range(self.start_step, total):
                self.step = step
                self.step_metrics = {}
                recorded = len(self.measured.losses)
                start = time.perf_counter()
                yield step
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                parts = [time.perf_counter()]  # from here to the save (or the next step): hpcrun's own work
                done = step + 1
                stop, flush, probing = self.vote.step_end(done, total, parts[0] - start, recorder)
                parts.append(time.perf_counter())
                self.checkpoints.poll()
                parts.append(time.perf_counter())
                saving = done == total or bool(stop)
                periodic = not saving and disk.due(done, self.start_step) and disk.decide(done, self.checkpoints.busy)
                saving = saving or periodic
                loss = self.measured.losses[-1] if len(self.measured.losses) > recorded else None
                recorder.record(done, parts[-1] - start, loss, self.step_metrics)
                if flush or saving:  # every checkpointed step is in the steps table before its checkpoint
                    recorder.flush(probing=probing)
                parts.append(time.perf_counter())
                # a step's time includes hpcrun's own per-step work and a flush; a save's stall is counted apart
                self.measured.step_times.append(parts[-1] - start)
                watchdog.beat(step, self.measured.step_times[-1])
                parts.append(time.perf_counter())
                for part, began, ended in zip(self.own_s, parts, parts[1:]):
                    self.own_s[part] += ended - began
                if self.snapshots and self.snapshots.prepare_pending and not saving:  # from the first step on
                    self.snapshots.prepare(self.engine)
                snapshot_busy, disk_busy = bool(self.snapshots and self.snapshots.busy), self.checkpoints.busy
                disk.observe(self.measured.step_times[-1], disk_busy, disk_busy or snapshot_busy)
                if memory:
                    memory.observe(self.measured.step_times[-1], snapshot_busy, disk_busy or snapshot_busy)
                if saving:
                    with watchdog.saving():  # a long save is not a hang
                        stall = self.save(done, block=done == total or bool(stop))
                    if periodic:
                        disk.started(stall)
                elif memory and memory.due(done, self.start_step) and memory.decide(done, snapshot_busy):
                    with watchdog.saving():
                        memory.started(self.snapshot(done))
                self.measured.mark(warmup)
                if stop and done < total:
                    self.stopped = signal.Signals(stop).name
                    self.info(f"{self.stopped}: saved step {done}, stopping for requeue")
                    return
            self.step = total
        finally:
            watchdog_cpu = watchdog.stop()
            recorder.close()
            # what the harness costs, apart from the machine's noise (benchmarks/training_overhead.py)
            if self.measured.step_times:
                stepped, own = sum(self.measured.step_times), sum(self.own_s.values())
                shares = ", ".join(f"{part} {100 * s / stepped:.3f}%" for part, s in self.own_s.items())
                snapshots = ""
                if self.snapshots and self.snapshots.stalls:  # the same line: a log's last lines are the steps'
                    stalls = self.snapshots.stalls
                    later = f", then {1e3 * sum(stalls[1:]) / (len(stalls) - 1):.1f} ms each" if len(stalls) > 1 else ""
                    aside = " (buffers allocated aside)" if self.snapshots.prepared else ""
                    snapshots = (
                        f"; in-memory snapshots: {len(stalls)}{aside}, the first {1e3 * stalls[0]:.1f} ms{later} "
                        f"on the training thread ({100 * sum(stalls) / stepped:.3f}% of step time), "
                        f"{self.snapshots.failures} failed"
                    )
                saves = "".join(f"; {line}" for line in self.cadence_lines())
                self.info(
                    f"hpcrun's per-step work: {own * 1e3:.1f} ms on the training thread "
                    f"over {len(self.measured.step_times)} steps "
                    f"({100 * own / stepped:.3f}% of step time: {shares}); "
                    f"watchdog thread {watchdog_cpu * 1e3:.1f} ms of CPU ({100 * watchdog_cpu / stepped:.3f}%)"
                    + snapshots + saves
                )

    def snapshots_of(self, engine: tp.Any) -> snapshot.Snapshots | None:
        """In-memory snapshots of `engine`'s state, when it keeps them (DeepSpeed's does not: its
        ranks then build none, nor their gloo group). Collective."""
        if not hasattr(engine, "snapshot_state"):
            self.info("this strategy's engine keeps no in-memory snapshots: disk checkpoints only")
            return None
        spec = self.spec
        return snapshot.Snapshots(
            local_scratch(spec.local_scratch), spec.run_id, self.env, spec.recipe.fault.collective_timeout_s,
            on_slurm=spec.scheduler == "slurm",
        )

    def schedules(self) -> tuple[SaveSchedule, SaveSchedule | None]:
        """The cadence of disk checkpoints (a save due waits for the one before) and, when this
        rank keeps them, of in-memory snapshots (one due while the last is in flight is skipped)."""
        def measured() -> float:
            return schedule.state_bytes(self.engine)

        # the disk's clock runs from its newest checkpoint, which a restart from memory is past
        on_disk = ckpt.latest(self.checkpoints.root)
        disk = SaveSchedule(
            self.spec.cadence("checkpoint"), self.env, skips=False, state_bytes=measured,
            last=on_disk[0] if on_disk else 0,
        )
        memory = (
            SaveSchedule(self.spec.cadence("snapshot"), self.env, skips=True, state_bytes=measured)
            if self.snapshots else None
        )
        self.cadence = [s for s in (disk, memory) if s is not None]
        return disk, memory

    def cadence_lines(self) -> list[str]:
        """How saves are spaced in this attempt, and what they cost (progress.json, the log)."""
        lines = []
        for kind in self.cadence:
            line = kind.explanation
            if kind.costs:
                line += f"; {len(kind.costs)} measured at {sum(kind.costs) / len(kind.costs):.2f} s each"
            if kind.skipped:
                line += f", {kind.skipped} skipped (the one before still in flight, or the buffers not yet allocated)"
            if line:
                lines.append(line)
        return lines

    def global_losses(self) -> list[float]:
        """The loss of every step so far on the global batch (collective: the mean over ranks
        of this attempt's per-rank losses, after the earlier attempts' restored ones)."""
        local = self.measured.losses
        if local and dist.is_initialized() and self.world_size > 1:
            t = torch.tensor(local, dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            local = (t / self.world_size).tolist()
        return self.restored_losses + list(local)

    def save(self, step: int, block: bool) -> float:
        """A disk checkpoint of `step`; returns the seconds training was held."""
        state = {"step": step, "losses": self.global_losses()}
        self.measured.checkpoint_saves.append(self.checkpoints.save(self.engine, step, state, block))
        return self.measured.checkpoint_saves[-1]

    def snapshot(self, step: int) -> float:
        """An in-memory snapshot of `step` (hpcrun.runtime.snapshot) with the trainer state a
        checkpoint holds (its losses as this rank's own of this attempt, after the earlier ones)."""
        assert self.snapshots is not None
        # this rank's own losses: their mean over ranks (global_losses) is taken at the restore, so
        # that a snapshot waits for no other rank
        state = {"step": step, "losses": self.restored_losses, "rank_losses": list(self.measured.losses)}
        self.measured.snapshot_stalls.append(self.snapshots.save(self.engine, step, state))
        return self.measured.snapshot_stalls[-1]

    def close_snapshots(self, status: str) -> None:
        """At the end of an attempt that did not fail, remove this run's snapshots: no restart in
        this job can use them (the training finished, or a stop requeues the job, which resumes
        from disk). A stop abandons the snapshot in flight rather than wait for it."""
        if self.snapshots is not None:
            self.snapshots.close(abandon=status != "completed")

    def record_loss(self, loss: float) -> None:
        self.measured.losses.append(loss)

    def log(self, **metrics: float) -> None:
        """User metrics: the step's row in the steps table (`extra`), and the results row's
        `extra` map (the last value of each)."""
        values = {k: float(v) for k, v in metrics.items()}
        self.step_metrics.update(values)
        self.measured.extra.update(values)

    def slow_ranks(self) -> str | None:
        """The ranks this attempt named slow (rank 0; the results row's `slow_ranks`)."""
        return self.recorder.slow_ranks() if self.recorder else None

    def info(self, message: str) -> None:
        if self.env.is_main or os.environ.get("HPCRUN_LOG_ALL_RANKS"):
            print(f"[hpcrun rank {self.rank}] {message}", flush=True)


class StopVote:
    """Every rank learns whether any rank was signalled to stop, and whether any wants the metrics
    flushed (and slow ranks probed) at the next flush: one tiny all-reduce (MAX), cast at one
    step's end and read where the next is cast, at least one step and EVERY_S later. Read at once,
    it would hold every step until the slowest rank arrived; read later it has long completed.
    Each vote also carries the slowest step any rank made since the vote before, from which every
    rank computes the same number of steps to the next one. The price: a stop signal is acted on up
    to two vote intervals after it arrives (README, "Stop latency"). Every rank reads the same
    result at the same step, so all stop together."""

    EVERY_S = 0.25  # the least time between votes: ~0.2 ms each, nothing measurable at this spacing

    def __init__(self, env: DistEnv, flag: SignalFlag) -> None:
        self.env, self.flag = env, flag
        self.pending: tuple[tp.Any, torch.Tensor] | None = None
        self.next_at: int | None = None  # the step (completed count) of the next vote; None: this one
        self.every = 1
        self.slowest_s = 0.0  # this rank's slowest step since its last cast

    def step_end(self, done: int, total: int, step_s: float, recorder: StepRecorder) -> tuple[int, bool, bool]:
        """At the end of step `done`: the signal number (0: none), the flush wish and the probe
        wish of the vote read here, if one is due (none at an attempt's first step)."""
        self.slowest_s = max(self.slowest_s, step_s)
        if self.next_at is not None and done < self.next_at:
            return 0, False, False
        signum, flush, probing, step_us = self._read()
        if step_us:
            self.every = max(1, math.ceil(self.EVERY_S * 1e6 / step_us))
        if not signum and done < total:
            self._cast(
                [
                    self.flag.signum or 0,
                    int(recorder.due(ahead=self.every)),
                    int(recorder.probe_due()),
                    round(self.slowest_s * 1e6),
                ]
            )
            self.slowest_s = 0.0
            self.next_at = min(done + self.every, total)  # the last step reads it: none left in flight
        return signum, flush, probing

    def _cast(self, votes: list[int]) -> None:
        local = torch.tensor(votes, dtype=torch.int64, device=self.env.device)
        work = (
            dist.all_reduce(local, op=dist.ReduceOp.MAX, async_op=True)
            if dist.is_initialized() and self.env.world_size > 1
            else None
        )
        self.pending = (work, local)

    def _read(self) -> tuple[int, bool, bool, int]:
        if self.pending is None:
            return 0, False, False, 0
        (work, votes), self.pending = self.pending, None
        if work is not None:
            work.wait()
        signum, flush, probing, step_us = votes.tolist()
        return int(signum), bool(flush), bool(probing), int(step_us)
