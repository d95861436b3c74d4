"""The built-in GPT benchmark's training with a pause after every step, as an entrypoint job.

Fault and requeue tests signal or kill a job mid-run. Sized in steps, such a job's length
depends on how fast this machine's CPU is; with `step_delay_s` it lasts at least
`steps * step_delay_s` seconds anywhere. The pause changes no number: a run with any delay
ends with the same weights as one without, so an uninterrupted baseline may run with none.

Recipe: `job: {kind: entrypoint, entrypoint: "tests.delayed_training:train",
pythonpath: [<repo root>], args: {step_delay_s: 0.1, model: tiny}}`.
"""

from __future__ import annotations

import time
import typing as tp

import torch

from hpcrun.runtime.model import GPT, synthetic_batch
from hpcrun.sizes import SIZES


def entrypoint_job(root: str, step_delay_s: float, model: str = "tiny") -> dict[str, tp.Any]:
    """The recipe's `job:` section for this entrypoint."""
    return {
        "kind": "entrypoint", "entrypoint": "tests.delayed_training:train", "pythonpath": [root],
        "args": {"step_delay_s": step_delay_s, "model": model},
    }


def train(ctx: tp.Any) -> None:
    """What the built-in benchmark does (same model, data and optimizer), plus the pause."""
    training = ctx.recipe.training
    delay = float(ctx.args["step_delay_s"])
    size = SIZES[ctx.args.get("model", "tiny")]
    torch.manual_seed(training.seed)
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
        time.sleep(delay)  # inside the step: a signal usually lands mid-step, as on a real cluster
