"""What a rank sees inside the allocation: its ranks, device and process group."""

from __future__ import annotations

import dataclasses
import datetime as dt
import os

import torch
import torch.distributed as dist

# A dead peer must end the job, not hang it until the time limit.
COLLECTIVE_TIMEOUT = dt.timedelta(seconds=int(os.environ.get("HPCRUN_COLLECTIVE_TIMEOUT_S", "600")))


@dataclasses.dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    restart_count: int
    job_id: str
    node_list: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def from_scheduler() -> DistEnv:
    """Ranks from submitit's JobEnvironment (SLURM or local), exported as torch expects.
    MASTER_ADDR/PORT come from the rendered script (the site's fast hostname)."""
    import submitit

    job = submitit.JobEnvironment()
    os.environ.update(RANK=str(job.global_rank), LOCAL_RANK=str(job.local_rank), WORLD_SIZE=str(job.num_tasks))
    os.environ.setdefault("MASTER_ADDR", job.hostnames[0] if job.hostnames else "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    return _env(job.global_rank, job.local_rank, job.num_tasks, str(job.job_id))


def from_environ() -> DistEnv:
    """Ranks from torchrun-style variables (tests and command jobs)."""
    return _env(int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), os.environ.get("SLURM_JOB_ID", "local"))


def _env(rank: int, local_rank: int, world: int, job_id: str) -> DistEnv:
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        if "OMP_NUM_THREADS" not in os.environ:  # ranks sharing a node's cores must not oversubscribe them
            local_ranks = int(os.environ.get("SLURM_NTASKS_PER_NODE", os.environ.get("SUBMITIT_LOCAL_NTASKS", "1")).split("(")[0])
            torch.set_num_threads(cpu_threads(local_ranks))
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        device=device,
        backend=backend,
        restart_count=int(os.environ.get("SLURM_RESTART_COUNT", os.environ.get("HPCRUN_RESTART_COUNT", "0"))),
        job_id=job_id,
        node_list=os.environ.get("SLURM_JOB_NODELIST", os.uname().nodename),
    )


def cpu_threads(local_ranks: int) -> int:
    """Intra-op threads for one of `local_ranks` CPU ranks: an equal share of the cores this
    process may run on (its affinity, which SLURM narrows to the task's CPUs)."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, local_ranks))


def init_process_group(env: DistEnv) -> None:
    if not dist.is_initialized():
        dist.init_process_group(
            backend=env.backend, rank=env.rank, world_size=env.world_size, timeout=COLLECTIVE_TIMEOUT,
            device_id=env.device if env.backend == "nccl" else None,
        )
