"""ZeRO-Infinity's optimizer on NVMe (DeepSpeed's `offload_optimizer: nvme`) in hpcrun's checkpoints.

DeepSpeed saves such an optimizer as its ZeRO partition files plus a copy of each rank's swap files
(`offloaded_tensors/rankNN`); a sub-group it swaps (at least 1 MiB a rank, DeepSpeed's AIO minimum) is an empty
tensor in the partition file, its data only in the swap files. Its own resume (`load_checkpoint`) copies the swap
files back and skips the partition files, and so, measured with DeepSpeed 0.19 at the same world size, loses
Adam's moments and step count (its swapper reads a state's file only once the optimizer has stepped in this
process) and gives a sub-group too small to swap its initial weights. `restore` finishes that resume; `filled`
gives DeepSpeed's converters (zero_to_fp32, ds_to_universal) the swapped partitions they would otherwise find
empty; `reshard` loads the universal checkpoint at another world size, which DeepSpeed's own loader cannot.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import tempfile
import typing as tp
from pathlib import Path

import torch

SWAPPED = "offloaded_tensors"  # DeepSpeed's folder of each rank's swap files in a checkpoint
MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's, as DeepSpeed's universal checkpoint names them
# a rank's partition files: "bf16_" when bf16 is on (DeepSpeed's _get_zero_ckpt_prefix)
PARTITIONS = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_(optim|model)_states\.pt")


def swaps_optimizer(tag_dir: Path) -> bool:
    """Whether DeepSpeed checkpoint folder `tag_dir` was saved by an optimizer swapping to NVMe."""
    return (tag_dir / SWAPPED).is_dir()


def partition_file(tag_dir: Path, rank: int, kind: str = "optim") -> Path:
    """Rank `rank`'s optimizer (or model) states file in DeepSpeed checkpoint folder `tag_dir`."""
    found = [p for p in tag_dir.iterdir() if (m := PARTITIONS.fullmatch(p.name)) and (int(m[1]), m[2]) == (rank, kind)]
    if len(found) != 1:
        raise RuntimeError(f"{tag_dir}: {len(found)} {kind} states files of rank {rank}, expected one")
    return found[0]


def restore(engine: tp.Any, tag_dir: Path) -> None:
    """After `engine.load_checkpoint` of `tag_dir` at the world size that saved it: this rank's optimizer
    state as saved. A sub-group kept in memory gets its fp32 weights and state from the partition file; a
    swapped one gets its state's placeholders, which DeepSpeed's swapper registers and reads from the swap
    files `load_checkpoint` copied back (`reloading`). Collective."""
    import torch.distributed as dist

    optimizer = engine.optimizer
    path = partition_file(tag_dir, dist.get_rank())
    saved = torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    states, flats = saved["optimizer_state_dict"]["state"], saved["fp32_flat_groups"]
    here = optimizer.fp32_partitioned_groups_flat
    if [getattr(f, "ds_id", None) for f in flats] != [getattr(f, "ds_id", None) for f in here]:
        raise RuntimeError(f"{path}: its sub-groups are not this engine's (another model or sub_group_size?)")
    with reloading(optimizer, saved):
        for index, fp32 in enumerate(here):
            state, numel = states.get(index, {}), optimizer.fp16_partitioned_groups_flat_numel[index]
            if flats[index].numel() != (0 if fp32.numel() == 0 else numel):
                raise RuntimeError(f"{path}: sub-group {index} saved "
                                   f"{'in memory' if flats[index].numel() else 'swapped'}, "
                                   f"{'swapped' if fp32.numel() == 0 else 'in memory'} here")
            if flats[index].numel():  # kept in memory
                fp32.data.copy_(flats[index])
            optimizer.optimizer.state[fp32] = {
                key: torch.empty(numel, dtype=fp32.dtype) if torch.is_tensor(value) and value.numel() == 0 and numel
                else value.clone() if torch.is_tensor(value) else value
                for key, value in state.items()
            }


@contextlib.contextmanager
def reloading(optimizer: tp.Any, saved: tp.Mapping[str, tp.Any]) -> tp.Iterator[None]:
    """Around setting a ZeRO-3 optimizer's state (`restore`, `reshard`): before, the parameters partitioned,
    the swapper's registrations purged (as DeepSpeed's own partition load does: a swapped state's placeholder is
    then registered anew and read from its file) and fp16's loss scale from `saved`; after, every sub-group
    passes once through the swapper and the weights the model computes with are set from the fp32 ones
    (collective: persistent parameters are gathered again)."""
    optimizer.checkpoint_event_prologue()
    optimizer.optimizer_swapper.purge_state()
    for attribute in ("loss_scaler", "dynamic_loss_scale", "overflow"):
        setattr(optimizer, attribute, saved[attribute])
    yield
    optimizer.reset_swap_buffers()
    optimizer.checkpoint_event_epilogue()


def reshard(engine: tp.Any, folder: Path) -> None:
    """This rank's part of DeepSpeed universal checkpoint `folder` (saved at another world size, converted from
    `filled` partition files), for a ZeRO-3 engine whose optimizer swaps to NVMe; DeepSpeed's own loader of it
    fails on a swapped sub-group. Each sub-group's partition is cut from its parameters' full tensors as
    ZeRO-3 partitions them (padded to a multiple of the ranks, this rank's slice), one parameter at a time; a
    sub-group kept in memory takes it there, a swapped one as its swap files, where the swapper reads them
    (`reloading`). Collective."""
    import torch.distributed as dist

    optimizer, swapper = engine.optimizer, engine.optimizer.optimizer_swapper
    rank, ranks = dist.get_rank(), dist.get_world_size()
    names = {param: name for name, param in engine.module.named_parameters()}
    saved = torch.load(folder / "zero" / "optimizer_state.pt", map_location="cpu", weights_only=False)
    steps = {state.get("step") for state in saved["optimizer_state_dict"]["state"].values()} - {None}

    def part(param: torch.nn.Parameter, key: str) -> torch.Tensor:
        full = torch.load(folder / "zero" / names[param] / f"{key}.pt", map_location="cpu", weights_only=False)
        full = full.flatten()
        size = math.ceil(full.numel() / ranks)
        return torch.nn.functional.pad(full, (0, size * ranks - full.numel()))[rank * size : (rank + 1) * size]

    with reloading(optimizer, saved):
        for index, fp32 in enumerate(optimizer.fp32_partitioned_groups_flat):
            flat = {key: torch.cat([part(p, key) for p in optimizer.fp16_groups[index]]) for key in ("fp32", *MOMENTS)}
            numel = flat["fp32"].numel()
            if fp32.numel():  # kept in memory
                fp32.data.copy_(flat["fp32"])
                moments = {key: flat[key] for key in MOMENTS}
            else:  # as its swap files, padded to the swapper's I/O alignment as it writes them
                pad = -numel % swapper.numel_alignment
                for key, prefix in (("fp32", ""), *((key, f"{key}-") for key in MOMENTS)):
                    if key == "fp32" or steps:
                        path = Path(swapper.swap_folder) / f"{prefix}{fp32.ds_id}.tensor.swp"
                        torch.nn.functional.pad(flat[key].to(fp32.dtype), (0, pad)).numpy().tofile(path)
                moments = {key: torch.empty(numel, dtype=fp32.dtype) for key in MOMENTS}
            optimizer.optimizer.state[fp32] = {"step": torch.tensor(float(max(steps))), **moments} if steps else {}


@contextlib.contextmanager
def readable(tag_dir: Path, beside: Path, prefix: str, moments: bool = False) -> tp.Iterator[Path]:
    """DeepSpeed checkpoint folder `tag_dir` as its converters can read it: itself, or if it was saved by an
    optimizer swapping to NVMe, a `filled` copy under the same name in a temporary folder in `beside` (named
    `prefix`..., removed on leaving)."""
    if not swaps_optimizer(tag_dir):
        yield tag_dir
        return
    with tempfile.TemporaryDirectory(dir=beside, prefix=prefix) as folder:
        copy = Path(folder) / tag_dir.name
        filled(tag_dir, copy, moments)
        yield copy


def filled(tag_dir: Path, dest: Path, moments: bool = False) -> None:
    """A copy of ZeRO-3 checkpoint folder `tag_dir` at `dest` (created) whose optimizer files hold the fp32
    partitions that were swapped out to NVMe, read back from the checkpoint's swap files (what DeepSpeed's
    zero_to_fp32 reads), and Adam's moments too if `moments` (for its universal conversion; else they are
    left out); the other files are symbolic links."""
    dest.mkdir(parents=True)
    for path in tag_dir.iterdir():
        match = PARTITIONS.fullmatch(path.name)
        if path.name == SWAPPED:
            continue
        if match is None or match[2] == "model":
            os.symlink(path.resolve(), dest / path.name)
            continue
        rank = int(match[1])
        saved = torch.load(path, map_location="cpu", weights_only=False)
        partitions = saved["optimizer_state_dict"]
        if not moments:
            del partitions["optimizer_state_dict"]
        shapes = torch.load(partition_file(tag_dir, rank, "model"), map_location="cpu", weights_only=False)
        ranks = partitions["partition_count"]
        for index, flat in enumerate(partitions["fp32_flat_groups"]):
            if flat.numel() == 0:  # swapped: its file is named by the sub-group's first and last parameter ids
                # the rank's slice of each of the sub-group's parameters, padded to a multiple of the ranks
                numel = sum(math.ceil(math.prod(s) / ranks) for s in shapes["param_shapes"][index].values())
                swapped = tag_dir / SWAPPED / f"rank{rank:02d}" / f"{flat.ds_id}.tensor.swp"
                partitions["fp32_flat_groups"][index] = read(swapped, numel, flat.dtype)
                state = partitions["optimizer_state_dict"]["state"].get(index, {}) if moments else {}
                for key in MOMENTS if state else ():
                    state[key] = read(swapped.with_name(f"{key}-{swapped.name}"), numel, flat.dtype)
        torch.save(saved, dest / path.name)


def read(path: Path, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The first `numel` values of raw swap file `path` (DeepSpeed pads it to its I/O alignment)."""
    size, need = path.stat().st_size, numel * dtype.itemsize
    if size < need:
        raise RuntimeError(f"{path}: {size} bytes, fewer than the {need} of its partition")
    return torch.from_file(str(path), shared=False, size=numel, dtype=dtype).clone()
