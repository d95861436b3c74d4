"""A strategy is one module plus `register`: a toy strategy defined here is validated in a
recipe, checked and planned against a site, and trains (one rank, in this process) through the
same loop, checkpoints and results row as the built-in ones."""

from __future__ import annotations

import json
import signal
import typing as tp
from pathlib import Path

import pydantic
import pytest
import yaml

from hpcrun.errors import HpcrunError
from hpcrun.plan import runs_of
from hpcrun.recipe import load_recipe
from hpcrun.site import load_site
from hpcrun.strategies import REGISTRY, Option, PlanProblem, Strategy, register
from tests.runs import site_copy

if tp.TYPE_CHECKING:
    from hpcrun.runtime.env import DistEnv
    from hpcrun.site import Partition, Site
    from hpcrun.strategies.contract import Engine, OptimizerFactory, Settings

ALONE = Option("toy", {"name": "toy"}, "none", False, False, order=100)


class Toy(Strategy):
    """One process holding the whole model, no wrapper: the smallest possible strategy."""

    name: tp.Literal["toy"]
    label: str = "plain"
    """Shown in the results row's `extra`-free columns: a setting of the toy's own."""
    cpu_only: bool = True
    """Refuse GPU partitions (a plan-time check of the toy's own)."""

    @pydantic.field_validator("label")
    @classmethod
    def _short(cls, value: str) -> str:
        if len(value) > 8:
            raise ValueError(f"at most 8 characters (got {value!r})")
        return value

    def check(self, recipe: Settings, partition: Partition, site: Site) -> None:
        if self.cpu_only and partition.gpus_per_node:
            raise PlanProblem("cpu_only", "the toy strategy runs on CPU partitions only")

    @classmethod
    def planner_options(cls) -> list[Option]:
        return [ALONE]

    def memory_option(self) -> Option:
        return ALONE

    def result_columns(self) -> dict[str, tp.Any]:
        return {"zero_stage": None, "offload_optimizer": f"toy-{self.label}", "offload_param": "none"}

    def build(
        self,
        model: tp.Any,
        make_optimizer: OptimizerFactory,
        recipe: Settings,
        env: DistEnv,
        run_dir: str | None,
        nvme_dir: str | None,
    ) -> Engine:
        from hpcrun.runtime.engine import TorchEngine

        model = model.to(env.device)
        return TorchEngine(model, make_optimizer(model.parameters()), recipe, env, model)


@pytest.fixture()
def toy() -> tp.Iterator[type[Toy]]:
    register(Toy)
    try:
        yield Toy
    finally:
        REGISTRY.pop("toy", None)


def write_recipe(tmp_path: Path, strategy: dict[str, tp.Any], **fields: tp.Any) -> Path:
    data = {
        "name": "toy", "job": {"kind": "benchmark", "model": "tiny"}, "strategy": strategy,
        "resources": {"nodes": 1, "gpus_per_node": 1, "time": "00:10:00"},
        "training": {"steps": 6, "lr": 0.003, "warmup_steps": 1}, "checkpoint": {"interval": 3}, **fields,
    }
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_unregistered_is_unknown(tmp_path: Path) -> None:
    with pytest.raises(HpcrunError, match=r"strategy: must be one of 'ddp', 'fsdp', 'deepspeed' \(got 'toy'\)"):
        load_recipe(write_recipe(tmp_path, {"name": "toy"}))


def test_toy_validates_checks_and_plans(toy: type[Toy], tmp_path: Path) -> None:
    with pytest.raises(HpcrunError, match="strategy.label: at most 8 characters"):
        load_recipe(write_recipe(tmp_path, {"name": "toy", "label": "far-too-long"}))
    with pytest.raises(HpcrunError, match=r"strategy.colour: unknown key \(valid keys: cpu_only, label, name\)"):
        load_recipe(write_recipe(tmp_path, {"name": "toy", "colour": "red"}))
    recipe = load_recipe(write_recipe(tmp_path, {"name": "toy", "label": "mine"}))
    assert isinstance(recipe.base.strategy, Toy) and recipe.base.strategy.label == "mine"
    with pytest.raises(HpcrunError, match="strategy.cpu_only: the toy strategy runs on CPU partitions only"):
        runs_of(load_site("mycluster"), recipe, "r")
    from hpcrun.memory import estimate, misfit, options

    (spec,) = runs_of(load_site("local"), recipe, "r")
    assert spec.strategy == recipe.base.strategy
    assert options()[-1] == ALONE and misfit(spec) is None
    assert [e.option for e in estimate(spec)][-1] == ALONE
    assert "toy" in Toy.model_fields["label"].description  # per-field docs reach the schema


@pytest.mark.slow
def test_toy_trains(toy: type[Toy], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the runtime's own entry point on a runspec.json, so the spec's JSON names the
    toy and is read back as one."""
    import os

    from hpcrun.results import load
    from hpcrun.rundir import RunDir, write_json
    from hpcrun.runtime.trainer import main

    recipe = load_recipe(write_recipe(tmp_path, {"name": "toy", "label": "mine"}))
    (spec,) = runs_of(load_site(str(site_copy(tmp_path))), recipe, "toy-run")
    run = RunDir(spec.run_dir)
    write_json(run.spec, spec.model_dump(mode="json"))
    assert json.loads(run.spec.read_text())["recipe"]["strategy"] == {"name": "toy", "label": "mine", "cpu_only": True}
    for name, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(21000 + os.getpid() % 1000),
        "HPCRUN_LOCAL_JOB_ID": "7",
    }.items():
        monkeypatch.setenv(name, value)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR2, signal.SIGTERM)}
    try:
        summary = main(str(run.spec))
    finally:  # the runtime installs its stop flag: give pytest its own handlers back
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert summary["status"] == "completed" and summary["step"] == 6
    assert run.state()["status"] == "completed"
    curve = [float(x) for x in run.losses("7", 0).read_text().split()]
    assert len(curve) == 6 and curve[-1] < curve[0] - 0.05, curve
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step-00000003", "step-00000006"]
    (row,) = load(spec.results_dir, run_id=spec.run_id).to_dict("records")
    assert row["strategy"] == "toy" and row["offload_optimizer"] == "toy-mine" and row["world_size"] == 1
    assert row["mfu"] > 0  # the plan's peak (the local site's per-rank CPU figure) reached the row
