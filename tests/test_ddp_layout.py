"""DDP's gradient buckets are laid out the same way in every real step of every attempt, so a
resumed attempt's first step reduces every element in the same order as the same step of a run
never stopped (hpcrun.runtime.engine `TorchEngine.settle_buckets`). Without the settling pass,
DDP reduces an attempt's first step with all parameters in one bucket and re-lays them at the
next forward: this test then fails, as it did with the layout DDP gives by itself.

Two gloo ranks (the layouts are recorded, not inferred from the weights: any world size shows
them), each building the DDP strategy's engine as a job does, twice per strategy: an
"uninterrupted" engine that runs four steps, and a "resumed" one, new like every attempt's, whose
first step is the third. A recording comm hook (DDP's own all-reduce) notes each reduced bucket's
parameters. One pair of processes serves every strategy: each start imports torch.
"""

from __future__ import annotations

import os
import typing as tp
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
Layout = list[tuple[str, ...]]  # the parameters of each reduced bucket, in the bucket's order
Reduced = list[tuple[int, Layout]]  # each backward's reduction, with the step it ran in


def engine(rank: int, reduced: Reduced, step: list[int], strategy: dict[str, tp.Any]) -> tp.Any:
    """The DDP strategy's engine on the `tiny` GPT, as an attempt builds it, with a hook that
    appends the layout of each backward's reduction, and the step `step[0]` says runs, to `reduced`."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from hpcrun.recipe import Recipe
    from hpcrun.runtime.env import DistEnv
    from hpcrun.runtime.model import GPT
    from hpcrun.sizes import SIZES

    recipe = Recipe.model_validate({"name": "layout", "strategy": strategy})
    env = DistEnv(rank, rank, WORLD, torch.device("cpu"), "gloo", 0, "local", "local", "local")
    torch.manual_seed(0)
    model = GPT(SIZES["tiny"], 16)
    names = {id(p): n for n, p in model.named_parameters()}
    built = recipe.strategy.build(model, lambda params: torch.optim.AdamW(params, lr=1e-3), recipe, env, None, None)

    def recording(state, bucket):  # no annotations: DDP rejects the strings `from __future__` makes them
        if bucket.index() == 0:
            reduced.append((step[0], []))
        reduced[-1][1].append(tuple(names[id(p)] for p in bucket.parameters()))
        return default_hooks.allreduce_hook(state, bucket)

    built.model.register_comm_hook(None, recording)
    return built


def run_steps(built: tp.Any, rank: int, steps: range, step: list[int]) -> None:
    from hpcrun.runtime.model import synthetic_batch
    from hpcrun.sizes import SIZES

    for n in steps:
        step[0] = n
        tokens, targets = synthetic_batch(0, n, rank * 2, 2, 16, SIZES["tiny"].vocab)
        built.micro_step(tokens, targets, last=True)
        built.optimizer_step()


def rank_main(rank: int, port: int, out: str, strategies: list[dict[str, tp.Any]]) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    seen = []
    for strategy in strategies:
        step = [0]
        whole: Reduced = []
        run_steps(engine(rank, whole, step, strategy), rank, range(4), step)
        resumed: Reduced = []
        run_steps(engine(rank, resumed, step, strategy), rank, range(2, 4), step)
        seen.append({"whole": whole, "resumed": resumed})
    if rank == 0:
        torch.save(seen, out)
    dist.destroy_process_group()


# DDP searching for unused parameters never re-lays its buckets, so it needs (and gets) no settling pass
CASES = {
    "default": ({"name": "ddp"}, True),
    "find_unused_parameters": ({"name": "ddp", "find_unused_parameters": True}, False),
}


@pytest.mark.slow
def test_every_step_of_every_attempt_reduces_in_one_layout(tmp_path: Path) -> None:
    out = tmp_path / "layouts.pt"
    strategies = [strategy for strategy, _ in CASES.values()]
    mp.spawn(rank_main, args=(29400 + os.getpid() % 500, str(out), strategies), nprocs=WORLD)  # raises if a rank failed
    for (case, (_, settles)), seen in zip(CASES.items(), torch.load(out), strict=True):
        whole, resumed = seen["whole"], seen["resumed"]
        # a step's real reduction is its last (a settling pass before it reduces too)
        real = {n: layout for n, layout in whole}
        assert sorted(real) == [0, 1, 2, 3], (case, real.keys())
        assert all(real[n] == real[0] for n in real), f"{case}: steps reduced differently: {real}"
        first = [layout for n, layout in resumed if n == 2][-1]
        assert first == real[2], f"{case}: the resumed first step's layout:\n{first}\nvs\n{real[2]}"
        assert [layout for n, layout in resumed if n == 3] == [real[3]], case
        if settles:
            assert whole[0][1] != real[0], f"{case}: DDP's first layout is its settled one: proves nothing"
        else:
            assert len(whole) == 4, f"{case}: a settling pass ran: {len(whole)} reductions"


def test_the_old_per_parameter_default_still_loads() -> None:
    """A run submitted before the per-parameter hook was removed names it in its runspec.json:
    its recipe still validates, as DDP's own all-reduce (exact too), so that a requeued attempt
    of it can start."""
    from hpcrun.recipe import Recipe

    recipe = Recipe.model_validate({"name": "old", "strategy": {"name": "ddp", "comm_hook": "per_parameter"}})
    assert recipe.strategy.comm_hook == "none"  # type: ignore[union-attr]
