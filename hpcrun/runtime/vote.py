"""The stop vote: what every rank must learn at the same step, one tiny all-reduce apart."""

from __future__ import annotations

import dataclasses
import math
import typing as tp

import torch
import torch.distributed as dist

from hpcrun.runtime.env import DistEnv
from hpcrun.signals import SignalFlag


class Recorder(tp.Protocol):
    """What the vote asks the step recorder (hpcrun.runtime.steps `StepRecorder`)."""

    def due(self, ahead: int = 0) -> bool: ...

    def probe_due(self) -> bool: ...


@dataclasses.dataclass(frozen=True)
class Agreed:
    """What a vote read at this step says, the same on every rank."""

    signum: int = 0
    """The stop signal some rank caught (0: none)."""
    flush: bool = False
    """Some rank wants the steps' metrics flushed."""
    probing: bool = False
    """Some rank wants slow ranks probed."""
    ballots: tuple[int, ...] | None = None
    """The MAX over ranks of what the saves cast (hpcrun.runtime.cadence `Cadence.ballot`);
    None: no vote was read at this step."""


class StopVote:
    """Every rank learns whether any rank was signalled to stop, whether any wants the metrics
    flushed (and slow ranks probed) at the next flush, and whether a save spaced by time is due:
    one tiny all-reduce (MAX), cast at one step's end and read where the next is cast, at least one
    step and EVERY_S later. Read at once, it would hold every step until the slowest rank arrived;
    read later it has long completed. Each vote also carries the slowest step any rank made since
    the vote before, from which every rank computes the same number of steps to the next one. The
    price: a stop signal is acted on up to two vote intervals after it arrives (README, "Stop
    latency"). Every rank reads the same result at the same step, so all stop (and save) together.

    At a step's end: `read` first (what the vote cast earlier says), then the saves it decides,
    then `cast`, so that a save begun at this step is in what the next vote carries."""

    EVERY_S = 0.25  # the least time between votes: ~0.2 ms each, nothing measurable at this spacing

    def __init__(self, env: DistEnv, flag: SignalFlag) -> None:
        self.env, self.flag = env, flag
        self.pending: tuple[tp.Any, torch.Tensor] | None = None
        self.next_at: int | None = None  # the step (completed count) of the next vote; None: this one
        self.every = 1
        self.slowest_s = 0.0  # this rank's slowest step since its last cast
        self._casting = False  # a vote was read at this step: `cast` casts the next

    def read(self, done: int, total: int, step_s: float) -> Agreed:
        """At the end of step `done`: the vote read here, if one is due (none at an attempt's first step)."""
        self.slowest_s = max(self.slowest_s, step_s)
        self._casting = False
        if self.next_at is not None and done < self.next_at:
            return Agreed()
        agreed = self._read()
        self._casting = not agreed.signum and done < total
        return agreed

    def cast(
        self, done: int, total: int, recorder: Recorder, ballots: tp.Callable[[], tp.Sequence[int]] = lambda: ()
    ) -> None:
        """After the saves of step `done`: the next vote, where `read` just read one (`ballots` are
        asked for only then)."""
        if not self._casting:
            return
        self._casting = False
        self._cast(
            [
                self.flag.signum or 0,
                int(recorder.due(ahead=self.every)),
                int(recorder.probe_due()),
                round(self.slowest_s * 1e6),
                *ballots(),
            ]
        )
        self.slowest_s = 0.0
        self.next_at = min(done + self.every, total)  # the last step reads it: none left in flight

    def _cast(self, votes: list[int]) -> None:
        local = torch.tensor(votes, dtype=torch.int64, device=self.env.device)
        work = (
            dist.all_reduce(local, op=dist.ReduceOp.MAX, async_op=True)
            if dist.is_initialized() and self.env.world_size > 1
            else None
        )
        self.pending = (work, local)

    def _read(self) -> Agreed:
        if self.pending is None:
            return Agreed()  # the attempt's first vote: nothing cast yet
        (work, votes), self.pending = self.pending, None
        if work is not None:
            work.wait()
        signum, flush, probing, step_us, *ballots = (int(v) for v in votes.tolist())
        if step_us:
            self.every = max(1, math.ceil(self.EVERY_S * 1e6 / step_us))
        return Agreed(signum, bool(flush), bool(probing), tuple(ballots))
