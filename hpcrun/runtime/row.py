"""One attempt's results row, built here only: what ran where and with which settings (from the
resolved RunSpec alone: `plan_row`, also all the failure writer knows of an attempt no rank could
describe), then what it measured and with which software (`result_row`). The schema it fills is
declared in hpcrun.results.

Imports no torch until a rank builds its measured row: the failure writer (hpcrun.runtime.failure)
runs after srun, outside the ranks."""

from __future__ import annotations

import datetime as dt
import hashlib
import sys
import typing as tp

from hpcrun import __version__, goodput
from hpcrun.plan import RunSpec
from hpcrun.rundir import CorruptStateError, RunDir
from hpcrun.runtime import timeouts

if tp.TYPE_CHECKING:
    from hpcrun.runtime.env import DistEnv
    from hpcrun.runtime.metrics import Measurements


class Attempt(tp.Protocol):
    """What the row reads of a finished attempt's loop (hpcrun.runtime.context.Context is one):
    a shape, because the context's modules reach the failure writer, which builds rows here."""

    @property
    def spec(self) -> RunSpec: ...
    @property
    def env(self) -> DistEnv: ...
    @property
    def measured(self) -> Measurements: ...
    @property
    def started(self) -> dt.datetime: ...
    @property
    def start_step(self) -> int: ...
    @property
    def step(self) -> int: ...
    @property
    def stopped(self) -> str | None: ...
    @property
    def resumed_from(self) -> str | None: ...
    def slow_ranks(self) -> str | None: ...


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def global_batch(spec: RunSpec) -> int | None:
    """Samples per optimizer step; None for a command or function job, whose batch is its own (the
    recipe's training fields say nothing of it)."""
    t = spec.recipe.training
    own_batch = spec.recipe.job.kind in ("command", "function")
    return None if own_batch else spec.world_size * t.micro_batch * t.grad_accum


def plan_row(
    spec: RunSpec, job_id: str, attempt: int, node_list: str | None, world_size: int | None = None
) -> dict[str, tp.Any]:
    """The columns the plan decides, and the attempt's ids: every row has them. `world_size`: the
    attempt's own, where it trained on fewer ranks than planned (a shrink); the global batch stays."""
    recipe, t, size = spec.recipe, spec.recipe.training, spec.size
    world = world_size or spec.world_size
    script = RunDir(spec.run_dir).script
    return {
        "run_id": spec.run_id, "sweep_id": spec.sweep_id, "point_id": spec.point_id, "stage": spec.stage,
        "site": spec.site_name, "cluster": spec.cluster, "partition": spec.partition,
        "nodes": world // spec.ranks_per_node, "gpus_per_node": spec.gpus_per_node,
        "world_size": world,  # ranks, not torchrun's tasks
        "gpu_model": spec.gpu_model, "interconnect": spec.interconnect,
        "strategy": spec.strategy.name, **spec.strategy.result_columns(),
        "plan_option": spec.strategy.memory_option().name if size else None,
        "precision": recipe.precision, "job_kind": recipe.job.kind, "model": spec.model,
        "parameters": size.parameters(t.seq_len) if size else None,
        "micro_batch": t.micro_batch, "grad_accum": t.grad_accum, "global_batch": global_batch(spec),
        "seq_len": t.seq_len, "activation_checkpointing": int(t.activation_checkpointing), "steps": t.steps,
        "seed": t.seed,
        "job_id": job_id, "node_list": node_list, "attempt": attempt,
        "hpcrun_version": __version__, "git_sha": spec.git_sha, "site_hash": spec.site_hash,
        "recipe_hash": _hash(recipe.model_dump_json()),
        "script_hash": _hash(script.read_text()) if script.exists() else None,
    }


def result_row(ctx: Attempt, status: str, reason: str | None, peak: int) -> dict[str, tp.Any]:
    """A rank's row of its attempt: the plan's columns, what it measured, and its software."""
    import torch

    from hpcrun.runtime.metrics import summarise

    spec = ctx.spec
    t = spec.recipe.training
    samples = global_batch(spec)
    world = None if spec.recipe.job.kind == "command" else ctx.env.world_size  # a command's tasks are not its ranks
    measured = summarise(
        ctx.measured, t.warmup_steps, samples * t.seq_len if spec.size and samples else None, samples,
        world or spec.world_size,
        spec.size.flops_per_token(t.seq_len) if spec.size else None, spec.peak_tflops,
    )
    ds_version = sys.modules["deepspeed"].__version__ if "deepspeed" in sys.modules else None
    last_step = ctx.step if not ctx.stopped else ctx.step + 1
    return {
        **plan_row(spec, ctx.env.job_id, ctx.env.attempt, ctx.env.node_list, world),
        "start_time": ctx.started, "end_time": dt.datetime.now(dt.timezone.utc), "status": status, "reason": reason,
        "torch_version": torch.__version__, "deepspeed_version": ds_version,
        "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        "first_step": ctx.start_step, "last_step": last_step,
        "peak_memory_bytes": peak, **measured, "slow_ranks": ctx.slow_ranks(), "extra": dict(ctx.measured.extra),
        "resumed_from": ctx.resumed_from, **recovery(ctx, last_step, measured["step_time_p50_s"]),
    }


def recovery(ctx: Attempt, last_step: int, step_time_s: float | None) -> dict[str, tp.Any]:
    """This attempt's restart and recomputation after a failed previous attempt of its job
    (hpcrun.goodput.restart_columns), from that attempt's record in state.json. Read only on SLURM
    by the ranks that build a row (rank 0, failing ranks): locally each resume is a job of its own (a new
    controller), with no earlier attempt."""
    env, began = ctx.env, ctx.measured.started
    if ctx.spec.scheduler != "slurm" or env.attempt == 0 or began is None:  # no previous attempt, or no loop ran
        return goodput.restart_columns(None, None, None, ctx.start_step, last_step, step_time_s)
    run_dir = RunDir(ctx.spec.run_dir)
    try:
        state = run_dir.state()
    except CorruptStateError:  # the row is written all the same, without the accounting
        state = {}
    ours = (state.get("job_id"), state.get("attempt")) == (env.job_id, env.attempt - 1)
    allocation = timeouts.this_start(run_dir, env.allocation_id, env.attempt)
    return goodput.restart_columns(
        state.get("failure") if ours else None, ctx.measured.unix_time(began), allocation, ctx.start_step,
        last_step, step_time_s,
    )
