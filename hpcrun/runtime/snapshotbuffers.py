"""The host buffers a rank's in-memory snapshots copy its state into, and where they are in their
life: one object, kept by the engine that fills them (hpcrun.runtime.engine) and read by the
snapshots (hpcrun.runtime.snapshot), which skip a snapshot due while they are being allocated.

The first snapshot's buffers are allocated on a thread of their own after the attempt's first
step (pinning a GPU's 15.6 GB held the training thread ~4 s), so that the first snapshot, like
every later one, holds training only for its copy; the snapshots reuse them from then on."""

from __future__ import annotations

import enum
import threading
import typing as tp
from concurrent import futures
from concurrent.futures import Future


class BufferState(enum.Enum):
    UNASKED = "unasked"  # the engine not asked yet, or it could not answer yet (an optimizer with no state)
    ALLOCATING = "allocating"  # on a thread of their own: the snapshots are busy (one due is skipped)
    READY = "ready"  # allocated aside, or none to allocate aside (the first snapshot's copy allocates them)


class SnapshotBuffers:
    """One rank's snapshot host buffers (`tensors`, once the first snapshot took them) and their
    `state`."""

    def __init__(self) -> None:
        self.tensors: tp.Any = None
        self.aside = False  # allocated on a thread of their own (the attempt's summary line says so)
        self._answered = False
        self._allocation: Future[tp.Any] | None = None  # allocating, or allocated and not yet taken

    @property
    def state(self) -> BufferState:
        if self._allocation is not None and not self._allocation.done():
            return BufferState.ALLOCATING
        return BufferState.READY if self._answered else BufferState.UNASKED

    def none_aside(self) -> None:
        """Nothing to allocate aside: another rank keeps this node's copy, the engine keeps buffers
        of its own (FSDP's stager), they exist already, or the engine has none to prepare."""
        self._answered = True

    def allocate(self, make: tp.Callable[[], tp.Any]) -> None:
        """`make` the buffers on a thread of their own, once; they are `take`n by the first snapshot."""
        self._answered = True
        if self.aside:
            return
        self.aside = True
        allocation = self._allocation = Future()

        def run() -> None:
            try:
                allocation.set_result(make())
            except BaseException as exc:  # noqa: BLE001 - raised by `take`: the first snapshot then allocates its own
                allocation.set_exception(exc)

        # a daemon: torch.empty releases the GIL while it allocates, and a stuck one must not hold the exit
        threading.Thread(target=run, name="hpcrun-snapshot-buffers", daemon=True).start()

    def take(self) -> tp.Any:
        """The buffers allocated aside as `tensors` (ready by the cadence's agreement: the snapshots
        are busy until then); raises what their allocation raised, `tensors` left as they were."""
        if self._allocation is not None:
            allocation, self._allocation = self._allocation, None
            self.tensors = allocation.result()
        return self.tensors

    def wait(self, timeout_s: float) -> None:
        """Until an allocation in flight ends, at most `timeout_s` (a thread inside torch at
        interpreter exit can abort the process)."""
        if self._allocation is not None:
            futures.wait([self._allocation], timeout=timeout_s)
