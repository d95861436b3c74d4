"""An existing torchrun-style training script under hpcrun, with hpcrun's whole contract:

- it reads RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT as under torchrun;
- on USR2 (ahead of the time limit) or SIGTERM (preemption, scancel), which hpcrun forwards to
  it, it saves under $HPCRUN_CHECKPOINT_DIR and exits (any exit code: hpcrun requeues the run
  because a stop signal came; a script that ignores the signal is killed and requeued anyway);
- when it starts, it resumes from what it saved there;
- optionally, it reports its steps to hpcrun: one JSON line per step appended to $HPCRUN_METRICS
  (hpcrun.runtime.reported), which hpcrun folds into the per-step table and the results row.

It runs the same with `launcher: srun` (one process per rank) and `launcher: torchrun`.

Signals may reach only some ranks: the ranks agree at each step boundary (one tiny all-reduce)
so that all of them stop after the same step.
"""

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--step-delay-s", type=float, default=0.0)  # lets tests signal a short run mid-way
args = parser.parse_args()

stop_signal = 0


def on_stop(signum: int, frame: object) -> None:
    global stop_signal
    stop_signal = signum  # only a flag: saving is collective and happens at a step boundary


signal.signal(signal.SIGUSR2, on_stop)
signal.signal(signal.SIGTERM, on_stop)

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
run_dir, checkpoint_dir = os.environ["HPCRUN_RUN_DIR"], os.environ["HPCRUN_CHECKPOINT_DIR"]
metrics = os.environ.get("HPCRUN_METRICS") if rank == 0 else None
saved = os.path.join(checkpoint_dir, "command_train.pt")

torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
start = 0
if os.path.exists(saved):
    state = torch.load(saved, weights_only=True)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    start = int(state["step"])
if rank == 0:
    print(f"command job: {world} ranks, starting at step {start}", flush=True)
    with open(os.path.join(run_dir, "command-starts"), "a") as f:
        f.write(f"{start}\n")


def save(step: int) -> None:
    if rank == 0:  # written under a temporary name, then renamed: a kill mid-write leaves the old one
        os.makedirs(checkpoint_dir, exist_ok=True)
        torch.save({"step": step, "model": model.module.state_dict(), "optim": optimizer.state_dict()}, saved + ".tmp")
        os.replace(saved + ".tmp", saved)
    dist.barrier()


for step in range(start, args.steps):
    data = torch.randn(16, 8, generator=torch.Generator().manual_seed(step * world + rank))
    loss = model(data).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    time.sleep(args.step_delay_s)
    if metrics:
        with open(metrics, "a") as f:
            row = {"step": step + 1, "loss": loss.item(), "total": args.steps, "time": time.time()}
            f.write(json.dumps(row) + "\n")
    stop = torch.tensor([stop_signal])
    dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every rank learns whether any was signalled
    if stop.item():
        save(step + 1)
        if rank == 0:
            print(f"command job: {signal.Signals(int(stop.item())).name}, saved step {step + 1}", flush=True)
        dist.destroy_process_group()
        raise SystemExit(0)

value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
assert value.item() == world * (world + 1) / 2, (value.item(), world)
if rank == 0:
    print(f"command job: {args.steps} steps over {world} ranks done", flush=True)
    with open(os.path.join(run_dir, "command-ok"), "w") as f:
        f.write(f"{world}\n")
dist.destroy_process_group()
