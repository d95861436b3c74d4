"""An existing training script, unchanged: it reads RANK/WORLD_SIZE/MASTER_ADDR like under
torchrun. hpcrun launches it once per rank with those set (and HPCRUN_CHECKPOINT_DIR)."""

import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
expected = world * (world + 1) / 2
assert value.item() == expected, (value.item(), expected)
if rank == 0:
    print(f"command job: all-reduce over {world} ranks = {value.item():.0f} (ok)", flush=True)
    with open(os.path.join(os.environ["HPCRUN_RUN_DIR"], "command-ok"), "w") as f:
        f.write(f"{world}\n")
dist.destroy_process_group()
