"""The asynchronous checkpoint writer's own gloo group (hpcrun.runtime.checkpoint.Checkpoints) waits
for a lost peer no longer than the recipe's fault.collective_timeout_s, not torch's 30-minute
default. torch has no public way to read a group's timeout: two CPU ranks show it, one whose write
waits in the group for a peer that stays alive and never joins."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
import typing as tp
from concurrent.futures import Future
from pathlib import Path

TIMEOUT_S = 2  # what the recipe would say (fault.collective_timeout_s), short for the test
WAIT_S = 12  # how long the parent waits for rank 0's verdict: far more than TIMEOUT_S, far less than 30 minutes


class PeerNeverJoins:
    """An engine whose background write is one all-reduce in the writer's group on rank 0, and
    nothing on rank 1: rank 0 waits for a peer that is alive and never comes (a peer lost
    mid-write whose process has not gone, e.g. on a dead node)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def save_async(self, path: Path, group: tp.Any) -> Future[None]:
        import threading

        import torch
        import torch.distributed as dist

        done: Future[None] = Future()
        if self.rank != 0:
            done.set_result(None)
            return done

        def write() -> None:
            try:
                dist.all_reduce(torch.ones(1), group=group)
                done.set_result(None)
            except Exception as exc:  # noqa: BLE001 - the write's error is the save's, raised by wait()
                done.set_exception(exc)

        threading.Thread(target=write, daemon=True).start()
        return done


def rank_main(rank: int, port: int, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    from hpcrun.runtime import checkpoint as ckpt
    from hpcrun.runtime.env import DistEnv

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    env = DistEnv(rank, rank, 2, torch.device("cpu"), "gloo", 0, "t", "localhost", "t")
    checkpoints = ckpt.Checkpoints(Path(tmp) / "checkpoints", env, keep=2, strategy="ddp", asynchronous=True)
    checkpoints.timeout_s = TIMEOUT_S  # as hpcrun.runtime.attempt sets it from the recipe
    done = Path(tmp) / "rank0.json"
    checkpoints.save(PeerNeverJoins(rank), 1, {"step": 1})  # the writer group is made here, on both ranks
    if rank == 0:
        (Path(tmp) / "waiting").touch()  # the parent's clock starts here: what came before is the machine's
        start = time.monotonic()
        try:
            checkpoints.wait()
            outcome = "the save completed"
        except Exception as exc:  # noqa: BLE001 - what ended the wait is the answer
            outcome = f"{type(exc).__name__}: {exc}"
        done.write_text(json.dumps({"seconds": time.monotonic() - start, "outcome": outcome}))
    else:  # alive until rank 0 has its answer: a peer's exit would end rank 0's wait at once
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    os._exit(0)  # rank 0's group is broken: no teardown that could wait on it


def test_the_writer_group_waits_for_a_lost_peer_no_longer_than_the_collective_timeout(tmp_path: Path) -> None:
    spawn = multiprocessing.get_context("spawn")
    port = 29900 + os.getpid() % 90
    ranks = [spawn.Process(target=rank_main, args=(rank, port, str(tmp_path))) for rank in (0, 1)]
    for process in ranks:
        process.start()
    done = tmp_path / "rank0.json"
    try:
        # two ranks importing torch, a barrier, an fsync'd write and the writer group's creation on a loaded
        # machine (CI once took over 12 s from the checkpoint folder's creation to the wait), then the wait
        deadline = time.monotonic() + 90 + WAIT_S
        while time.monotonic() < deadline and not done.exists() and any(p.is_alive() for p in ranks):
            time.sleep(0.2)
            if (tmp_path / "waiting").exists() and not done.exists():
                deadline = min(deadline, time.monotonic() + WAIT_S)  # rank 0 waits for its write
        assert done.exists(), f"rank 0's save still waiting for its peer after {WAIT_S} s (exit codes " \
                              f"{[p.exitcode for p in ranks]})"
    finally:
        for process in ranks:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()
    said = json.loads(done.read_text())
    assert said["outcome"] != "the save completed", said
    assert TIMEOUT_S - 0.5 <= said["seconds"] <= TIMEOUT_S + 5, said
