"""The training loop's side of a run attempt: what a user's `module:function` receives.

The built-in benchmark is written against the same Context, so every strategy and every user
job share one loop and one fault-tolerance path: resume, periodic checkpoints, and the collective
decision to stop at a step boundary when a signal arrived.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import os
import signal
import sys
import threading
import time
import typing as tp

import torch
import torch.distributed as dist

from hpcrun import slurm
from hpcrun.cadence import duration
from hpcrun.plan import RunSpec
from hpcrun.recipe import EntrypointJob
from hpcrun.rundir import RunDir, local_scratch, manifest, nvme_job_dir
from hpcrun.runtime import cadence, snapshot
from hpcrun.runtime import checkpoint as ckpt
from hpcrun.runtime.cadence import BALLOT, Cadence
from hpcrun.runtime.env import DistEnv
from hpcrun.runtime.metrics import Measurements
from hpcrun.runtime.pulse import Pulse
from hpcrun.runtime.steps import StepRecorder
from hpcrun.runtime.vote import StopVote
from hpcrun.runtime.watchdog import Watchdog
from hpcrun.signals import SignalFlag
from hpcrun.strategies.contract import Engine, OptimizerFactory

SURVIVOR_WAIT_S = 2.0  # for the optimizer step in progress, before a survivor's save (an optimizer step is short)


class Context:
    """What a user's `module:function` receives: ranks, device, `setup`, `steps`, `log`."""

    def __init__(self, spec: RunSpec, env: DistEnv, flag: SignalFlag) -> None:
        self.spec, self.env, self.flag = spec, env, flag
        self.run_dir = RunDir(spec.run_dir)
        self.recipe = spec.recipe
        self.args: dict[str, tp.Any] = spec.recipe.job.args if isinstance(spec.recipe.job, EntrypointJob) else {}
        self.rank, self.local_rank, self.world_size, self.device = env.rank, env.local_rank, env.world_size, env.device
        # the planned world's ranks are the global batch's slices; after a lost node (a shrink) each rank
        # left takes several, by gradient accumulation (README, "Training on through a lost node")
        self.data_world = spec.world_size
        self.data_ranks = list(range(env.rank, self.data_world, env.world_size))
        checkpoint = spec.recipe.checkpoint
        self.checkpoints = ckpt.Checkpoints(
            self.run_dir.checkpoints, env, checkpoint.keep, spec.strategy.name, checkpoint.asynchronous,
            timeout_s=spec.recipe.fault.collective_timeout_s,  # the writer's group waits for a lost peer no longer
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
        self.restored: dict[str, tp.Any] = {}  # the trainer state this attempt resumed from
        self.step_metrics: dict[str, float] = {}  # what `log` was given during the current step
        self.recorder: StepRecorder | None = None
        self.loop: tp.Generator[int, None, None] | None = None  # `steps`, while a job iterates it
        # the training thread's time in each part of hpcrun's per-step work, saves apart
        self.own_s = dict.fromkeys(("stop vote", "checkpoint poll", "metrics", "watchdog"), 0.0)
        self.vote = StopVote(env, flag)
        self.cadences: list[Cadence] = []  # how this attempt spaces its saves (`steps`)
        # run once the attempt's results row and state.json are written (a function job's result
        # pickle: whoever sees the result finds the run's record already there)
        self.when_recorded: list[tp.Callable[[], None]] = []
        self._surviving = threading.Lock()  # one survivor's save per attempt (`keep_survivor_state`)
        self._survived = False

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
        settings = self.recipe
        if self.shrunk:  # DeepSpeed steps its optimizer after grad_accum micro-batches: as many as the most slices
            training = self.recipe.training.model_copy(update={"grad_accum": self.micro_batches})
            settings = self.recipe.model_copy(update={"training": training})
        self.engine = self.recipe.strategy.build(
            model, make_optimizer, settings, self.env, self.spec.run_dir, self.nvme_dir
        )
        if self.shrunk:  # each micro-batch's loss divided by all the micro-batches of the global batch, over ranks
            self.engine.accum = self.data_world * self.recipe.training.grad_accum / self.world_size
            # FSDP's shards hold no full gradients; DeepSpeed counts micro-batches to its step: both reduce
            # or count every micro-batch, so every rank runs as many (`padding`)
            self.engine.sync_every = not getattr(self.engine, "replicated", False)
            self.info(f"training on {self.world_size} of {self.data_world} ranks: the same global batch, each rank "
                      f"taking {len(self.data_ranks)} or so slices of it (this one: {self.data_ranks})")
        if self.spec.takes_snapshots:
            self.snapshots = self.snapshots_of(self.engine)
        restored = self.snapshots.restore(self.engine, found[0] if found else 0) if self.snapshots else None
        if restored:
            state, self.resumed_from = restored.state, restored.source
        elif found:
            state, self.resumed_from = self.checkpoints.load(self.engine, found[1]), "disk"
        if restored or found:
            self.restored = state
            self.start_step = int(state["step"])
            self.restored_losses = list(state.get("losses", []))
            if "rank_losses" in state:  # a snapshot's: this rank's own, their mean over ranks taken here
                self.restored_losses += self.mean_over_ranks(state["rank_losses"])
            where = f"{restored.source} snapshot" if restored else f"disk checkpoint {found[1]}" if found else ""
            if self.env.is_main:  # one line on stderr, where a restart is looked for
                print(f"[hpcrun rank 0] resumed from {where} (step {self.start_step})", file=sys.stderr, flush=True)
        return self.engine

    def steps(self) -> tp.Iterator[int]:
        """Step numbers from where this run left off. Between steps: the step's metrics
        (hpcrun.runtime.steps), disk checkpoints and in-memory snapshots when their cadence
        (hpcrun.runtime.cadence) says, and the collective decision to stop on a signal
        (checkpoint, then leave the loop)."""
        self.loop = self._steps()
        return self.loop

    def end_loop(self) -> None:
        """After a failure: the loop's end (its metrics written, its watchdog stopped) now, not when the
        interpreter would free the job's frames, which a failed rank skips (hpcrun.launch)."""
        if self.loop is not None:
            self.loop.close()

    def _steps(self) -> tp.Generator[int, None, None]:
        total = self.recipe.training.steps
        self.recorder = recorder = StepRecorder(self, total)
        env = self.env
        disk, memory = self.make_cadences()  # before the watchdog: what raises here leaves no ring behind
        watchdog = Watchdog(
            self.run_dir, env.job_id, env.attempt, env.rank, env.world_size, self.recipe.fault.hang_timeout_s,
            self.pulse_ring(), on_end=lambda: self.keep_survivor_state(SURVIVOR_WAIT_S),
        )
        warmup = self.recipe.training.warmup_steps
        try:
            self.measured.mark(warmup)  # the wall clock the results row's wall_tokens_per_s is measured on
            for step in range(self.start_step, total):
                self.step = step
                ckpt.seed_step(self.recipe.training.seed, step, self.rank)
                self.step_metrics = {}
                recorded = len(self.measured.losses)
                start = time.perf_counter()
                yield step
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                parts = [time.perf_counter()]  # from here to the save (or the next step): hpcrun's own work
                done = step + 1
                agreed = self.vote.read(done, total, parts[0] - start)
                stop = agreed.signum
                parts.append(time.perf_counter())
                self.checkpoints.poll()
                parts.append(time.perf_counter())
                saving = done == total or bool(stop)
                ballots = agreed.ballots or None  # the cadences' ballots, in their order: disk, then memory
                periodic = not saving and disk.wants(done, ballots and ballots[:BALLOT])
                saving = saving or periodic
                loss = self.measured.losses[-1] if len(self.measured.losses) > recorded else None
                recorder.record(done, parts[-1] - start, loss, self.step_metrics)
                if agreed.flush or saving:  # every checkpointed step is in the steps table before its checkpoint
                    recorder.flush(probing=agreed.probing)
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
                elif memory and memory.wants(done, ballots and ballots[BALLOT:]):
                    with watchdog.saving():
                        memory.started(self.snapshot(done))
                began = time.perf_counter()
                self.vote.cast(done, total, recorder, lambda: [b for kind in self.cadences for b in kind.ballot()])
                self.own_s["stop vote"] += time.perf_counter() - began
                self.measured.mark(warmup)
                if stop and done < total:
                    self.stopped = signal.Signals(stop).name
                    self.info(f"{self.stopped}: saved step {done}, stopping for requeue")
                    return
            self.step = total
        finally:
            watchdog_cpu = watchdog.stop()
            recorder.close()
            if self.snapshots:
                if self.step == total:  # every step ran: the snapshot in flight (`close` waits for it next) is counted
                    self.snapshots.wait()
                self.measured.snapshot_failures = self.snapshots.failures
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

    def pulse_ring(self) -> Pulse | None:
        """This rank's place in the pulse ring (collective: the ranks exchange addresses), when the
        job has peers and the recipe keeps the ring."""
        timeout = self.recipe.fault.peer_timeout_s
        if timeout is None or self.world_size < 2 or not dist.is_initialized():
            return None

        def gather(value: tp.Any) -> list[tp.Any]:
            found: list[tp.Any] = [None] * self.world_size
            dist.all_gather_object(found, value)
            return found

        return Pulse(self.rank, self.world_size, timeout, os.environ.get("MASTER_ADDR", "127.0.0.1"), gather,
                     host=slurm.node_name(os.environ))

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

    def make_cadences(self) -> tuple[Cadence, Cadence | None]:
        """The cadence of disk checkpoints (one due waits for the write before) and, when this rank
        keeps them, of in-memory snapshots (one due while the last is in flight is skipped), with the
        costs earlier attempts measured (their trainer state carries them), and the MTBF this job's
        own failures so far leave (`own_mtbf_s`)."""
        def measured() -> float:
            return cadence.state_bytes(self.engine)

        costs = self.restored.get("save_costs") or {}
        mtbf_s = self.own_mtbf_s()  # a job that keeps failing saves more often than its plan said
        disk = Cadence(
            dataclasses.replace(self.spec.cadence("checkpoint"), mtbf_s=mtbf_s), self.env, skips=False,
            state_bytes=measured, busy=lambda: self.checkpoints.busy,
            since_s=self.unsaved_on_disk_s(), costs=costs.get("checkpoint", ()), first_allocates=True,
        )
        memory = (
            Cadence(
                dataclasses.replace(self.spec.cadence("snapshot"), mtbf_s=mtbf_s), self.env, skips=True,
                state_bytes=measured,
                busy=lambda: bool(self.snapshots and self.snapshots.busy),
                costs=costs.get("snapshot", ()),
            )
            if self.snapshots else None
        )
        self.cadences = [c for c in (disk, memory) if c is not None]
        return disk, memory

    def own_mtbf_s(self) -> float:
        """The planned MTBF with this job's own failures so far (hpcrun.mtbf: the restarts inside it
        its batch script counted, and how long each attempt before one trained). Every rank reads
        the same file, so all space their saves alike."""
        from hpcrun import mtbf

        planned = self.spec.mtbf_s
        try:
            starts = self.run_dir.starts(self.env.allocation_id).read_text().splitlines()
        except OSError:  # not started by hpcrun's batch script (a local run): no restarts inside it
            return planned
        failures, trained_s = mtbf.in_job_history(starts)
        if not failures:
            return planned
        tightened = mtbf.tightened(planned, failures, trained_s, mtbf.in_job_history(mtbf.this_allocation(starts)))
        self.info(f"MTBF {duration(tightened)}: the plan's {duration(planned)} with this job's {failures} "
                  f"failure(s) in {duration(trained_s)} trained")
        return tightened

    def unsaved_on_disk_s(self) -> float:
        """The training time this attempt starts with that no disk checkpoint holds: a restart from
        an in-memory snapshot is past the newest disk checkpoint by the time between the two saves."""
        on_disk = ckpt.latest(self.checkpoints.root)
        saved_at = self.restored.get("saved_at")
        if self.resumed_from in (None, "disk") or not isinstance(saved_at, float):
            return 0.0
        if on_disk is None:
            return float("inf")  # none yet: due at once
        return max(0.0, saved_at - manifest(on_disk[1]).stat().st_mtime)

    def progress_lines(self) -> list[str]:
        """What `hpcrun status` shows of one running run below its row (progress.json's `saves`): a
        shrink, when this attempt trains on fewer nodes than asked, then how saves are spaced."""
        shrunk = []
        if self.shrunk:
            per_node = self.spec.ranks_per_node
            shrunk = [f"training on {self.world_size // per_node} of {self.spec.nodes} nodes since a lost node "
                      f"({self.world_size} of {self.data_world} ranks): the same global batch, each step slower"]
        return shrunk + self.cadence_lines()

    def cadence_lines(self) -> list[str]:
        """How saves are spaced in this attempt, what it did, and what they cost (progress.json, the log)."""
        return [line for line in (kind.summary() for kind in self.cadences) if line]

    def trainer_state(self, step: int) -> dict[str, tp.Any]:
        """What every save holds beside the engine's state: the step, when it was saved, and what
        saves of each kind measured (a restart plans from them, not from an estimate)."""
        costs = {kind.policy.kind: kind.carry() for kind in self.cadences}
        return {"step": step, "saved_at": time.time(), "save_costs": costs}

    def global_losses(self) -> list[float]:
        """The loss of every step so far on the global batch (collective: the mean over ranks
        of this attempt's per-rank losses, after the earlier attempts' restored ones)."""
        local = self.measured.losses
        if local and dist.is_initialized() and self.world_size > 1:
            t = torch.tensor(local, dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            local = (t / self.world_size).tolist()
        return self.restored_losses + list(local)

    @property
    def padding(self) -> int:
        """Micro-batches of weight 0 (`engine.micro_step(..., weight=0.0)`) this rank runs after its own
        slices in each step, once set up: a shrunk sharded state reduces every micro-batch's gradients
        (`sync_every`), one collective each, so every rank runs as many as the one with the most slices
        (6 slices over 4 ranks: 2, 2, 1, 1). A rank with fewer would otherwise wait in a collective the
        others never join. What they add is zeros; the step takes the time of the ranks with most slices."""
        if self.engine is None:
            raise RuntimeError("ctx.padding is known once ctx.setup has built the engine")
        if not self.shrunk or not getattr(self.engine, "sync_every", False):
            return 0
        return self.micro_batches - len(self.data_ranks) * self.recipe.training.grad_accum

    @property
    def micro_batches(self) -> int:
        """The micro-batches of a step on the rank with the most slices of the global batch."""
        return -(-self.data_world // self.world_size) * self.recipe.training.grad_accum

    @property
    def shrunk(self) -> bool:
        """Whether this attempt trains on fewer ranks than planned (a lost node and no spare)."""
        return self.world_size < self.data_world

    def batch_loss(self, losses: list[float]) -> float:
        """This rank's part of the step's loss from the losses of its micro-batches (`record_loss`'s
        value): their mean, or after a shrink their share of the global batch's mean, so that the mean
        over ranks (`global_losses`) is still the mean over every micro-batch of the step."""
        if not self.shrunk:
            return sum(losses) / len(losses)
        return sum(losses) * self.world_size / (self.data_world * self.recipe.training.grad_accum)

    def mean_over_ranks(self, values: list[float | None]) -> list[float]:
        """Each position's mean over the ranks that know it (a survivor's save knows only the
        survivor's own losses: hpcrun.runtime.snapshotsurvivor); NaN where none does. Collective;
        every rank passes as many."""
        known = torch.tensor([[0.0 if v is None else v, float(v is not None)] for v in values], dtype=torch.float64)
        if known.numel() and dist.is_initialized() and self.world_size > 1:
            known = known.to(self.device)
            dist.all_reduce(known)
        return [total / count if count else math.nan for total, count in known.cpu().tolist()]

    def keep_survivor_state(self, wait_s: float) -> None:
        """Tier 0 of recovery: after a failure (this rank's collective raised, or its watchdog fires)
        write the state of the last completed step where the restart finds it
        (hpcrun.runtime.snapshotsurvivor), once the optimizer step in progress, if any, has ended
        (at most `wait_s`). Once per attempt: the training thread and the watchdog's may both come
        here, the later one waits for the first one's save. Never raises: the failure is recorded
        whatever this does."""
        engine, snapshots = self.engine, self.snapshots
        lock = getattr(engine, "update_lock", None)
        if snapshots is None or lock is None or not getattr(engine, "replicated", False):
            return
        with self._surviving:
            if self._survived:
                return
            self._survived = True
            said = self._keep_survivor_state(engine, snapshots, lock, wait_s)
        print(f"[hpcrun rank {self.rank}] survivor's save: {said}", file=sys.stderr, flush=True)

    def _keep_survivor_state(self, engine: tp.Any, snapshots: snapshot.Snapshots, lock: tp.Any, wait_s: float) -> str:
        saving = self.run_dir.survivor_saving(self.env.job_id, self.env.attempt, self.rank)
        try:  # the batch script waits longer for a step one of whose ranks says so
            saving.parent.mkdir(parents=True, exist_ok=True)
            saving.touch()
        except OSError:
            pass
        try:
            if not lock.acquire(timeout=wait_s):
                return "not kept: the optimizer step in progress did not end"
            try:
                if engine.torn:
                    return "not kept: an optimizer step failed partway (the state is no step's)"
                if not engine.updates:  # the state this attempt started from, kept where it came from
                    return "not kept: no step completed in this attempt"
                step = self.start_step + engine.updates
                state = {**self.trainer_state(step), "losses": self.restored_losses,
                         "rank_losses": self.own_losses(step)}
                return snapshots.keep_survivor(engine, step, state)
            finally:
                lock.release()
        except Exception as exc:  # noqa: BLE001 - the restart resumes from what else there is
            return f"not kept: {type(exc).__name__}: {exc}"
        finally:
            saving.unlink(missing_ok=True)

    def own_losses(self, step: int) -> list[float | None]:
        """This rank's loss of each of this attempt's steps up to `step`, one per step (None where it
        was not recorded): every rank's snapshot of a step holds as many, whoever saved it."""
        done = step - self.start_step
        return (list(self.measured.losses) + [None] * done)[:done]

    def save(self, step: int, block: bool) -> float:
        """A disk checkpoint of `step`; returns the seconds training was held."""
        state = {**self.trainer_state(step), "losses": self.global_losses()}
        self.measured.checkpoint_saves.append(self.checkpoints.save(self.engine, step, state, block))
        return self.measured.checkpoint_saves[-1]

    def snapshot(self, step: int) -> float:
        """An in-memory snapshot of `step` (hpcrun.runtime.snapshot) with the trainer state a
        checkpoint holds (its losses as this rank's own of this attempt, after the earlier ones)."""
        assert self.snapshots is not None
        # this rank's own losses: their mean over ranks (global_losses) is taken at the restore, so
        # that a snapshot waits for no other rank
        state = {**self.trainer_state(step), "losses": self.restored_losses, "rank_losses": self.own_losses(step)}
        self.measured.snapshot_stalls.append(self.snapshots.save(self.engine, step, state))
        return self.measured.snapshot_stalls[-1]

    def close_snapshots(self, status: str) -> None:
        """At the end of an attempt that did not fail, remove this run's snapshots: no restart in
        this job can use them (the training finished, or a stop requeues the job, which resumes
        from disk). A stop abandons the snapshot in flight rather than wait for it."""
        if self.snapshots is not None:
            self.snapshots.close(abandon=status != "completed")
            self.measured.snapshot_failures = self.snapshots.failures  # the row's: every snapshot has ended

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
