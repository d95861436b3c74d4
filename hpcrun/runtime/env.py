"""What a rank sees inside the allocation: its ranks, device and process group."""

from __future__ import annotations

import dataclasses
import datetime as dt
import os

import torch
import torch.distributed as dist

from hpcrun import slurm


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
    allocation_id: str  # the scheduler's own id of this allocation (SLURM_JOB_ID, unique per array task)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def from_scheduler() -> DistEnv:
    """This task's ranks. Under SLURM from submitit's JobEnvironment, with the job id spelled
    as hpcrun.slurm spells it for every SLURM tool (`<array>_<index>` for array tasks); under hpcrun's local controller from the torchrun-style variables
    it sets. MASTER_ADDR/PORT come from the rendered script (the site's fast hostname)."""
    if "SLURM_JOB_ID" in os.environ and "SLURM_PROCID" in os.environ:
        import submitit

        job = submitit.JobEnvironment()
        os.environ.update(RANK=str(job.global_rank), LOCAL_RANK=str(job.local_rank), WORLD_SIZE=str(job.num_tasks))
        os.environ.setdefault("MASTER_ADDR", job.hostnames[0] if job.hostnames else "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        local_ranks = int(os.environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])
        return _env(job.global_rank, job.local_rank, job.num_tasks, slurm.job_id(os.environ), os.environ["SLURM_JOB_ID"], local_ranks)
    local_id = os.environ.get("HPCRUN_LOCAL_JOB_ID", "local")
    return from_environ(job_id=local_id, allocation_id=local_id)


def from_environ(job_id: str | None = None, allocation_id: str | None = None) -> DistEnv:
    """Ranks from torchrun-style variables (the local controller, tests, command jobs)."""
    job_id = job_id or os.environ.get("SLURM_JOB_ID", "local")
    return _env(
        int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
        job_id, allocation_id or job_id, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1))),
    )


def _env(rank: int, local_rank: int, world: int, job_id: str, allocation_id: str, local_ranks: int) -> DistEnv:
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        if "OMP_NUM_THREADS" not in os.environ:  # ranks sharing a node's cores must not oversubscribe them
            torch.set_num_threads(cpu_threads(local_ranks))
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        device=device,
        backend=backend,
        # SLURM counts requeues; hpcrun's local controller is told which submission this is
        restart_count=int(os.environ.get("SLURM_RESTART_COUNT", os.environ.get("HPCRUN_RESTART_COUNT", "0"))),
        job_id=job_id,
        node_list=os.environ.get("SLURM_JOB_NODELIST", os.uname().nodename),
        allocation_id=allocation_id,
    )


def cpu_threads(local_ranks: int) -> int:
    """Intra-op threads for one of `local_ranks` CPU ranks: an equal share of the cores this
    process may run on (its affinity, which SLURM narrows to the task's CPUs)."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, local_ranks))


def init_process_group(env: DistEnv, timeout_s: int) -> None:
    """Join the job's process group. `timeout_s` (the recipe's fault.collective_timeout_s) bounds
    every collective: a dead peer must end the job, not hold the allocation until its limit."""
    if not dist.is_initialized():
        dist.init_process_group(
            backend=env.backend, rank=env.rank, world_size=env.world_size, timeout=dt.timedelta(seconds=timeout_s),
            device_id=env.device if env.backend == "nccl" else None,
        )
