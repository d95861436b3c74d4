"""tests.delayed_training's training whose last in-memory snapshot fails while it is still in flight at
the end of the loop: the engine's write of the snapshot of step `failing_step` waits until the last
step has run, a moment more, then raises ENOSPC (a full tmpfs). The rank that writes the engine
state (DDP: each node's first) is the one it fails on; every rank counts it.

Recipe: `job: {kind: entrypoint, entrypoint: "tests.failing_snapshot:train", pythonpath: [<repo root>],
args: {step_delay_s: 0.5, failing_step: 6}}`, with `checkpoint.memory_interval` such that
`failing_step` is the last snapshot due.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import typing as tp
from pathlib import Path

from hpcrun import rundir
from hpcrun.runtime.jobs import builtin_benchmark
from hpcrun.sizes import SIZES

LATE_S = 1.0  # after the last step: the loop has ended (its summary line is due) while the write still runs


def entrypoint_job(root: str, step_delay_s: float, failing_step: int) -> dict[str, tp.Any]:
    """The recipe's `job:` section for this entrypoint."""
    return {
        "kind": "entrypoint", "entrypoint": "tests.failing_snapshot:train", "pythonpath": [root],
        "args": {"step_delay_s": step_delay_s, "failing_step": failing_step},
    }


def train(ctx: tp.Any) -> None:
    delay, failing = float(ctx.args["step_delay_s"]), int(ctx.args["failing_step"])
    ended = threading.Event()

    def after_step(step: int) -> None:
        if step == ctx.start_step:  # the engine is built by now: its snapshot write is wrapped once
            write = ctx.engine.write_snapshot

            def write_snapshot(state: dict[str, tp.Any], directory: Path) -> None:
                if directory.parent == rundir.partial_step_dir(directory.parent.parent, failing):
                    ended.wait(60)
                    time.sleep(LATE_S)
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
                write(state, directory)

            ctx.engine.write_snapshot = write_snapshot
        if step == ctx.recipe.training.steps - 1:
            ended.set()
        time.sleep(delay)

    builtin_benchmark(ctx, SIZES["tiny"], after_step=after_step)
