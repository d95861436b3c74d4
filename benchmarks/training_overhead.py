"""Training overhead: the built-in benchmark under hpcrun, as users run it (the recipe's defaults:
DDP with its own bucketed all-reduce, bit-exact resume, the stop vote, metrics, watchdog), against
a minimal hand-written torch DDP loop on the same model, data, optimizer, clipping and threads per
rank, alternated in the same run (ABBA). Target: hpcrun's throughput >= 0.98 of the bare loop.

Two places:
- on this machine (default): 2 ranks, gloo over loopback, hpcrun through `--site local`
  (submitit's local executor), the bare loop under torch.multiprocessing;
- `--cluster`: 2 nodes x 2 ranks on the test cluster (tests/cluster/testcluster.sh up), gloo over
  the nodes' `hpc0` links, both arms as SLURM jobs on the same partition (hpcrun's through
  `hpcrun submit`, the bare loop through a plain sbatch script that sruns this file). Here the
  all-reduces and the stop vote cross a network.

hpcrun's jobs are submitted detached and waited for with one look at state.json every 2 s:
`--follow` (`submit --wait`) adds a process polling every second on the ranks' cores, which on a
cluster runs on the login node instead. Each rank 0 also reports in-process the time its training
thread spent in each part of hpcrun's per-step work (the stop vote, the checkpoint poll, per-step
metrics, the watchdog's beat), which the machine's noise does not blur; this script prints each
part's share of step time. `--flush-steps` sets `metrics.flush_steps` (default: the recipe's).

    python benchmarks/training_overhead.py [--cluster] [--model small] [--steps 60] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml
from scratch import ROOT, scratch, scratch_site  # benchmarks/scratch.py

PARTITION = "batch"  # the test cluster's first pool


def bare(
    rank: int, world: int, local_world: int, model: str, steps: int, warmup: int, mb: int, seq: int, out: str
) -> None:
    """The bare DDP loop, one rank; MASTER_ADDR/MASTER_PORT and GLOO_SOCKET_IFNAME set by the caller."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hpcrun.runtime.model import GPT, synthetic_batch
    from hpcrun.sizes import SIZES

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))  # hpcrun's share of cores per rank
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    size = SIZES[model]
    ddp = DistributedDataParallel(
        GPT(size, seq), gradient_as_bucket_view=True
    )  # as hpcrun's default, so only the harness differs
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        x, y = synthetic_batch(0, step, rank * mb, mb, seq, size.vocab)
        loss = ddp(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(str(world * mb * seq / statistics.fmean(times[warmup:])))
    dist.destroy_process_group()


def bare_spawned(rank: int, world: int, port: int, args: tuple[object, ...]) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo"
    )  # as the local site gives hpcrun's ranks
    bare(rank, world, world, *args)  # type: ignore[arg-type]


def bare_args(args: argparse.Namespace, out: Path) -> tuple[object, ...]:
    return (args.model, args.steps, args.warmup, args.micro_batch, args.seq_len, str(out))


def run_bare_local(args: argparse.Namespace, tmp: Path) -> float:
    import torch.multiprocessing as mp

    out = tmp / "bare.txt"
    mp.spawn(bare_spawned, args=(2, 29000 + os.getpid() % 1000, bare_args(args, out)), nprocs=2)
    return float(out.read_text())


def run_bare_cluster(args: argparse.Namespace, tmp: Path, n: int) -> float:
    """The bare loop as a SLURM job of 2 nodes x 2 tasks, the network set up as hpcrun's
    script sets it for the test cluster (sites/testcluster.yaml)."""
    out = tmp / f"bare{n}.txt"
    call = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--bare-rank",
        str(out),
        "--model",
        args.model,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--micro-batch",
        str(args.micro_batch),
        "--seq-len",
        str(args.seq_len),
    ]
    script = tmp / f"bare{n}.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --partition={PARTITION} --nodes=2 --ntasks-per-node=2 --time=00:30:00 --output={tmp}/bare{n}.log
set -eo pipefail
export GLOO_SOCKET_IFNAME=hpc0
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
srun {shlex.join(call)}
""")
    job = (
        subprocess.run(["sbatch", "--parsable", str(script)], check=True, capture_output=True, text=True)
        .stdout.strip()
        .split(";")[0]
    )
    wait_slurm_job(job)
    if not out.exists():
        raise SystemExit(f"the bare loop's job {job} wrote nothing: see {tmp}/bare{n}.log")
    return float(out.read_text())


def wait_slurm_job(job: str) -> None:
    while True:
        line = subprocess.run(
            ["sacct", "-X", "-n", "-P", "-j", job, "-o", "State"], capture_output=True, text=True
        ).stdout.strip()
        if line and line.split()[0] not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING"):
            if line.split()[0] != "COMPLETED":
                raise SystemExit(f"job {job} ended {line}")
            return
        time.sleep(2)


def bare_slurm_rank(args: argparse.Namespace) -> None:
    env = os.environ
    bare(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env["SLURM_NTASKS_PER_NODE"].split("(")[0]),
         *bare_args(args, Path(args.bare_rank)))  # type: ignore[arg-type]


LINE = (r"hpcrun's per-step work: [\d.]+ ms on the training thread over \d+ steps \(([\d.]+)% of step time: (.*?)\); "
        r"watchdog thread [\d.]+ ms of CPU \(([\d.]+)%\)")


def shares_of(tmp: Path, run_id: str) -> dict[str, float]:
    """What rank 0's training thread spent on each part of hpcrun's per-step work, and the
    watchdog thread's CPU time, as shares of the run's step time (from its log)."""
    from hpcrun.rundir import RunDir

    run = RunDir(tmp / "runs" / run_id)
    log = run.log(run.latest_job()["job_id"], 0, "out").read_text()  # type: ignore[index]
    found = re.search(LINE, log)
    assert found, f"no per-step cost line in {run.path}'s rank 0 log"
    shares = {"all of it": float(found.group(1)) / 100, "watchdog thread (CPU)": float(found.group(3)) / 100}
    for part in found.group(2).split(", "):
        name, share = part.rsplit(" ", 1)
        shares[name] = float(share.rstrip("%")) / 100
    return shares


def run_hpcrun(
    args: argparse.Namespace, tmp: Path, n: int, shares: list[dict[str, float]], probe: bool = True
) -> float:
    from hpcrun.results import load

    name = f"overhead{n}" + ("" if probe else "noprobe")
    resources = (
        {"nodes": 2, "gpus_per_node": 2, "partition": PARTITION} if args.cluster else {"nodes": 1, "gpus_per_node": 2}
    )
    recipe = {
        "name": name,
        "job": {"kind": "benchmark", "model": args.model},
        "resources": {**resources, "time": "00:30:00"},
        "training": {
            "steps": args.steps,
            "warmup_steps": args.warmup,
            "micro_batch": args.micro_batch,
            "seq_len": args.seq_len,
            "lr": 1e-3,
        },
        "checkpoint": {"interval": 10**6},  # the bare loop saves nothing either (apart from the final save)
    }
    if args.flush_steps:
        recipe["metrics"] = {"flush_steps": args.flush_steps}
    if not probe:
        recipe["fault"] = {"straggler_factor": None}
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    submit = [sys.executable, "-m", "hpcrun.cli", "submit", "--site", str(tmp / "site.yaml"), str(tmp / "recipe.yaml")]
    if args.follow:  # the CLI following the job shares the ranks' cores here (on a cluster it runs on the login node)
        subprocess.run(submit[:3] + ["--wait"] + submit[3:], cwd=ROOT, check=True, capture_output=True)
    else:
        out = subprocess.run(submit, cwd=ROOT, check=True, capture_output=True, text=True).stdout
        run_dir = Path(next(line.split("run dir:")[1].strip() for line in out.splitlines() if "run dir:" in line))
        while not (run_dir / "state.json").exists() or json.loads((run_dir / "state.json").read_text()).get(
            "status"
        ) not in ("completed", "failed"):
            time.sleep(2)  # one look every 2 s: nothing else competes with the ranks
    df = load(tmp / "results")
    row = df[df["run_id"].str.endswith(name)].iloc[-1]
    assert row["status"] == "completed", row.to_dict()
    shares.append(shares_of(tmp, row["run_id"]))
    return float(row["tokens_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cluster", action="store_true", help="2 nodes x 2 ranks on the test cluster")
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--flush-steps", type=int, default=None)
    parser.add_argument("--without-probe", action="store_true", help="a third arm: hpcrun with the slow-rank probe off")
    parser.add_argument(
        "--follow", action="store_true", help="hpcrun submit --wait (the CLI then shares the cores with the ranks)"
    )
    parser.add_argument("--bare-rank", help=argparse.SUPPRESS)  # one rank of the bare loop under srun (--cluster)
    args = parser.parse_args()
    if args.bare_rank:
        return bare_slurm_rank(args)
    tmp = scratch(
        "overhead-", parent="/var/tmp" if args.cluster else None
    )  # the nodes see /var/tmp, not this user's /tmp
    scratch_site(tmp, "testcluster" if args.cluster else "local")
    bare_tps: list[float] = []
    hpc_tps: list[float] = []
    unprobed_tps: list[float] = []
    shares: list[dict[str, float]] = []
    arms = [
        lambda n: bare_tps.append(run_bare_cluster(args, tmp, n) if args.cluster else run_bare_local(args, tmp)),
        lambda n: hpc_tps.append(run_hpcrun(args, tmp, n, shares)),
    ]
    if args.without_probe:
        arms.append(lambda n: unprobed_tps.append(run_hpcrun(args, tmp, n, [], probe=False)))
    for n in range(args.rounds):  # AB then BA, so drift on a noisy machine hits every arm alike
        for arm in arms if n % 2 == 0 else arms[::-1]:
            arm(n)
        unprobed = (
            f", hpcrun without the probe {unprobed_tps[-1]:.0f} ({unprobed_tps[-1] / bare_tps[-1]:.3f})"
            if unprobed_tps
            else ""
        )
        print(
            f"round {n}: bare {bare_tps[-1]:.0f} tokens/s, hpcrun {hpc_tps[-1]:.0f} "
            f"(ratio {hpc_tps[-1] / bare_tps[-1]:.3f}){unprobed}, "
            f"hpcrun's per-step work {100 * shares[-1]['all of it']:.2f}% of step time",
            flush=True,
        )
    ratios = [h / b for h, b in zip(hpc_tps, bare_tps)]
    where = "2 nodes x 2 ranks, test cluster" if args.cluster else "2 ranks, this machine"
    print(f"hpcrun (defaults) / bare DDP loop, {where}, {args.rounds} rounds: median {statistics.median(ratios):.3f}, "
          f"mean {statistics.fmean(ratios):.3f}, of totals {sum(hpc_tps) / sum(bare_tps):.3f}, "
          f"spread {min(ratios):.3f}-{max(ratios):.3f} (target >= 0.98)")
    if unprobed_tps:
        ratios = [u / b for u, b in zip(unprobed_tps, bare_tps)]
        print(f"hpcrun with fault.straggler_factor: null / bare DDP loop: median {statistics.median(ratios):.3f}, "
              f"spread {min(ratios):.3f}-{max(ratios):.3f}")
    print("share of step time on rank 0's training thread (in-process), median and max over rounds:")
    for part in shares[0]:
        values = [x[part] for x in shares]
        print(f"  {part:32s} {100 * statistics.median(values):.3f}%  (max {100 * max(values):.3f}%)")


if __name__ == "__main__":
    main()
