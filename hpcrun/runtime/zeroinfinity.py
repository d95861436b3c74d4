"""ZeRO-Infinity's optimizer on NVMe (DeepSpeed's `offload_optimizer: nvme`) in hpcrun's checkpoints.

DeepSpeed saves such an optimizer as its ZeRO partition files plus a copy of each rank's swap files
(`offloaded_tensors/rankNN`); a sub-group it swaps (at least 1 MiB a rank, DeepSpeed's AIO minimum) is an empty
tensor in the partition file, its data only in the swap files. Its own resume (`load_checkpoint`) copies the swap
files back and skips the partition files, and so, measured with DeepSpeed 0.19 at the same world size, loses
Adam's moments and step count (its swapper reads a state's file only once the optimizer has stepped in this
process) and gives a sub-group too small to swap its initial weights. `restore` finishes that resume; `filled`
gives DeepSpeed's converter (zero_to_fp32) the swapped partitions it would otherwise find empty.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import typing as tp
from pathlib import Path

import torch

SWAPPED = "offloaded_tensors"  # DeepSpeed's folder of each rank's swap files in a checkpoint
OPTIMIZER_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")
WEIGHTS_FILE = re.compile(r"(\d+)_(\d+)\.tensor\.swp")  # a sub-group's fp32 partition: its first and last ds_id
MOMENTS = ("exp_avg", "exp_avg_sq")


def swaps_optimizer(tag_dir: Path) -> bool:
    """Whether DeepSpeed checkpoint folder `tag_dir` was saved by an optimizer swapping to NVMe."""
    return (tag_dir / SWAPPED).is_dir()


def optimizer_file(tag_dir: Path, rank: int) -> Path:
    return tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def restore(engine: tp.Any, tag_dir: Path, rank: int) -> None:
    """After `engine.load_checkpoint` of `tag_dir` at the world size that saved it: this rank's optimizer
    state as saved. A sub-group kept in memory gets its fp32 weights and state from the partition file; a
    swapped one gets its state's placeholders, which DeepSpeed's swapper registers and reads from the swap
    files `load_checkpoint` copied back. Then every sub-group passes through the swapper once and the
    weights the model computes with are set from the fp32 ones (collective: persistent parameters are
    gathered again)."""
    optimizer = engine.optimizer
    saved = torch.load(optimizer_file(tag_dir, rank), map_location="cpu", weights_only=False)["optimizer_state_dict"]
    states, flats = saved["optimizer_state_dict"]["state"], saved["fp32_flat_groups"]
    if len(flats) != len(optimizer.fp32_partitioned_groups_flat):
        raise RuntimeError(f"{optimizer_file(tag_dir, rank)}: {len(flats)} sub-groups saved, "
                           f"{len(optimizer.fp32_partitioned_groups_flat)} here")
    optimizer.checkpoint_event_prologue()
    for index, fp32 in enumerate(optimizer.fp32_partitioned_groups_flat):
        state, numel = states.get(index, {}), optimizer.fp16_partitioned_groups_flat_numel[index]
        if flats[index].numel():  # kept in memory
            fp32.data.copy_(flats[index])
        optimizer.optimizer.state[fp32] = {
            key: torch.empty(numel, dtype=fp32.dtype) if torch.is_tensor(value) and value.numel() == 0 and numel
            else value.clone() if torch.is_tensor(value) else value
            for key, value in state.items()
        }
    optimizer.reset_swap_buffers()
    optimizer.checkpoint_event_epilogue()


def filled(tag_dir: Path, dest: Path) -> None:
    """A copy of ZeRO-3 checkpoint folder `tag_dir` at `dest` (created) whose partition files hold what was
    swapped out to NVMe, read back from the checkpoint's swap files; the other files are hard links."""
    dest.mkdir(parents=True)
    for path in tag_dir.iterdir():
        match = OPTIMIZER_FILE.fullmatch(path.name)
        if path.name == SWAPPED:
            continue
        if match is None:
            (shutil.copytree if path.is_dir() else os.link)(path, dest / path.name)
            continue
        rank = int(match[1])
        saved = torch.load(path, map_location="cpu", weights_only=False)
        partitions = saved["optimizer_state_dict"]
        model = torch.load(tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt", map_location="cpu",
                           weights_only=False)
        swap_dir = tag_dir / SWAPPED / f"rank{rank:02d}"
        files = sorted((f for f in swap_dir.iterdir() if WEIGHTS_FILE.fullmatch(f.name)),
                       key=lambda f: int(WEIGHTS_FILE.fullmatch(f.name)[1]))  # type: ignore[index]
        swapped = [i for i, flat in enumerate(partitions["fp32_flat_groups"]) if flat.numel() == 0]
        if len(files) != len(swapped):
            raise RuntimeError(f"{swap_dir}: {len(files)} swapped sub-groups, {len(swapped)} expected from {path}")
        ranks = partitions["partition_count"]
        for index, weights in zip(swapped, files):
            # the rank's slice of each of the sub-group's parameters, padded to a multiple of the ranks
            numel = sum(math.ceil(math.prod(shape) / ranks) for shape in model["param_shapes"][index].values())
            partitions["fp32_flat_groups"][index] = read(weights, numel)
            state = partitions["optimizer_state_dict"]["state"][index]
            for key in MOMENTS:
                state[key] = read(weights.with_name(f"{key}-{weights.name}"), numel)
        torch.save(saved, dest / path.name)


def read(path: Path, numel: int) -> torch.Tensor:
    """The first `numel` fp32 values of raw swap file `path` (DeepSpeed pads it to its I/O alignment)."""
    size = path.stat().st_size
    if size < 4 * numel:
        raise RuntimeError(f"{path}: {size} bytes, fewer than the {numel} fp32 values of its partition")
    return torch.from_file(str(path), shared=False, size=numel, dtype=torch.float32).clone()
