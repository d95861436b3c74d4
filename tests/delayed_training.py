"""The built-in GPT benchmark's training with a pause after every step, as an entrypoint job.

Fault and requeue tests signal or kill a job mid-run. Sized in steps, such a job's length
depends on how fast this machine's CPU is; with `step_delay_s` it lasts at least
`steps * step_delay_s` seconds anywhere. The pause changes no number: a run with any delay
ends with the same weights as one without, so an uninterrupted baseline may run with none.

Recipe: `job: {kind: entrypoint, entrypoint: "tests.delayed_training:train",
pythonpath: [<repo root>], args: {step_delay_s: 0.1, model: tiny}}`. With `first_attempt_delay_s`
the first attempt pauses that long instead: a test that must act on it before it ends (after
something that takes a bounded but long time) gets the window without slowing the attempts after.
"""

from __future__ import annotations

import time
import typing as tp

from hpcrun.runtime.jobs import builtin_benchmark
from hpcrun.sizes import SIZES


def entrypoint_job(
    root: str, step_delay_s: float, model: str = "tiny", first_attempt_delay_s: float | None = None
) -> dict[str, tp.Any]:
    """The recipe's `job:` section for this entrypoint."""
    first = {} if first_attempt_delay_s is None else {"first_attempt_delay_s": first_attempt_delay_s}
    return {
        "kind": "entrypoint", "entrypoint": "tests.delayed_training:train", "pythonpath": [root],
        "args": {"step_delay_s": step_delay_s, "model": model, **first},
    }


def train(ctx: tp.Any) -> None:
    """The built-in benchmark (same model, data and optimizer), with the pause inside each step:
    a signal usually lands mid-step, as on a real cluster."""
    delay = float(ctx.args["step_delay_s"])
    if ctx.env.attempt == 0:
        delay = float(ctx.args.get("first_attempt_delay_s", delay))
    builtin_benchmark(ctx, SIZES[ctx.args.get("model", "tiny")], after_step=lambda step: time.sleep(delay))
