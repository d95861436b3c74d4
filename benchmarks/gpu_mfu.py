"""GPU item: MFU and tokens/s per GPU of the built-in benchmark, per strategy, with NCCL and
bf16, on this machine's GPUs, each run through `hpcrun submit --wait` on a local site written
for them. MFU is the ratio to the GPU's own dense bf16 peak, the limit it is measured against
(target: >= 45% for a ~1B model on one H100/H200 with the best strategy). The planner's verdict
is printed beside each strategy, so a run that does not fit is explained, not just missing.

    python benchmarks/gpu_mfu.py [--model 1.3b] [--strategies ddp,fsdp-full,zero2,zero3] [--micro-batch 2]
    python benchmarks/gpu_mfu.py --cpu-check   # the same pipeline on CPU (tiny model, fp32), no MFU claim
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import yaml
from scratch import ROOT, scratch, scratch_site  # benchmarks/scratch.py

# dense bf16 tensor-core TFLOPs by device name; the first match wins (H100 PCIe before H100)
PEAK_BF16 = [("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0)]


def gpu_partition() -> dict[str, object]:
    import torch

    name = torch.cuda.get_device_name(0)
    peak = next((p for key, p in PEAK_BF16 if key in name), None)
    if peak is None:
        raise SystemExit(f"no dense bf16 peak known for {name!r}: add it to PEAK_BF16")
    memory = torch.cuda.get_device_properties(0).total_memory / 1e9
    return {
        "max_nodes": 1,
        "gpus_per_node": torch.cuda.device_count(),
        "cpus_per_node": "auto",
        "memory_gb": 64,
        "max_time": "1-00:00:00",
        "gpu": {
            "model": name.removeprefix("NVIDIA ").replace(" ", "-"),
            "memory_gb": round(memory),
            "peak_tflops_bf16": peak,
        },  # a site token
    }


def planned(site: Path, recipe: Path, option: str) -> str:
    """The planner's line for `option`: its estimate per GPU and whether it fits."""
    out = subprocess.run(
        [sys.executable, "-m", "hpcrun.cli", "plan", "--site", str(site), str(recipe)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    for line in out.stdout.splitlines():
        parts = re.split(r"\s{2,}", line.strip())
        if parts[0] == option:
            return f"plan: {parts[1]} GB per GPU, " + ("fits" if "yes" in parts else f"does not fit: {parts[-1]}")
    return f"plan: {(out.stderr or out.stdout).strip()[-200:]}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="1.3b")
    parser.add_argument(
        "--strategies", default="ddp,fsdp-full,zero2,zero3", help="the planner's option names (hpcrun plan)"
    )
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument(
        "--micro-batch", type=int, default=2, help="2 x 2048 tokens: what the planner fits for 1.3b on 80 GB"
    )
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--cpu-check", action="store_true", help="run the pipeline on CPU (tiny, fp32) to check it")
    args = parser.parse_args()
    from hpcrun.memory import options
    from hpcrun.results import load

    tmp = scratch("gpu-mfu-")
    if args.cpu_check:
        model, precision, device = "tiny", "fp32", "CPU (--cpu-check)"
        # a stand-in peak: MFU means nothing here
        partition = {
            "max_nodes": 1,
            "gpus_per_node": 0,
            "cpus_per_node": "auto",
            "memory_gb": 16,
            "max_time": "1-00:00:00",
            "cpu_peak_tflops_per_rank": 0.05,
        }
    else:
        model, precision, partition = args.model, "bf16-mixed", gpu_partition()
        device = partition["gpu"]["model"]  # type: ignore[index]
    site = scratch_site(tmp, "local", name="gpu-mfu", partitions={"bench": partition}, default_partition="bench")
    recipes = {o.name: o.recipe for o in options()}
    print(f"device: {device}, model {model}, {precision}")
    print(f"{'strategy':14} {'tokens/s/GPU':>13} {'TFLOPs/GPU':>11} {'MFU':>7} {'peak GiB':>9}  planner")
    best = None
    for name in args.strategies.split(","):
        recipe = {
            "name": f"mfu-{name}",
            "job": {"kind": "benchmark", "model": model},
            "precision": precision,
            "strategy": recipes[name],
            "resources": {"nodes": 1, "gpus_per_node": args.gpus, "time": "01:00:00"},
            "training": {
                "steps": args.steps,
                "warmup_steps": args.warmup,
                "micro_batch": args.micro_batch,
                "seq_len": 64 if args.cpu_check else args.seq_len,
                "activation_checkpointing": args.activation_checkpointing,
            },
            "checkpoint": {"interval": 10**6},  # throughput only: the one save at the end is not timed
        }
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(recipe))
        fits = planned(site, path, name)
        out = subprocess.run(
            [sys.executable, "-m", "hpcrun.cli", "submit", "--site", str(site), "--wait", str(path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        rows = load(tmp / "results")
        rows = rows[rows["run_id"].str.endswith(f"mfu-{name}")]
        if out.returncode != 0 or rows.empty or rows.iloc[-1]["status"] != "completed":
            reason = rows.iloc[-1]["reason"] if not rows.empty else (out.stderr.strip().splitlines() or ["?"])[-1]
            print(f"{name:14} {'failed':>13}  {reason}  [{fits}]")
            continue
        row = rows.iloc[-1]
        print(
            f"{name:14} {row['tokens_per_s_per_gpu']:13.0f} {row['tflops_per_gpu']:11.1f} {row['mfu'] * 100:6.1f}% "
            f"{row['peak_memory_bytes'] / 2**30:9.1f}  [{fits}]",
            flush=True,
        )
        if best is None or row["mfu"] > best[1]:
            best = (name, float(row["mfu"]))
    if best:
        print(
            f"best: {best[0]} at {best[1] * 100:.1f}% MFU"
            + ("" if args.cpu_check else " (target >= 45% for a ~1B model on one H100/H200)")
        )


if __name__ == "__main__":
    main()
