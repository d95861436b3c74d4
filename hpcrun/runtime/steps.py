"""Recording per-step metrics inside the job: every rank keeps its own step times and losses in
memory; at a flush (every `metrics.flush_steps` steps or `flush_seconds` seconds, and at every
checkpoint and stop, a decision all ranks share) one small all_gather brings the batch's times
and losses to rank 0, which hands the rows to a background thread. That thread writes them as one
Parquet file (hpcrun.steps), rewrites progress.json and, when asked, TensorBoard events, so a
slow shared filesystem never stalls a step.
"""

from __future__ import annotations

import atexit
import datetime as dt
import math
import os
import queue
import sys
import threading
import time
import typing as tp

import torch
import torch.distributed as dist

from hpcrun import progress, slurm
from hpcrun import steps as dataset
from hpcrun.plan import RunSpec
from hpcrun.rundir import RunDir, read_json
from hpcrun.runtime import checkpoint as ckpt
from hpcrun.runtime import nodes as run_nodes
from hpcrun.runtime.env import DistEnv
from hpcrun.runtime.metrics import Measurements, peak_memory_bytes
from hpcrun.runtime.straggler import (
    PERSISTENT,
    PERSISTENT_S,
    PROBE_EVERY_S,
    SLOW_SHARE,
    Stragglers,
    probe,
    probe_interval,
)


class Loop(tp.Protocol):
    """What the recorder reads of the training loop it records (hpcrun.runtime.context.Context is
    one): a shape, so the context, which creates the recorder, is not imported back."""

    @property
    def spec(self) -> RunSpec: ...
    @property
    def env(self) -> DistEnv: ...
    @property
    def engine(self) -> tp.Any: ...
    @property
    def start_step(self) -> int: ...
    @property
    def measured(self) -> Measurements: ...
    def info(self, message: str) -> None: ...
    def progress_lines(self) -> list[str]: ...


def attempt_ids(ctx: Loop) -> dict[str, tp.Any]:
    """The columns naming the run and attempt a step row belongs to."""
    spec = ctx.spec
    return {
        "run_id": spec.run_id, "sweep_id": spec.sweep_id, "point_id": spec.point_id, "stage": spec.stage,
        "strategy": spec.strategy.name, "job_id": ctx.env.job_id, "attempt": ctx.env.attempt,
    }


class Pending(tp.NamedTuple):
    """What one rank knows of one step until the next flush."""

    step: int
    ended: float  # unix time
    seconds: float
    loss: float | None
    lr: float | None
    grad_norm: tp.Any  # a tensor (not synced until the flush), a float, or None
    memory: int | None
    extra: dict[str, float]


CLOSE_WAIT_S = 60.0  # the end of an attempt waits this long for the last files, then leaves them


class Writer:
    """Rank 0's background thread for files: jobs run in order; a failing write is reported on
    stderr and training goes on (metrics are never worth a lost run). A write still hanging
    CLOSE_WAIT_S after `close` (a stuck shared filesystem) is a warning line, and the attempt
    ends without it instead of hanging until SLURM kills it."""

    def __init__(self) -> None:
        self.jobs: queue.Queue[tp.Callable[[], None] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="hpcrun-steps", daemon=True)
        self.thread.start()

    def submit(self, job: tp.Callable[[], None]) -> None:
        self.jobs.put(job)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        if self.thread.is_alive():
            self.jobs.put(None)
            self.thread.join(wait_s)
            if self.thread.is_alive():
                print(f"[hpcrun] per-step metrics writer still busy after {wait_s:.0f} s: its last files may be lost",
                      file=sys.stderr, flush=True)

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                job()
            except Exception as exc:  # noqa: BLE001 - reported, never fatal to training
                print(
                    f"[hpcrun] per-step metrics or a slow-rank record not written: {type(exc).__name__}: {exc}",
                    file=sys.stderr,
                    flush=True,
                )


class StepRecorder:
    """One attempt's per-step metrics: `record` each step (cheap, local), `flush` when `due`
    (collective), `close` at the end of the attempt."""

    def __init__(self, ctx: Loop, total: int) -> None:
        self.ctx, self.total = ctx, total
        spec, training = ctx.spec, ctx.spec.recipe.training
        self.config = ctx.spec.recipe.metrics
        self.pending: list[Pending] = []
        self.last_flush = time.monotonic()
        self.seq = 0
        self.closed = False
        self.spent_s = 0.0  # the training thread's time in `record` and `flush`: this feature's cost
        self.flushes: list[float] = []  # of which each flush's (probes counted in `probes`)
        self.probes = 0
        samples = spec.world_size * training.micro_batch * training.grad_accum  # the planned global batch, shrunk too
        self.tokens_per_step = samples * training.seq_len if spec.size else None
        self.ids = attempt_ids(ctx)
        self.writer: Writer | None = None
        self.board: tp.Any = None
        # slow ranks (hpcrun.runtime.straggler): every rank probes at each flush, rank 0 judges
        factor = ctx.spec.recipe.fault.straggler_factor
        self.probing = bool(factor) and ctx.env.world_size > 1 and dist.is_initialized()
        self.last_probe = -math.inf
        self.probe_every = PROBE_EVERY_S  # until the first probe's time is known (probe_interval)
        self.stragglers: Stragglers | None = None
        if self.probing and factor:
            nodes: list[tp.Any] = [None] * ctx.env.world_size
            dist.all_gather_object(nodes, slurm.node_name(os.environ))
            self.stragglers = Stragglers(factor, [str(n) for n in nodes]) if ctx.env.is_main else None
        if ctx.env.is_main:
            self.writer = Writer()
            if self.config.tensorboard:
                from hpcrun.runtime.tensorboard import Board

                self.board = Board(RunDir(spec.run_dir).tensorboard, ctx.start_step)
            atexit.register(self.close)  # a job that raised out of its loop still writes what it has
            start = ctx.start_step
            self.writer.submit(lambda: self._progress(start, None, []))

    def due(self, ahead: int = 0) -> bool:
        """Whether this rank would flush `ahead` steps after the step now ending (all ranks then
        agree: hpcrun.runtime.vote `StopVote` carries the wish a step ahead)."""
        return (
            len(self.pending) + 1 + ahead >= self.config.flush_steps
            or time.monotonic() - self.last_flush >= self.config.flush_seconds
        )

    def record(self, step: int, seconds: float, loss: float | None, extra: dict[str, float]) -> None:
        began = time.perf_counter()
        engine = self.ctx.engine
        groups = getattr(getattr(engine, "optimizer", None), "param_groups", None)
        lr = float(groups[0]["lr"]) if groups else None
        memory = peak_memory_bytes(self.ctx.env.device) if self.ctx.env.is_main else None
        self.pending.append(
            Pending(step, time.time(), seconds, loss, lr, getattr(engine, "grad_norm", None), memory, extra)
        )
        self.spent_s += time.perf_counter() - began

    def probe_due(self) -> bool:
        """Whether this rank would probe for slow ranks at the next flush: at most once every
        `probe_every`, however often flushes come (all ranks then agree, as for `due`)."""
        return self.probing and time.monotonic() - self.last_probe >= self.probe_every

    def flush(self, collective: bool = True, probing: bool = False) -> None:
        """Rank 0 hands the pending steps' rows to its writer. Collective: every rank calls it at
        the same step (one all_gather of the batch's step times and losses), with the same
        `probing` (every rank times its probe, hpcrun.runtime.straggler)."""
        began = time.perf_counter()
        try:
            self._flush(collective, probing and self.probing)
        finally:
            self.flushes.append(time.perf_counter() - began)
            self.spent_s += self.flushes[-1]

    def _flush(self, collective: bool, probing: bool) -> None:
        batch, self.pending = self.pending, []
        self.last_flush = time.monotonic()
        if not batch:
            return
        every = self.config.per_rank_interval
        sampled = [i for i, p in enumerate(batch) if every and p.step % every == 0]
        local = [batch[i].seconds for i in sampled] + [math.nan if p.loss is None else p.loss for p in batch]
        world = self.ctx.env.world_size
        if collective:
            gathered = self._gather(local + ([probe(self.ctx.env.device)] if probing else []))
            if probing:
                self.last_probe, self.probes = time.monotonic(), self.probes + 1
                gathered, probes = gathered[:, :-1], gathered[:, -1].tolist()
                self.probe_every = probe_interval(probes, self.ctx.spec.recipe.fault.straggler_probe_share)
                self._judge(probes)
        else:  # a rank alone (leaving on an error): its own times and losses only
            gathered = torch.tensor([local], dtype=torch.float64)
            sampled = []
        if self.writer is None:
            return
        times, losses = gathered[:, : len(sampled)], gathered[:, len(sampled):]
        spread: dict[int, tuple[float, float, float, int]] = {}
        # every sampled step's min, median, max and slowest rank at once (one op per statistic, not per step)
        if sampled:
            columns = zip(
                times.min(0).values.tolist(),
                times.quantile(0.5, dim=0).tolist(),
                times.max(0).values.tolist(),
                times.argmax(0).tolist(),
            )
            spread = dict(zip(sampled, columns))
        mean_loss = (
            losses.sum(0) / world if collective else (losses[0] if world == 1 else torch.full((len(batch),), math.nan))
        )
        seq, self.seq = self.seq, self.seq + 1
        losses_now = mean_loss.tolist()
        # rows built off the training thread
        self.writer.submit(lambda: self._write(self._rows(batch, spread, losses_now), seq))

    def _rows(self, batch: list[Pending], spread: dict[int, tuple[float, float, float, int]],
              mean_loss: list[float]) -> list[dict[str, tp.Any]]:
        """The steps table's rows of one flush (rank 0's writer thread)."""
        rows = []
        for i, p in enumerate(batch):
            low, median, high, slowest = spread.get(i, (None, None, None, None))
            loss = mean_loss[i]
            rows.append({
                **self.ids, "step": p.step, "time": dt.datetime.fromtimestamp(p.ended, dt.timezone.utc),
                "loss": None if math.isnan(loss) else loss, "lr": p.lr,
                "grad_norm": None if p.grad_norm is None else float(p.grad_norm),
                "step_time_s": p.seconds, "step_time_min_s": low, "step_time_median_s": median, "step_time_max_s": high,
                "slowest_rank": slowest,
                "tokens_per_s": self.tokens_per_step / p.seconds if self.tokens_per_step and p.seconds else None,
                "memory_bytes": p.memory, "extra": dict(p.extra),
            })
        return rows

    def _judge(self, probes: list[float]) -> None:
        """Rank 0: name ranks that stay slow; the run's record (and the exclusion, when asked
        for) is written by the writer thread."""
        if self.stragglers is None or self.writer is None:
            return
        new = self.stragglers.check(probes)
        if not new:
            return
        for s in new:
            self.ctx.info(
                f"slow rank: {s.describe()}, over fault.straggler_factor {self.stragglers.factor} "
                f"in {SLOW_SHARE:.0%}+ of {PERSISTENT}+ probes over {PERSISTENT_S:.0f}+ s"
            )
        found = {f"rank {s.rank} on {s.node}": round(s.ratio, 2) for s in new}
        nodes = sorted({s.node for s in new})
        spec, run_dir = self.ctx.spec, RunDir(self.ctx.spec.run_dir)
        self.writer.submit(lambda: run_nodes.record_slow(run_dir, spec, found, nodes))

    def slow_ranks(self) -> str | None:
        """The ranks this attempt named slow (rank 0; the results row's `slow_ranks`)."""
        return self.stragglers.describe() if self.stragglers is not None else None

    def close(self) -> None:
        """End of the attempt: rank 0 writes what is left (alone), its last progress, and waits
        for its writer."""
        if self.closed:
            return
        self.closed = True
        if self.pending:
            self.flush(collective=False)
        step_s = sum(self.ctx.measured.step_times)
        if step_s:
            share = f" ({100 * self.spent_s / step_s:.3f}% of step time)"
            self.ctx.info(
                f"per-step metrics: {self.spent_s * 1e3:.1f} ms on the training thread "
                f"over {len(self.ctx.measured.step_times)} steps{share}, "
                f"of which {len(self.flushes)} flushes {sum(self.flushes) * 1e3:.1f} ms "
                f"({self.probes} with a slow-rank probe)"
            )
        if self.writer is not None:
            self.writer.submit(lambda: self._progress(None, None, []))
            self.writer.close()
            if self.board is not None:
                self.board.close()

    def _gather(self, local: list[float]) -> torch.Tensor:
        """(world, n): every rank's `local`, on the CPU."""
        mine = torch.tensor(local, dtype=torch.float64, device=self.ctx.env.device)
        if not (dist.is_initialized() and self.ctx.env.world_size > 1):
            return mine.unsqueeze(0).cpu()
        out = [torch.empty_like(mine) for _ in range(self.ctx.env.world_size)]
        dist.all_gather(out, mine)
        return torch.stack(out).cpu()

    # rank 0's writer thread --------------------------------------------------------------
    def _write(self, rows: list[dict[str, tp.Any]], seq: int) -> None:
        dataset.write_batch(self.ctx.spec.results_dir, rows, seq)
        if self.board is not None:
            self.board.write(rows)
        self._progress(rows[-1]["step"], rows[-1]["loss"], rows)

    def _progress(self, step: int | None, loss: float | None, rows: list[dict[str, tp.Any]]) -> None:
        """progress.json: the newest written step, its rate and the time left at that rate."""
        path = RunDir(self.ctx.spec.run_dir).progress
        if step is None:  # the attempt's end: the last batch's figures, freshly stamped
            last = read_json(path, {}) or {}
            step, loss = last.get("step", self.ctx.start_step), last.get("loss")
            rate, seconds = last.get("tokens_per_s"), last.get("step_time_s")
        else:
            seconds = progress.typical_step_s(r["step_time_s"] for r in rows)
            rate = self.tokens_per_step / seconds if self.tokens_per_step and seconds else None
        found = ckpt.latest(RunDir(self.ctx.spec.run_dir).checkpoints)
        progress.write(
            path,
            step,
            self.total,
            loss,
            rate,
            seconds,
            self.ids["job_id"],
            self.ids["attempt"],
            found[0] if found else None,
            self.ctx.progress_lines(),
        )
