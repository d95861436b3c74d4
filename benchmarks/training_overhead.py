"""Training overhead: the built-in benchmark under hpcrun (submitit local executor, DDP, 2
processes, gloo on CPU) against a minimal hand-written torch DDP loop on the same model and
data, alternated in the same run. Target: hpcrun's throughput >= 0.98 of the bare loop.

hpcrun's jobs are submitted detached and waited for with one look at state.json every 2 s:
`submit --wait` (`--follow`) adds a process polling every second on the ranks' two cores, which
on a cluster runs on the login node instead (measured at ~5% here).

Two hpcrun arms: `comm_hook: none` (DDP's own bucketed all-reduce, as the bare loop) measures the
harness, every per-step thing hpcrun adds (stop-flag all-reduce, checkpoint poll, watchdog, metrics,
slow-rank probe); hpcrun's default `comm_hook: per_parameter` (one all-reduce per parameter, the
price of bit-exact resume at any world size) is measured against it apart.

Per-step metrics (the steps table, the per-rank step-time gather, progress.json) are measured
apart, because their cost is far below the rounds' noise: each hpcrun run's rank 0 reports the
time its training thread spent recording and flushing them (`hpcrun.runtime.steps`), and this
script prints it as a share of the run's step time (target <= 0.5%). `--flush-steps` sets
`metrics.flush_steps` (default: the recipe default, 100; 1 is the worst case).

    python benchmarks/training_overhead.py [--model small] [--steps 60] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml
from scratch import ROOT, scratch, scratch_site  # benchmarks/scratch.py


def bare(rank: int, world: int, model: str, steps: int, warmup: int, mb: int, seq: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hpcrun.runtime.model import GPT, synthetic_batch
    from hpcrun.sizes import SIZES

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # what the local site profile gives hpcrun's ranks
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))  # hpcrun's share of cores per rank
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    size = SIZES[model]
    ddp = DistributedDataParallel(GPT(size, seq), gradient_as_bucket_view=True)  # as hpcrun's default, so only the harness differs
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


def run_bare(args: argparse.Namespace, tmp: Path) -> float:
    import torch.multiprocessing as mp

    out = tmp / "bare.txt"
    mp.spawn(bare, args=(2, args.model, args.steps, args.warmup, args.micro_batch, args.seq_len, 29000 + os.getpid() % 1000, str(out)), nprocs=2)
    return float(out.read_text())


LINES = {  # what rank 0 prints of its own cost at the end of an attempt
    "metrics": r"per-step metrics: [\d.]+ ms on the training thread over \d+ steps \(([\d.]+)% of step time\)",
    "harness": r"hpcrun's per-step work: [\d.]+ ms on the training thread over \d+ steps \(([\d.]+)% of step time\)",
    "watchdog": r"watchdog thread [\d.]+ ms of CPU \(([\d.]+)%\)",
}


def shares_of(tmp: Path, run_id: str) -> dict[str, float]:
    """The shares of step time rank 0's training thread spent on per-step metrics and on all of
    hpcrun's per-step work (metrics included), from its log."""
    from hpcrun.rundir import RunDir

    run = RunDir(tmp / "runs" / run_id)
    log = run.log(run.latest_job()["job_id"], 0, "out").read_text()  # type: ignore[index]
    found = {k: re.search(pattern, log) for k, pattern in LINES.items()}
    missing = [k for k, m in found.items() if not m]
    assert not missing, f"no {missing} line in {run.path}'s rank 0 log"
    return {k: float(m.group(1)) / 100 for k, m in found.items() if m}


def run_hpcrun(args: argparse.Namespace, tmp: Path, n: int, shares: list[dict[str, float]], hook: str) -> float:
    from hpcrun.results import load

    scratch_site(tmp, "local")
    recipe = {
        "name": f"overhead{n}{hook.replace('_', '')}", "job": {"kind": "benchmark", "model": args.model}, "resources": {"nodes": 1, "gpus_per_node": 2, "time": "00:30:00"},
        "training": {"steps": args.steps, "warmup_steps": args.warmup, "micro_batch": args.micro_batch, "seq_len": args.seq_len, "lr": 1e-3},
        "checkpoint": {"interval": 10**6},  # the bare loop saves nothing either (apart from the final save)
        "strategy": {"name": "ddp", "comm_hook": hook},
    }
    if args.flush_steps:
        recipe["metrics"] = {"flush_steps": args.flush_steps}
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    submit = [sys.executable, "-m", "hpcrun.cli", "submit", "--site", str(tmp / "site.yaml"), str(tmp / "recipe.yaml")]
    if args.follow:  # the CLI following the job shares the ranks' cores here (on a cluster it runs on the login node)
        subprocess.run(submit[:3] + ["--wait"] + submit[3:], cwd=ROOT, check=True, capture_output=True)
    else:
        out = subprocess.run(submit, cwd=ROOT, check=True, capture_output=True, text=True).stdout
        run_dir = Path(next(line.split("run dir:")[1].strip() for line in out.splitlines() if "run dir:" in line))
        while not (run_dir / "state.json").exists() or json.loads((run_dir / "state.json").read_text()).get("status") not in ("completed", "failed"):
            time.sleep(2)  # one look every 2 s: nothing else competes with the ranks
    df = load(tmp / "results")
    row = df[df["run_id"].str.endswith(f"overhead{n}{hook.replace('_', '')}")].iloc[-1]
    shares.append(shares_of(tmp, row["run_id"]))
    return float(row["tokens_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--flush-steps", type=int, default=None)
    parser.add_argument("--follow", action="store_true", help="hpcrun submit --wait (the CLI then shares the 2 cores with the ranks)")
    args = parser.parse_args()
    tmp = scratch("overhead-")
    bare_tps: list[float] = []
    hpc_tps: list[float] = []  # comm_hook: none, as the bare loop
    exact_tps: list[float] = []  # hpcrun's default, comm_hook: per_parameter
    shares: list[dict[str, float]] = []
    arms = [
        lambda n: bare_tps.append(run_bare(args, tmp)),
        lambda n: hpc_tps.append(run_hpcrun(args, tmp, n, shares, "none")),
        lambda n: exact_tps.append(run_hpcrun(args, tmp, n, shares, "per_parameter")),
    ]
    for n in range(args.rounds):  # ABC then CBA, so drift on a noisy machine hits every arm alike
        for arm in arms if n % 2 == 0 else arms[::-1]:
            arm(n)
        print(f"round {n}: bare {bare_tps[-1]:.0f} tokens/s, hpcrun {hpc_tps[-1]:.0f} (ratio {hpc_tps[-1] / bare_tps[-1]:.3f}), "
              f"hpcrun per_parameter {exact_tps[-1]:.0f} (vs bucketed {exact_tps[-1] / hpc_tps[-1]:.3f}), "
              f"hpcrun's per-step work {100 * shares[-2]['harness']:.2f}% of step time (metrics {100 * shares[-2]['metrics']:.3f}%)", flush=True)
    ratios = [h / b for h, b in zip(hpc_tps, bare_tps)]
    print(f"ratio hpcrun / bare loop (both bucketed): median {statistics.median(ratios):.3f}, mean {statistics.fmean(ratios):.3f}, "
          f"of totals {sum(hpc_tps) / sum(bare_tps):.3f}, spread {min(ratios):.3f}-{max(ratios):.3f} (target >= 0.98)")
    exact = [e / h for e, h in zip(exact_tps, hpc_tps)]
    print(f"per_parameter / bucketed all-reduce (the price of exact resume): median {statistics.median(exact):.3f}, "
          f"spread {min(exact):.3f}-{max(exact):.3f}; hpcrun default / bare loop: median {statistics.median([e / b for e, b in zip(exact_tps, bare_tps)]):.3f}")
    for what, target in (("harness", "its share of the gap above"), ("watchdog", "the watchdog thread's CPU time"), ("metrics", "target <= 0.5%")):
        values = [x[what] for x in shares]
        print(f"{what} share of step time on rank 0's training thread: median {100 * statistics.median(values):.3f}%, max {100 * max(values):.3f}% ({target})")


if __name__ == "__main__":
    main()
