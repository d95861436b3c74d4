"""The stop vote's spacing (hpcrun.runtime.vote `StopVote`): the number of steps between votes
comes from the slowest step since the vote before, not from the one step at which a vote was cast,
so slow steps between two fast ones do not keep the vote (and a stop) waiting hundreds of steps."""

from __future__ import annotations

import torch

from hpcrun.runtime.env import DistEnv
from hpcrun.runtime.vote import StopVote
from hpcrun.signals import SignalFlag


class Recorder:
    """What the vote asks the step recorder: never a flush, never a probe."""

    def due(self, ahead: int = 0) -> bool:
        return False

    def probe_due(self) -> bool:
        return False


def test_the_interval_follows_the_slowest_step_since_the_last_vote() -> None:
    env = DistEnv(0, 0, 1, torch.device("cpu"), "gloo", 0, "local", "local", "local")
    vote, recorder = StopVote(env, SignalFlag()), Recorder()

    def step_end(done: int, step_s: float) -> None:
        vote.read(done, 10_000, step_s)
        vote.cast(done, 10_000, recorder)

    fast, slow = 0.001, 0.5
    step_end(1, fast)  # cast with 1 ms steps
    step_end(2, fast)  # read: 250 steps to the next vote
    assert vote.every == 250 and vote.next_at == 252
    for done in range(3, 252):
        step_end(done, slow if done < 200 else fast)  # a slow phase, then fast again
    step_end(252, fast)  # read; cast at a fast step, carrying the slow phase's steps
    assert vote.next_at == 502
    for done in range(253, 503):
        step_end(done, fast)  # read at 502
    assert vote.every == 1, f"{vote.every} steps to the next vote after 0.5 s steps"
