"""Plain Python callables the executor tests submit (importable inside the job: cloudpickle pickles
them by reference to this module)."""

from __future__ import annotations

import os
import socket
import time
import typing as tp
from pathlib import Path

import submitit


def where(x: int) -> dict[str, tp.Any]:
    """What a task sees: its ranks (hpcrun's variables and submitit's JobEnvironment) and node."""
    env = submitit.JobEnvironment()
    torch_env = submitit.helpers.TorchDistributedEnvironment()  # what submitit users' DDP code reads
    return {
        "torch_env": (torch_env.master_addr, torch_env.master_port, torch_env.rank, torch_env.world_size,
                      torch_env.local_world_size),
        "x": x, "rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
        "local_rank": int(os.environ["LOCAL_RANK"]), "master": os.environ["MASTER_ADDR"],
        "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
        "env_rank": env.global_rank, "env_tasks": env.num_tasks, "job_id": env.job_id,
    }


def square(x: int, hold_s: float) -> int:
    """x squared after `hold_s` seconds, noting when it ran (start and end) in its task's log."""
    print(f"start {time.time()}", flush=True)
    time.sleep(hold_s)
    print(f"end {time.time()}", flush=True)
    return x * x


def append_and_raise(path: str) -> None:
    """Notes that it ran (a line appended to `path`), then fails: the call's own error."""
    with open(path, "a") as out:
        out.write(f"{os.environ.get('SLURM_RESTART_COUNT', '0')}\n")
    raise ValueError("the call's own error")


class Counter(submitit.helpers.Checkpointable):
    """Counts to `total`, one step per `step_s`; its own state is its checkpoint (submitit's
    Checkpointable: `checkpoint` pickles the object as it is). `progress` is a file where it writes
    each step, so a test knows when to interrupt it."""

    def __init__(self) -> None:
        self.done = 0
        self.resumed_from: int | None = None
        self.requeues: list[str] = []

    def __call__(self, total: int, step_s: float, progress: str) -> dict[str, tp.Any]:
        self.requeues.append(os.environ.get("SLURM_RESTART_COUNT", os.environ.get("HPCRUN_REQUEUES", "0")))
        if self.done and self.resumed_from is None:
            self.resumed_from = self.done
        while self.done < total:
            time.sleep(step_s)
            self.done += 1
            Path(progress).write_text(str(self.done))
        return {"done": self.done, "resumed_from": self.resumed_from, "requeues": self.requeues}


class CollectiveCounter(submitit.helpers.Checkpointable):
    """Counts to `total` in all-reduces over the call's own gloo process group, rank r pausing
    r x `pause_s` before each: a stop finds the ranks in different places (some inside the
    collective, waiting for a peer still pausing). Rank 0 writes its count to `progress`."""

    def __init__(self) -> None:
        self.done = 0
        self.requeues: list[str] = []

    def __call__(self, total: int, pause_s: float, progress: str) -> dict[str, tp.Any]:
        import torch
        import torch.distributed as dist

        self.requeues.append(os.environ.get("SLURM_RESTART_COUNT", "0"))
        dist.init_process_group("gloo")  # hpcrun's rendezvous: MASTER_ADDR/PORT, RANK, WORLD_SIZE
        rank = dist.get_rank()
        while self.done < total:
            time.sleep(rank * pause_s)
            dist.all_reduce(torch.ones(1))
            self.done += 1
            if rank == 0:
                Path(progress).write_text(str(self.done))
        world = dist.get_world_size()
        dist.destroy_process_group()
        return {"done": self.done, "world": world, "requeues": self.requeues}
