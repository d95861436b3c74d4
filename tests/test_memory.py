"""The planner's arithmetic against the ZeRO paper's worked example, and its verdicts."""

from __future__ import annotations

import typing as tp

import pytest

from hpcrun.memory import GB, estimate, model_state_bytes, options, recommend
from hpcrun.plan import plan
from hpcrun.recipe import Recipe
from hpcrun.site import load_site
from hpcrun.sizes import SIZES
from tests.helpers import ROOT, cli


def option(name: str):  # type: ignore[no-untyped-def]
    return next(o for o in options() if o.name == name)


@pytest.mark.parametrize("name,expected_gb", [("ddp", 120), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.88)])
def test_zero_paper_example(name: str, expected_gb: float) -> None:
    """ZeRO paper, figure 1: 7.5B parameters on 64 GPUs with mixed-precision Adam."""
    per_gpu, _ = model_state_bytes(7.5e9, 64, option(name), mixed=True)
    assert per_gpu / GB == pytest.approx(expected_gb, rel=0.01)


def test_fsdp_variants_match_their_zero_stages() -> None:
    for fsdp, zero in (("fsdp-full", "zero3"), ("fsdp-grad_op", "zero2")):
        assert model_state_bytes(1e9, 16, option(fsdp), True) == model_state_bytes(1e9, 16, option(zero), True)
    hybrid, _ = model_state_bytes(1e9, 16, option("fsdp-hybrid"), True, per_node=8)
    assert hybrid == pytest.approx(16e9 / 8)


def spec_for(model: str, nodes: int, ckpt: bool = False):  # type: ignore[no-untyped-def]
    recipe = Recipe.model_validate({
        "name": "p", "job": {"kind": "benchmark", "model": model}, "precision": "bf16-mixed",
        "resources": {"nodes": nodes, "gpus_per_node": 8, "time": "01:00:00"},
        "training": {"micro_batch": 1, "seq_len": 2048, "activation_checkpointing": ckpt},
    })
    return plan(load_site("mycluster"), recipe, "r.yaml", "id")


def test_13b_on_one_node_needs_sharding() -> None:
    verdicts = {e.option.name: e for e in estimate(spec_for("13b", 1, ckpt=True))}
    assert not verdicts["ddp"].fits and "per GPU, has 80" in verdicts["ddp"].why
    assert verdicts["zero3"].fits and verdicts["fsdp-full"].fits
    best, why = recommend(list(verdicts.values()))
    assert best is not None and best.option.name == "zero1"  # 4 + 12/8 bytes per parameter: 71.9 GB < 80
    assert "least communication" in why


def test_small_model_recommends_ddp() -> None:
    best, why = recommend(estimate(spec_for("125m", 1)))
    assert best is not None and best.option.name == "ddp"


def test_activation_checkpointing_shrinks_activations() -> None:
    from hpcrun.memory import activation_bytes, loss_bytes

    # the blocks' share: the loss's buffers (4V kept, 8V in backward per token) are the same either way
    loss = 2048 * (loss_bytes(2048, 50304, mixed=True) + 8 * 50304)
    assert activation_bytes(spec_for("1.3b", 1, ckpt=True)) - loss < (activation_bytes(spec_for("1.3b", 1)) - loss) / 5


def test_plan_command(tmp_path) -> None:  # type: ignore[no-untyped-def]
    recipe = tmp_path / "big.yaml"
    recipe.write_text(
        "name: big\njob: {kind: benchmark, model: 13b}\nprecision: bf16-mixed\n"
        "resources: {nodes: 1, gpus_per_node: 8, time: '01:00:00'}\n"
        "training: {micro_batch: 1, seq_len: 2048, activation_checkpointing: true}\n"
    )
    out = cli("plan", "--site", "mycluster", str(recipe))
    assert out.exit_code == 0, out.output
    assert "ddp" in out.output and "no" in out.output and "recommended:" in out.output
    assert "zero3-nvme" in out.output


@pytest.mark.parametrize(
    "params,largest,per_node,nodes",
    [(7_500_000_000, 200_000_000, 8, 8), (1_300_000_000, 103_000_000, 4, 2), (125_000_000, 38_000_000, 2, 1)],
)
def test_deepspeed_estimators_agree(params: int, largest: int, per_node: int, nodes: int) -> None:
    """Our torch-free restatement equals DeepSpeed's own cold estimators."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    def ours(name: str) -> tuple[float, float]:
        estimator = option(name).library_estimate
        assert estimator is not None
        return estimator(params, largest, per_node, nodes)

    cpu, gpu = estimate_zero2_model_states_mem_needs(params, per_node, nodes, cpu_offload=False)
    assert ours("zero2") == pytest.approx((cpu, gpu), rel=1e-9)
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
        params, largest, per_node, nodes, cpu_offload=False, cpu_offload_params=False, zero_init=True
    )
    assert ours("zero3") == pytest.approx((cpu, gpu), rel=1e-9)
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
        params, largest, per_node, nodes, cpu_offload=True, cpu_offload_params=True, zero_init=True
    )
    assert ours("zero3-cpu") == pytest.approx((cpu, gpu), rel=1e-9)
    assert option("ddp").library_estimate is None and option("fsdp-full").library_estimate is None


def with_node_memory(tmp_path, base: str, partition: str, memory_gb: float):  # type: ignore[no-untyped-def]
    """A shipped site with one partition's node memory changed."""
    import yaml

    data = yaml.safe_load((ROOT / "sites" / f"{base}.yaml").read_text())
    data["partitions"][partition]["memory_gb"] = memory_gb
    path = tmp_path / f"{base}-{memory_gb}gb.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_site(str(path))


def test_asynchronous_checkpoints_count_their_host_copy(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An asynchronous DCP save copies each rank's fp32 weights and Adam moments (12 bytes per
    parameter, sharded like the weights) into host memory: 13B on 8 GPUs with FSDP stages 156 GB
    per node, too much for a 128 GB node, while DeepSpeed (synchronous) is unaffected."""
    site = with_node_memory(tmp_path, "mycluster", "gpu", 128)

    def verdicts(asynchronous: bool):  # type: ignore[no-untyped-def]
        recipe = Recipe.model_validate({
            "name": "p", "job": {"kind": "benchmark", "model": "13b"}, "precision": "bf16-mixed",
            "resources": {"nodes": 1, "gpus_per_node": 8, "time": "01:00:00"},
            "training": {"micro_batch": 1, "seq_len": 2048, "activation_checkpointing": True},
            "checkpoint": {"asynchronous": asynchronous, "memory_interval": 0},
        })
        return {e.option.name: e for e in estimate(plan(site, recipe, "r.yaml", "id"))}

    staged = verdicts(True)
    assert not staged["fsdp-full"].fits and "checkpoint.asynchronous: false" in staged["fsdp-full"].why
    assert staged["fsdp-full"].cpu_gb_per_node == pytest.approx(12 * 13e9 / 8 * 8 / GB, rel=0.05)
    assert staged["zero3"].fits and staged["zero3"].cpu_gb_per_node == 0
    inline = verdicts(False)
    assert inline["fsdp-full"].fits and inline["fsdp-full"].cpu_gb_per_node == 0


def test_in_memory_snapshots_count_their_host_memory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Snapshots (checkpoint.memory_interval) hold, per node, the newest complete step and the one
    being written of its own ranks and of another node's (their replicas), plus a host copy to
    write from: 5 x the 12 bytes per parameter a save stages (3 x on one node, which has no
    peer), for DDP once per node (its ranks' states are the same). DeepSpeed keeps none;
    `memory_interval: 0` frees it."""
    site = with_node_memory(tmp_path, "mycluster", "gpu", 1024)

    def planned(nodes: int, interval: int, strategy: dict[str, tp.Any] | None = None):  # type: ignore[no-untyped-def]
        recipe = Recipe.model_validate({
            "name": "p", "job": {"kind": "benchmark", "model": "1.3b"}, "precision": "bf16-mixed",
            "resources": {"nodes": nodes, "gpus_per_node": 8, "time": "01:00:00"},
            "training": {"micro_batch": 1, "seq_len": 2048, "activation_checkpointing": True},
            "checkpoint": {"asynchronous": False, "memory_interval": interval},
            **({"strategy": strategy} if strategy else {}),
        })
        return plan(site, recipe, "r.yaml", "id")

    def verdicts(nodes: int, interval: int):  # type: ignore[no-untyped-def]
        return {e.option.name: e for e in estimate(planned(nodes, interval))}

    def own(strategy: dict[str, tp.Any]):  # type: ignore[no-untyped-def]
        """The recipe's own strategy's verdict (what `submit` checks), 2 nodes x 8."""
        spec = planned(2, 10, strategy)
        (verdict,) = estimate(spec, [spec.strategy.memory_option()])
        return verdict

    params = SIZES["1.3b"].parameters(2048)
    two = verdicts(2, 10)
    per_node = 12 * params / 16 * 8  # FULL_SHARD over 16 ranks, 8 of them on each node
    assert two["fsdp-full"].snapshot_gb_per_node == pytest.approx(5 * per_node / GB)
    assert two["fsdp-full"].cpu_gb_per_node == pytest.approx(5 * per_node / GB)
    assert two["ddp"].snapshot_gb_per_node == pytest.approx(5 * 12 * params / GB)
    assert verdicts(1, 10)["ddp"].snapshot_gb_per_node == pytest.approx(3 * 12 * params / GB)
    assert two["zero3"].snapshot_gb_per_node == 0
    assert verdicts(2, 0)["fsdp-full"].cpu_gb_per_node == 0
    small = with_node_memory(tmp_path, "mycluster", "gpu", 64)  # DDP's 1.3b snapshots: 78 GB per node
    recipe = Recipe.model_validate({
        "name": "p", "job": {"kind": "benchmark", "model": "1.3b"}, "precision": "bf16-mixed",
        "resources": {"nodes": 2, "gpus_per_node": 8, "time": "01:00:00"},
        "checkpoint": {"asynchronous": False, "memory_interval": 10},
    })
    spec = plan(small, recipe, "r.yaml", "id")
    (ddp,) = estimate(spec, [spec.strategy.memory_option()])
    assert not ddp.fits and "checkpoint.memory_interval: 0" in ddp.why, ddp.why

    # FSDP's no_shard lays states out as DDP does, but each of its ranks snapshots its own
    assert own({"name": "fsdp", "sharding": "no_shard"}).snapshot_gb_per_node == pytest.approx(
        5 * 12 * params * 8 / GB
    )
    assert own({"name": "ddp"}).snapshot_gb_per_node == pytest.approx(5 * 12 * params / GB)
    assert own({"name": "deepspeed", "stage": 0}).snapshot_gb_per_node == 0  # DeepSpeed keeps none


def test_cpu_ranks_and_staging_share_the_node_memory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """On a CPU partition the ranks' model states and the checkpoint staging buffers are one
    memory: 125m DDP with 2 ranks (2.1 GB each in fp32) fits a 6 GB node, not with its 3 GB of
    staging buffers."""
    site = with_node_memory(tmp_path, "local", "local", 6)

    def ddp(asynchronous: bool):  # type: ignore[no-untyped-def]
        recipe = Recipe.model_validate({
            "name": "c", "job": {"kind": "benchmark", "model": "125m"}, "resources": {"nodes": 1, "gpus_per_node": 2},
            "training": {"micro_batch": 1, "seq_len": 128},
            "checkpoint": {"asynchronous": asynchronous, "memory_interval": 0},
        })
        return next(e for e in estimate(plan(site, recipe, "r.yaml", "id")) if e.option.name == "ddp")

    staged, inline = ddp(True), ddp(False)
    assert inline.fits, inline.why
    assert not staged.fits and "memory per node" in staged.why and "checkpoint.asynchronous: false" in staged.why
