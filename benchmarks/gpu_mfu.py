"""The one command for a GPU machine: MFU, tokens/s and peak memory of the built-in benchmark, the
planner's estimate beside each measured peak, in one table written into RESULTS.md's GPU section.

Arms, each a fresh process tree, in this order (each row printed as it finishes):
- `bare`: a hand-written DDP loop (world 1) on the same model, data, AdamW, clipping and precision;
- `hpcrun ddp, recovery off`: `hpcrun submit --wait`, checkpoint interval beyond the run, no snapshots;
- the same with `training.compile: true` (the blocks through torch.compile);
- `hpcrun ddp, defaults`: the checkpoint and snapshot defaults a SLURM site gets (both spaced by
  their measured cost: at this step time and state, no save falls inside a short run; the note says
  the interval each chose);
- `hpcrun ddp, saves every 20/10 steps` (`--save-every`, `--snapshot-every`): disk checkpoints and
  snapshots at fixed steps, so their cost shows inside the run (what one save costs, whatever the
  interval); the note has the rank's own count of each and its measured cost;
- every other strategy the planner says fits (`--strategies`; DeepSpeed's only where it is installed).
All arms use one micro-batch: by default the largest the planner fits for DDP in 90% of the GPU.
Besides tokens/s (hpcrun's rows: per mean step, stalls out) each arm's loop tokens/s is what the
wall clock saw from the end of the warm-up to the end of the second-last step (the steps table's
times; in-run saves and snapshots in, the final save out, as the bare loop has none), and its host
memory the node's peak use (MemTotal - MemAvailable, sampled) above what it was before the arm.
No arm starts that the slowest so far says would overrun `--budget-s` (default 480 s: about 8
minutes on one H100 for 1.3b).

On the one-H100 machine of /work/shared/notes/gpu.md (torch there; submitit and pydantic not): put
their wheels in a directory, unpack them there and run from the checkout:

    pip install --no-index --no-deps --target /tmp/wheels /path/to/wheels/*.whl
    PYTHONPATH=$PWD:/tmp/wheels python3 benchmarks/gpu_mfu.py

Options: `--model 1.3b --micro-batch N --steps 60 --warmup 10 --strategies fsdp-full,zero2,zero3`,
`--write PATH` (default benchmarks/RESULTS.md; `-` writes nothing), `--budget-s 480`.

    python3 benchmarks/gpu_mfu.py --cpu-check   # the whole pipeline on CPU (tiny, fp32), no MFU claim;
                                                # writes into a scratch copy of RESULTS.md and prints it
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import typing as tp
from pathlib import Path

import yaml
from scratch import ROOT, scratch, scratch_site  # benchmarks/scratch.py

# dense bf16 tensor-core TFLOPs by device name; the first match wins (H100 PCIe before H100)
PEAK_BF16 = [("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0)]
CPU_PEAK_TFLOPS = 0.05  # a stand-in for --cpu-check: MFU means nothing there
SECTION = "## 7. GPU (H100/H200)"  # RESULTS.md's section this script owns, up to the next "## "


def gpu_partition() -> dict[str, tp.Any]:
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
        "memory_gb": int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9),
        "max_time": "1-00:00:00",
        "gpu": {
            "model": name.removeprefix("NVIDIA ").replace(" ", "-"),
            "memory_gb": int(memory),
            "peak_tflops_bf16": peak,
        },
    }


def cpu_partition() -> dict[str, tp.Any]:
    return {
        "max_nodes": 1,
        "gpus_per_node": 0,
        "cpus_per_node": "auto",
        "memory_gb": 16,
        "max_time": "1-00:00:00",
        "cpu_peak_tflops_per_rank": CPU_PEAK_TFLOPS,
    }


def bare(out: Path, model: str, steps: int, warmup: int, mb: int, seq: int, precision: str) -> None:
    """The bare loop, in its own process: DDP over one rank (NCCL on a GPU, gloo on CPU), the model
    and optimizer hpcrun's benchmark builds, autocast as hpcrun's engine, grad-norm clipping 1.0."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hpcrun.runtime.jobs import adamw
    from hpcrun.runtime.metrics import peak_memory_bytes
    from hpcrun.runtime.model import GPT, synthetic_batch
    from hpcrun.sizes import SIZES

    cuda = torch.cuda.is_available() and precision != "fp32"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    size = SIZES[model]
    ddp = DistributedDataParallel(GPT(size, seq).to(device), gradient_as_bucket_view=True)
    opt = adamw(ddp.parameters(), lr=1e-3)
    dtype = torch.bfloat16 if precision == "bf16-mixed" else None
    times, ends = [], []
    for step in range(steps):
        start = time.perf_counter()
        x, y = synthetic_batch(0, step, 0, mb, seq, size.vocab)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = ddp(x.to(device), y.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # the step's end, as hpcrun's loop syncs on it
        ends.append(time.perf_counter())
        times.append(ends[-1] - start)
    timed = times[warmup:]
    peak = peak_memory_bytes(device)  # as hpcrun's rows measure it
    began = ends[warmup - 1] if warmup else ends[0] - times[0]  # as loop_tokens_per_s, from the loop's start
    loop = mb * seq * (steps - 1 - warmup) / (ends[steps - 2] - began) if steps - 1 > warmup else None
    out.write_text(json.dumps({"tokens_per_s": mb * seq * len(timed) / sum(timed), "peak": peak, "loop": loop}))
    dist.destroy_process_group()


class Arm(tp.NamedTuple):
    name: str
    option: str  # the planner's option name
    recipe: dict[str, tp.Any] | None  # None: the bare loop


class HostMemory:
    """The node's peak host memory in use (MemTotal - MemAvailable) while it runs, sampled."""

    def __init__(self) -> None:
        import threading

        self.base = self.peak = self.used()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    @staticmethod
    def used() -> int:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        return (int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])) * 1024

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, self.used())

    def stop(self) -> float:
        """Bytes above the use before the arm."""
        self._stop.set()
        self._thread.join()
        return float(self.peak - self.base)


def loop_tokens_per_s(steps: tp.Any, tokens_per_step: int, warmup: int, last: int) -> float | None:
    """Tokens over the wall time from the end of step `warmup` to the end of step `last - 1` (the
    steps table's `time`: the final step's save left out)."""
    at = {int(s): t for s, t in zip(steps["step"], steps["time"])}
    if warmup not in at or last - 1 not in at or last - 1 <= warmup:
        return None
    return tokens_per_step * (last - 1 - warmup) / (at[last - 1] - at[warmup]).total_seconds()


def planned_gb(site: Path, recipe: dict[str, tp.Any], option: str, tmp: Path) -> tuple[float, float, bool, str]:
    """The planner's estimate for `option` at the recipe's shape: (GB per GPU, host GB per node, fits, why)."""
    from hpcrun.memory import estimate
    from hpcrun.plan import plan
    from hpcrun.recipe import load_recipe
    from hpcrun.site import load_site

    path = tmp / "planned.yaml"
    path.write_text(yaml.safe_dump(recipe))
    spec = plan(load_site(str(site)), load_recipe(path).base, path, "planned")
    [verdict] = [e for e in estimate(spec) if e.option.name == option]
    return verdict.gpu_gb, verdict.cpu_gb_per_node, verdict.fits, verdict.why


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="1.3b")
    parser.add_argument("--strategies", default="fsdp-full,zero2,zero3", help="beyond DDP: the planner's option names")
    parser.add_argument("--micro-batch", type=int, default=0, help="0: the largest the planner fits for DDP")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=60, help="past checkpoint.interval's default (50): one save")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=480)
    parser.add_argument("--save-every", type=int, default=20, help="the saves arm's checkpoint.interval")
    parser.add_argument("--snapshot-every", type=int, default=10, help="the saves arm's checkpoint.memory_interval")
    parser.add_argument("--only", default="", help="comma-separated: run only the arms whose names contain one")
    parser.add_argument("--write", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    parser.add_argument("--cpu-check", action="store_true", help="run the pipeline on CPU (tiny, fp32) to check it")
    parser.add_argument("--bare", help=argparse.SUPPRESS)  # internal: run the bare loop, write its JSON here
    parser.add_argument("--precision", default="bf16-mixed", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare:
        bare(Path(args.bare), args.model, args.steps, args.warmup, args.micro_batch, args.seq_len, args.precision)
        return
    began = time.monotonic()
    import pandas as pd

    from hpcrun.memory import largest_micro_batch, options
    from hpcrun.results import load
    from hpcrun.sizes import SIZES
    from hpcrun.steps import load_steps

    tmp = scratch("gpu-mfu-")
    if args.cpu_check:
        args.model, args.seq_len, precision, partition = "tiny", 64, "fp32", cpu_partition()
        args.steps, args.warmup, args.budget_s = min(args.steps, 12), min(args.warmup, 2), max(args.budget_s, 900)
        device = "CPU (--cpu-check: no MFU claim)"
        if args.write == parser.get_default("write"):  # never CPU figures in the GPU section
            args.write = str(tmp / "RESULTS.md")
            shutil.copy(ROOT / "benchmarks" / "RESULTS.md", args.write)
    else:
        precision, partition = "bf16-mixed", gpu_partition()
        device = partition["gpu"]["model"]
    peak_tflops = partition.get("gpu", {}).get("peak_tflops_bf16", CPU_PEAK_TFLOPS)
    site = scratch_site(tmp, "local", name="gpu-mfu", partitions={"bench": partition}, default_partition="bench")
    by_name = {o.name: o for o in options()}

    def recipe(name: str, option: str, recovery: bool, mb: int, **checkpoint: tp.Any) -> dict[str, tp.Any]:
        return {
            "name": f"mfu-{name}",
            "job": {"kind": "benchmark", "model": args.model},
            "precision": precision,
            "strategy": by_name[option].recipe,
            "resources": {"nodes": 1, "gpus_per_node": 1, "time": "01:00:00"},
            "training": {"steps": args.steps, "warmup_steps": args.warmup, "micro_batch": mb, "seq_len": args.seq_len},
            # recovery off: no save inside the run (the final one is not timed), no snapshots; on: as a
            # SLURM site (snapshots are asked for: a local site keeps none unless memory_interval is set)
            "checkpoint": checkpoint or ({"memory_interval": None} if recovery else {"interval": 10**6,
                                                                                   "memory_interval": 0}),
        }

    def compiled(recipe: dict[str, tp.Any]) -> dict[str, tp.Any]:
        return {**recipe, "training": {**recipe["training"], "compile": True}}

    mb = args.micro_batch
    if not mb:
        from hpcrun.plan import plan
        from hpcrun.recipe import load_recipe
        from hpcrun.site import load_site

        probe = tmp / "probe.yaml"
        probe.write_text(yaml.safe_dump(recipe("probe", "ddp", False, 1)))
        # 10% of the GPU left to what the planner does not count (CUDA context, allocator slack): a
        # micro-batch that runs out of memory would cost the machine's whole session
        gpu = partition.get("gpu")
        spare = {**partition, **({"gpu": {**gpu, "memory_gb": int(0.9 * gpu["memory_gb"])}} if gpu else {})}
        (tmp / "probe").mkdir()
        roomy = scratch_site(tmp / "probe", "local", name="roomy", partitions={"b": spare}, default_partition="b")
        mb = largest_micro_batch(plan(load_site(str(roomy)), load_recipe(probe).base, probe, "p"), by_name["ddp"])
        mb = min(mb, 8) if args.cpu_check else mb
    arms = [
        Arm("bare", "ddp", None),
        Arm("hpcrun ddp, recovery off", "ddp", recipe("ddp-off", "ddp", False, mb)),
        Arm("hpcrun ddp, defaults", "ddp", recipe("ddp-defaults", "ddp", True, mb)),
        Arm(
            f"hpcrun ddp, saves every {args.save_every}/{args.snapshot_every} steps",
            "ddp",
            recipe("ddp-saves", "ddp", True, mb, interval=args.save_every, memory_interval=args.snapshot_every),
        ),
    ]
    for option in filter(None, args.strategies.split(",")):
        arms.append(Arm(f"hpcrun {option}, recovery off", option, recipe(option, option, False, mb)))
    # last: inductor's compile costs start-up time the budget may not have
    arms.append(Arm("hpcrun ddp, recovery off, compiled", "ddp", compiled(recipe("ddp-compiled", "ddp", False, mb))))
    if args.only:
        arms = [arm for arm in arms if any(part in arm.name for part in args.only.split(","))]

    flops = SIZES[args.model].flops_per_token(args.seq_len)
    print(
        f"device: {device}; {args.model}, {precision}, micro-batch {mb} x {args.seq_len}, {args.steps} steps "
        f"({args.warmup} warm-up); MFU against {peak_tflops:g} TFLOP/s",
        flush=True,
    )
    header = [
        "arm", "tokens/s/GPU", "vs bare", "loop tokens/s", "loop vs bare", "MFU", "peak GiB", "planned GiB",
        "planned vs measured", "host GiB", "planned host GiB", "note",
    ]
    tokens_per_step = mb * args.seq_len
    table: list[list[str]] = []
    bare_tps = bare_loop = None
    took: list[float] = []
    for arm in arms:
        arm_began = time.monotonic()
        shape = arm.recipe or recipe("bare", "ddp", False, mb)
        gb, host_gb, fits, why = planned_gb(site, shape, arm.option, tmp)
        left = args.budget_s - (time.monotonic() - began)
        note, tps, peak, loop, host = "", None, None, None, None
        sampler = HostMemory()
        if arm.option.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
            note = "skipped: DeepSpeed is not installed"
        elif not fits:
            note = f"skipped: the planner says it does not fit ({why})"
        elif left < max(took, default=30):  # it would not finish: the slowest arm so far is the guess
            note = f"skipped: {left:.0f} s left of the {args.budget_s:.0f} s budget"
        elif arm.recipe is None:
            out = tmp / "bare.json"
            call = [
                sys.executable,
                __file__,
                "--bare",
                str(out),
                "--model",
                args.model,
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                "--micro-batch",
                str(mb),
                "--seq-len",
                str(args.seq_len),
                "--precision",
                precision,
            ]
            done = run(call, left)
            if out.exists():
                measured = json.loads(out.read_text())
                tps, peak, loop = measured["tokens_per_s"], measured["peak"], measured.get("loop")
            else:
                note = f"failed: {done}"
        else:
            path = tmp / f"{arm.recipe['name']}.yaml"
            path.write_text(yaml.safe_dump(arm.recipe))
            done = run([sys.executable, "-m", "hpcrun", "submit", "--site", str(site), "--wait", str(path)], left)
            for cut in (tmp / "runs").glob(f"*{arm.recipe['name']}") if done.startswith("still") else []:
                run([sys.executable, "-m", "hpcrun", "cancel", "--site", str(site), str(cut)], 60)  # frees the GPU
            rows = load(tmp / "results")
            rows = rows[rows["run_id"].str.endswith(arm.recipe["name"])]
            if rows.empty or rows.iloc[-1]["status"] != "completed":
                note = "failed: " + (str(rows.iloc[-1]["reason"]) if not rows.empty else done)
                for log in sorted((tmp / "runs").glob(f"*{arm.recipe['name']}/logs/*")):  # gone at exit: print
                    print(f"--- {log.name}, its end:", *log.read_text(errors="replace").splitlines()[-25:], sep="\n")
            row = rows.iloc[-1] if not rows.empty else None
            if row is not None and pd.notna(row["tokens_per_s_per_gpu"]) and pd.notna(row["peak_memory_bytes"]):
                tps, peak = float(row["tokens_per_s_per_gpu"]), float(row["peak_memory_bytes"])
                stalled = row["checkpoint_stall_s"] if pd.notna(row["checkpoint_stall_s"]) else 0.0
                if stalled and not note:  # tokens/s leaves the stalls out; the final save is one of them
                    note = f"{row['checkpoint_saves']} saves, {stalled:.1f} s stalled"
                snapped = row["snapshot_stall_s"] if pd.notna(row["snapshot_stall_s"]) else 0.0
                if snapped and not note.startswith("failed"):
                    note += f"; snapshots {snapped:.1f} s stalled"
            steps = load_steps(tmp / "results", run_id=list(rows["run_id"].unique())) if not rows.empty else None
            if steps is not None and not steps.empty:
                loop = loop_tokens_per_s(steps, tokens_per_step, args.warmup, args.steps)
            for log in (tmp / "runs").glob(f"*{arm.recipe['name']}/logs/*.out"):  # rank 0's own account of its saves
                said = [line for line in log.read_text(errors="replace").splitlines() if "per-step work" in line]
                note += "".join(f"; {part}" for part in said[-1].split("; ")[1:]) if said else ""
            for checkpoints in (tmp / "runs").glob(f"*{arm.recipe['name']}/checkpoints"):
                shutil.rmtree(checkpoints)  # 15.6 GB each for 1.3b: a few arms' would fill the disk
        host = sampler.stop()
        bare_tps = tps if arm.recipe is None else bare_tps
        bare_loop = loop if arm.recipe is None else bare_loop
        took += [time.monotonic() - arm_began] if not note.startswith("skipped") else []
        cells = [
            arm.name,
            f"{tps:,.0f}" if tps else "",
            f"{tps / bare_tps:.3f}" if tps and bare_tps else "",
            f"{loop:,.0f}" if loop else "",
            f"{loop / bare_loop:.3f}" if loop and bare_loop else "",
            f"{tps * flops / (peak_tflops * 1e12):.1%}" if tps else "",
            f"{peak / 2**30:.1f}" if peak else "",
            f"{gb * 1e9 / 2**30:.1f}" + ("" if fits else " (no fit)"),
            f"{gb * 1e9 / peak - 1:+.0%}" if peak else "",
            f"{host / 2**30:.1f}" if host is not None and not note.startswith("skipped") else "",
            f"{host_gb * 1e9 / 2**30:.1f}",
            note,
        ]
        table.append(cells)
        print(" | ".join(cells), flush=True)
    markdown = render(header, table)
    print(markdown)
    if args.write != "-":
        given = sys.argv[1:]
        cut = [i for i, a in enumerate(given) if a == "--write" or a.startswith("--write=")]
        given = given[: cut[0]] + given[cut[0] + (1 if "=" in given[cut[0]] else 2) :] if cut else given
        command = shlex.join(["python3", "benchmarks/gpu_mfu.py", *given])  # as run, less where it wrote
        write_section(Path(args.write), device, precision, args, mb, command, markdown, time.monotonic() - began)
        print(f"written into {args.write} ({SECTION})")


def run(call: list[str], timeout: float) -> str:
    """Run one arm; what ended it, in a few words."""
    try:
        out = subprocess.run(call, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"still running after {timeout:.0f} s (budget)"
    lines = (out.stderr or out.stdout).strip().splitlines()
    return "ok" if out.returncode == 0 else f"exit {out.returncode}: {lines[-1] if lines else '?'}"


def render(header: list[str], table: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in table])


def write_section(
    path: Path, device: str, precision: str, args: argparse.Namespace, mb: int, command: str, table: str, took: float
) -> None:
    """Replace the body of RESULTS.md's GPU section (kept where it is) with this run's table."""
    import torch

    text = path.read_text()
    start = text.find(SECTION)
    if start < 0:
        raise SystemExit(f"{path}: no section starting {SECTION!r} to write into")
    end = text.find("\n## ", start + len(SECTION))
    end = len(text) if end < 0 else end + 1
    heading = f"{SECTION}: {device}"
    body = (
        f"{heading}\n\n`{command}` ({dt.date.today()}, {took / 60:.1f} min): {device}, torch {torch.__version__}, "
        f"{args.model}, {precision}, micro-batch {mb} x {args.seq_len} (the planner's largest for DDP in "
        f"90% of the GPU unless `--micro-batch`), {args.steps} steps of which {args.warmup} warm-up, one GPU. "
        f"Planned: the planner's GPU estimate for the arm's strategy (DDP's for the bare loop); peak: "
        f"`peak_memory_bytes` (`torch.cuda.max_memory_allocated`). MFU: model FLOPs (6N + 12·L·h·s per token) "
        f"over the dense bf16 peak. Loop tokens/s: the wall clock from the warm-up's end to the second-last "
        f"step (in-run saves in, the final save out); host GiB: the node's peak use above its use before the "
        f"arm, beside the planner's host estimate; the note: the row's stalls and rank 0's account of its "
        f"saves.\n\n"
        f"{table}\n\n"
    )
    path.write_text(text[:start] + body + text[end:])


if __name__ == "__main__":
    main()
