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
    attempt: int
    """hpcrun's attempt number in this job: every start of the training step, by a requeue or a
    restart inside the job (the batch script's HPCRUN_ATTEMPT); names the attempt's files and rows, and
    is `attempt` on disk too (state.json, the results and steps tables, progress.json)."""
    job_id: str
    node_list: str
    allocation_id: str  # the scheduler's own id of this allocation (SLURM_JOB_ID, unique per array task)
    slurm_requeues: int = 0
    """SLURM's count of this job's requeues (SLURM_RESTART_COUNT): what the requeue cap counts."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def from_scheduler() -> DistEnv:
    """This task's ranks. Under SLURM from the variables srun sets for every task (SLURM_PROCID,
    SLURM_LOCALID, SLURM_NTASKS), with the job id spelled as hpcrun.slurm spells it for every SLURM
    tool (`<array>_<index>` for array tasks); under hpcrun's local controller from the
    torchrun-style variables it sets. MASTER_ADDR/PORT come from the rendered script (the site's
    fast hostname)."""
    environ = os.environ
    if "SLURM_JOB_ID" in environ and "SLURM_PROCID" in environ:
        rank, local_rank, world = (
            int(environ["SLURM_PROCID"]),
            int(environ["SLURM_LOCALID"]),
            int(environ["SLURM_NTASKS"]),
        )
        environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world))
        environ.setdefault("MASTER_ADDR", first_host(environ.get("SLURM_JOB_NODELIST", "")) or "127.0.0.1")
        environ.setdefault("MASTER_PORT", "29500")
        local_ranks = int(environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])
        return _env(rank, local_rank, world, slurm.job_id(environ), environ["SLURM_JOB_ID"], local_ranks)
    local_id = environ.get("HPCRUN_LOCAL_JOB_ID", "local")
    return from_environ(job_id=local_id, allocation_id=local_id)


def first_host(node_list: str) -> str:
    """The first host of a SLURM node list (`gpu[07-12,20],cpu3` -> `gpu07`), as `scontrol show
    hostnames` would list it first; "" for an empty list."""
    head = node_list.split(",", 1)[0] if "[" not in node_list.split(",", 1)[0] else node_list.split("]", 1)[0]
    prefix, _, ranges = head.partition("[")
    return prefix + ranges.split(",", 1)[0].split("-", 1)[0]


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
        attempt=slurm.attempt_number(os.environ),
        slurm_requeues=slurm.requeue_count(os.environ),
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
