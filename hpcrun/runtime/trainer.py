"""The in-job loop: distributed init, the strategy, resume, signals, checkpoints, measurements.

User entry points get a `Context`; the built-in benchmark is written against the same Context,
so every strategy and every user job share one loop and one fault-tolerance path.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import importlib
import logging
import os
import signal
import subprocess
import sys
import time
import typing as tp
from pathlib import Path

import torch
import torch.distributed as dist

from hpcrun import __version__
from hpcrun.plan import FINAL_WEIGHTS, RunSpec
from hpcrun.recipe import DeepSpeed, EntrypointJob, FSDP, CommandJob
from hpcrun.runtime import checkpoint as ckpt
from hpcrun.runtime import strategies
from hpcrun.runtime.env import DistEnv, from_scheduler, init_process_group
from hpcrun.runtime.metrics import Measurements, peak_memory_bytes, summarise
from hpcrun.signals import FLAG, SignalFlag
from hpcrun.sizes import SIZES

log = logging.getLogger("hpcrun")


class Context:
    """What a user's `module:function` receives: ranks, device, `setup`, `steps`, `log`."""

    def __init__(self, spec: RunSpec, env: DistEnv, flag: SignalFlag) -> None:
        self.spec, self.env, self.flag = spec, env, flag
        self.recipe = spec.recipe
        self.args: dict[str, tp.Any] = spec.recipe.job.args if isinstance(spec.recipe.job, EntrypointJob) else {}
        self.rank, self.local_rank, self.world_size, self.device = env.rank, env.local_rank, env.world_size, env.device
        strategy, checkpoint = spec.recipe.strategy, spec.recipe.checkpoint
        self.checkpoints = ckpt.Checkpoints(Path(spec.run_dir) / "checkpoints", env, checkpoint.keep, strategy.name, checkpoint.asynchronous)
        self.measured = Measurements()
        self.engine: tp.Any = None
        self.start_step = 0
        self.step = 0
        self.stopped: str | None = None
        self.started = dt.datetime.now(dt.timezone.utc)
        self.restored_losses: list[float] = []  # global losses of earlier attempts

    def setup(self, model: torch.nn.Module, make_optimizer: strategies.OptimizerFactory) -> strategies.Engine:
        """Wrap `model` in the recipe's strategy, build the optimizer, and resume from the newest
        complete checkpoint of this run if there is one."""
        nvme = os.environ.get("HPCRUN_NVME_DIR")
        found = ckpt.latest(self.checkpoints.root)
        if not found and self.spec.init_weights:  # a stage starting from the previous stage's weights
            model.load_state_dict(torch.load(self.spec.init_weights, map_location="cpu", weights_only=True))
            self.info(f"initialised from {self.spec.init_weights}")
        self.engine = strategies.setup(model, make_optimizer, self.recipe, self.env, nvme)
        if found:
            state = self.checkpoints.load(self.engine, found[1])
            self.start_step = int(state["step"])
            self.restored_losses = list(state.get("losses", []))
            self.info(f"resumed from {found[1].name} (step {self.start_step})")
        return self.engine

    def steps(self) -> tp.Iterator[int]:
        """Step numbers from where this run left off. Between steps: periodic checkpoints, and
        the collective decision to stop on a signal (checkpoint, requeue, exit)."""
        total, interval = self.recipe.training.steps, self.recipe.checkpoint.interval
        for step in range(self.start_step, total):
            self.step = step
            start = time.perf_counter()
            yield step
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            done = step + 1
            self.checkpoints.poll()
            stop = self._agree_to_stop()
            # a step's time includes hpcrun's own per-step work; a save's stall is counted apart
            self.measured.step_times.append(time.perf_counter() - start)
            if done % interval == 0 or done == total or stop:
                self.save(done, block=done == total or bool(stop))
            if stop and done < total:
                self.stopped = signal.Signals(stop).name
                self.info(f"{self.stopped}: saved step {done}, stopping for requeue")
                return
        self.step = total

    def global_losses(self) -> list[float]:
        """The loss of every step so far on the global batch (collective: the mean over ranks
        of this attempt's per-rank losses, after the earlier attempts' restored ones)."""
        local = self.measured.losses
        if local and dist.is_initialized() and self.world_size > 1:
            t = torch.tensor(local, dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            local = (t / self.world_size).tolist()
        return self.restored_losses + list(local)

    def save(self, step: int, block: bool) -> None:
        state = {"step": step, "losses": self.global_losses()}
        self.measured.checkpoint_saves.append(self.checkpoints.save(self.engine, step, state, block))

    def _agree_to_stop(self) -> int:
        """Every rank learns whether any rank was signalled (a tiny all-reduce per step)."""
        local = torch.tensor([self.flag.signum or 0], dtype=torch.int64, device=self.device)
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
        return int(local.item())

    def record_loss(self, loss: float) -> None:
        self.measured.losses.append(loss)

    def log(self, **metrics: float) -> None:
        """User metrics: kept in the results row's `extra` map."""
        self.measured.extra.update({k: float(v) for k, v in metrics.items()})

    def info(self, message: str) -> None:
        if self.env.is_main or os.environ.get("HPCRUN_LOG_ALL_RANKS"):
            print(f"[hpcrun rank {self.rank}] {message}", flush=True)


def builtin_benchmark(ctx: Context) -> None:
    """The GPT benchmark: synthetic tokens, AdamW, the recipe's strategy and precision."""
    from hpcrun.runtime.model import GPT, synthetic_batch

    recipe = ctx.recipe
    training = recipe.training
    size = SIZES[recipe.job.model]  # type: ignore[union-attr]
    torch.manual_seed(training.seed)
    # meta-device init would discard weights handed over from a previous stage
    meta = isinstance(recipe.strategy, FSDP) and recipe.strategy.meta_init and not ctx.spec.init_weights
    with torch.device("meta") if meta else torch.device("cpu"):
        model = GPT(size, training.seq_len, training.activation_checkpointing)
    engine = ctx.setup(model, lambda params: torch.optim.AdamW(params, lr=training.lr, betas=(0.9, 0.95), weight_decay=0.0))
    mb, accum = training.micro_batch, training.grad_accum
    for step in ctx.steps():
        losses = []
        for m in range(accum):
            first = (m * ctx.world_size + ctx.rank) * mb  # this rank's slice of the global batch
            tokens, targets = synthetic_batch(training.seed, step, first, mb, training.seq_len, size.vocab)
            losses.append(engine.micro_step(tokens.to(ctx.device), targets.to(ctx.device), last=m == accum - 1))
        engine.optimizer_step()
        ctx.record_loss(sum(losses) / len(losses))
        if ctx.env.is_main and (step + 1) % training.log_interval == 0:
            ctx.info(f"step {step + 1}/{training.steps} loss {losses[-1]:.4f}")


def user_entrypoint(ctx: Context) -> None:
    job = ctx.recipe.job
    assert isinstance(job, EntrypointJob)
    base = Path(ctx.spec.recipe_path).resolve().parent
    for entry in reversed(job.pythonpath):
        sys.path.insert(0, str((base / entry).resolve()))
    module_name, func_name = job.entrypoint.split(":")
    getattr(importlib.import_module(module_name), func_name)(ctx)


def user_command(ctx: Context) -> None:
    """The user's own script, once per rank, with RANK/WORLD_SIZE/MASTER_* already exported."""
    job = ctx.recipe.job
    assert isinstance(job, CommandJob)
    env = {**os.environ, "HPCRUN_CHECKPOINT_DIR": str(ctx.checkpoints.root)}
    cwd = Path(ctx.spec.recipe_path).resolve().parent / job.workdir if job.workdir else None
    ctx.flag.child = subprocess.Popen(job.command, env=env, cwd=cwd)
    code = ctx.flag.child.wait()
    if code != 0:
        raise RuntimeError(f"command {job.command[0]!r} exited with status {code} on rank {ctx.rank}")


JOBS: dict[str, tp.Callable[[Context], None]] = {"benchmark": builtin_benchmark, "entrypoint": user_entrypoint, "command": user_command}


def main(spec_path: str) -> dict[str, tp.Any]:
    """One rank of one run attempt. Returns this rank's summary (submitit pickles it)."""
    spec = RunSpec.model_validate_json(Path(spec_path).read_text())
    os.environ.update(HPCRUN_RUN_DIR=spec.run_dir, HPCRUN_RUN_ID=spec.run_id)  # per point, also in an array
    env = from_scheduler()
    flag = FLAG
    flag.install()  # already done by hpcrun.launch; again in case the task was started otherwise
    if spec.recipe.job.kind != "command":  # a command job's own script owns MASTER_PORT
        init_process_group(env)
    ctx = Context(spec, env, flag)
    status, reason = "completed", None
    try:
        JOBS[spec.recipe.job.kind](ctx)
        ctx.checkpoints.wait()  # a job that left `steps()` early may have a save in flight
        if ctx.stopped:
            status, reason = stop_decision(ctx)
    except Exception as exc:
        status, reason = "failed", f"{type(exc).__name__}: {exc}"
        retry = spec.site.scheduler == "slurm" and env.restart_count < spec.recipe.checkpoint.max_requeues
        if spec.site.scheduler == "slurm" and not retry:
            reason += f"; requeue cap reached ({spec.recipe.checkpoint.max_requeues} requeues)"
        finish(ctx, status, reason + ("; requeued" if retry else ""), collective=False)
        if retry:  # a crash counts against the cap like a timeout: transient faults recover, bugs stop
            requeue_now(env)
        raise
    if ctx.engine is not None and status == "completed" and spec.recipe.checkpoint.export_final:
        export_final(ctx)
    row = finish(ctx, status, reason, collective=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    if status == "requeued" and env.is_main:
        requeue_now(env)  # last: requeueing ends this job's processes
    return {"status": status, "reason": reason, "rank": env.rank, "step": ctx.step, "final_loss": row.get("final_loss")}


def stop_decision(ctx: Context) -> tuple[str, str | None]:
    """After the stop checkpoint: requeue on SLURM unless the cap is reached. Locally,
    `hpcrun resume` continues."""
    cap = ctx.recipe.checkpoint.max_requeues
    where = f"{ctx.stopped} at step {ctx.step + 1}"
    if ctx.spec.site.scheduler != "slurm":
        return "stopped", f"{where}; continue with hpcrun resume"
    if ctx.env.restart_count >= cap:
        return "failed", f"requeue cap reached ({cap} requeues); {where}"
    return "requeued", where


def requeue_now(env: DistEnv) -> None:
    """Requeue this job, unless SLURM is already doing so (preemption requeues by itself, and
    twice would count twice). SLURM holds a requeued job for the site's `AuthInfo=cred_expire`
    (120 s by default) before it may start again: a floor on requeue latency set by the site."""
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array else env.job_id
    state = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    if "JobState=RUNNING" in state:
        subprocess.run(["scontrol", "requeue", job], check=False)


def finish(ctx: Context, status: str, reason: str | None, collective: bool) -> dict[str, tp.Any]:
    """Gather across ranks (when all are alive) and write this attempt's results row (rank 0,
    or any failing rank, since a failed rank 0 may never get here)."""
    m = ctx.measured
    m.checkpoint_writes = ctx.checkpoints.write_times
    peak = peak_memory_bytes(ctx.device)
    if collective:
        m.losses = ctx.global_losses()
        if dist.is_initialized() and ctx.world_size > 1:
            peak_t = torch.tensor([peak], dtype=torch.int64, device=ctx.device)
            dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
            peak = int(peak_t.item())
    if not (ctx.env.is_main or not collective):
        return {}
    row = result_row(ctx, status, reason, peak)
    from hpcrun.results import write_attempt

    write_attempt(ctx.spec.site.results_dir, row)
    write_marker(Path(ctx.spec.run_dir), {"status": status, "reason": reason, "job_id": ctx.env.job_id, "restart_count": ctx.env.restart_count, "step": row["last_step"]})
    if m.losses:
        (Path(ctx.spec.run_dir) / f"losses-{ctx.env.job_id}-{ctx.env.restart_count}.txt").write_text("\n".join(repr(x) for x in m.losses))
    return row


def export_final(ctx: Context) -> None:
    """The final weights as one plain fp32 state dict (`final-weights.pt`, written atomically by
    rank 0) and their sha256: what the next stage loads whatever its strategy, and what
    exact-resume checks compare. Collective: ZeRO-3 and FSDP gather their shards for it."""
    state = full_state(ctx.engine)
    if ctx.env.is_main:
        run_dir = Path(ctx.spec.run_dir)
        tmp = run_dir / f".{FINAL_WEIGHTS}.tmp"
        torch.save({k: v.float() for k, v in state.items()}, tmp)
        tmp.replace(run_dir / FINAL_WEIGHTS)
        (run_dir / "weights.sha256").write_text(ckpt.state_digest(state) + "\n")


def full_state(engine: tp.Any) -> dict[str, torch.Tensor]:
    """The whole model's state dict on CPU, under the names of the unwrapped model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if isinstance(engine, strategies.DeepSpeedEngine):
        import deepspeed

        module = engine.engine.module
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    else:
        # cpu_offload on a CPU-only FSDP1 model segfaults in torch 2.13 (and gains nothing there)
        options = StateDictOptions(full_state_dict=True, cpu_offload=torch.cuda.is_available())
        state = get_model_state_dict(engine.model, options=options)
    return {k: v.detach().cpu() for k, v in state.items()}


def write_marker(run_dir: Path, state: dict[str, tp.Any]) -> None:
    """`state.json`: what `hpcrun status` reports where the scheduler no longer knows the job."""
    import json

    from filelock import FileLock

    with FileLock(str(run_dir / ".state.lock")):
        try:
            current = json.loads((run_dir / "state.json").read_text())
        except (OSError, ValueError):
            current = {}
        same_attempt = (current.get("job_id"), current.get("restart_count")) == (state["job_id"], state["restart_count"])
        if same_attempt and current.get("status") == "failed":  # one failed rank fails the attempt,
            return  # whatever the ranks that finished write after it
        tmp = run_dir / f".state-{os.getpid()}.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(run_dir / "state.json")


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def result_row(ctx: Context, status: str, reason: str | None, peak: int) -> dict[str, tp.Any]:
    spec, recipe = ctx.spec, ctx.recipe
    t = recipe.training
    part = spec.site.partitions[spec.partition]
    strategy = recipe.strategy
    is_bench = recipe.job.kind == "benchmark"
    size = SIZES[recipe.job.model] if is_bench else None  # type: ignore[union-attr]
    world = ctx.world_size
    tokens = world * t.micro_batch * t.grad_accum * t.seq_len
    peak_tflops = part.cpu_peak_tflops_per_rank
    if part.gpu and ctx.device.type == "cuda":
        peak_tflops = part.gpu.peak_fp16 if recipe.precision == "fp16-mixed" else part.gpu.peak_tflops_bf16
    measured = summarise(
        ctx.measured, t.warmup_steps, tokens if is_bench else None, world * t.micro_batch * t.grad_accum, world,
        size.flops_per_token(t.seq_len) if size else None, peak_tflops,
    )
    script = Path(spec.run_dir) / "script.sh"
    ds_version = sys.modules["deepspeed"].__version__ if "deepspeed" in sys.modules else None
    return {
        "run_id": spec.run_id, "sweep_id": spec.sweep_id, "point_id": spec.point_id, "stage": spec.stage,
        "site": spec.site.name, "cluster": spec.site.cluster or spec.site.name, "partition": spec.partition,
        "nodes": spec.nodes, "gpus_per_node": spec.gpus_per_node, "world_size": world,
        "gpu_model": part.gpu.model if part.gpu else "cpu", "interconnect": spec.site.network.interconnect,
        "strategy": strategy.name, "zero_stage": strategy.stage if isinstance(strategy, DeepSpeed) else None,
        "offload_optimizer": strategy.offload_optimizer if isinstance(strategy, DeepSpeed) else ("cpu" if isinstance(strategy, FSDP) and strategy.cpu_offload else "none"),
        "offload_param": strategy.offload_param if isinstance(strategy, DeepSpeed) else ("cpu" if isinstance(strategy, FSDP) and strategy.cpu_offload else "none"),
        "precision": recipe.precision, "job_kind": recipe.job.kind, "model": recipe.job.model if is_bench else None,  # type: ignore[union-attr]
        "parameters": size.parameters(t.seq_len) if size else None,
        "micro_batch": t.micro_batch, "grad_accum": t.grad_accum, "global_batch": world * t.micro_batch * t.grad_accum,
        "seq_len": t.seq_len, "steps": t.steps,
        "job_id": ctx.env.job_id, "node_list": ctx.env.node_list, "restart_count": ctx.env.restart_count,
        "start_time": ctx.started, "end_time": dt.datetime.now(dt.timezone.utc), "status": status, "reason": reason,
        "hpcrun_version": __version__, "torch_version": torch.__version__, "deepspeed_version": ds_version,
        "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        "git_sha": _git_sha(spec), "site_hash": _hash(spec.site.model_dump_json()), "recipe_hash": _hash(recipe.model_dump_json()),
        "script_hash": _hash(script.read_text()) if script.exists() else None,
        "first_step": ctx.start_step, "last_step": ctx.step if not ctx.stopped else ctx.step + 1,
        "peak_memory_bytes": peak, **measured, "extra": dict(ctx.measured.extra),
    }


def _git_sha(spec: RunSpec) -> str | None:
    """The commit of the user's code (the recipe's directory), when it is a git checkout."""
    if spec.recipe.job.kind == "benchmark":
        return None
    out = subprocess.run(["git", "-C", str(Path(spec.recipe_path).resolve().parent), "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or None
