"""Each validation rule: one line naming file and field, exit code 2, no traceback."""

from __future__ import annotations

import copy
import subprocess
import sys
import typing as tp
from pathlib import Path

import pytest

from tests.helpers import ROOT, cli, load_yaml, write_yaml

SITE = load_yaml(ROOT / "sites" / "mycluster.yaml")
RECIPE = load_yaml(ROOT / "jobs" / "quickstart.yaml")


def edited(base: dict[str, tp.Any], edit: tp.Callable[[dict[str, tp.Any]], None]) -> dict[str, tp.Any]:
    data = copy.deepcopy(base)
    edit(data)
    return data


SITE_CASES = [
    ("unknown top key", lambda d: d.update(colour="blue"), "colour: unknown key (valid keys: account,"),
    ("unknown nested key", lambda d: d["partitions"]["gpu"].update(gpus=8), "partitions.gpu.gpus: unknown key"),
    (
        "wrong type",
        lambda d: d["partitions"]["gpu"].update(gpus_per_node="eight"),
        "partitions.gpu.gpus_per_node: input should be a valid integer",
    ),
    (
        "zero nodes",
        lambda d: d["partitions"]["gpu"].update(max_nodes=0),
        "partitions.gpu.max_nodes: input should be greater than or equal to 1 (got 0)",
    ),
    (
        "bad interconnect",
        lambda d: d["network"].update(interconnect="token-ring"),
        "network.interconnect: input should be",
    ),
    (
        "bad default partition",
        lambda d: d.update(default_partition="nope"),
        "default_partition 'nope' is not among partitions",
    ),
    ("gpu without model", lambda d: d["partitions"]["gpu"].pop("gpu"), "gpu: required when gpus_per_node > 0"),
    (
        "bad time",
        lambda d: d["partitions"]["gpu"].update(max_time="two days"),
        "partitions.gpu.max_time: must be a SLURM time",
    ),
    (
        "bad gpu request",
        lambda d: d["partitions"]["gpu"].update(gpu_request="--gres=gpu"),
        "partitions.gpu.gpu_request: must be an sbatch option with a {n}",
    ),
    ("bad env name", lambda d: d["network"]["env"].update({"1BAD": "x"}), "network.env.1BAD: "),
    (
        "relative scratch",
        lambda d: d["storage"].update(local_scratch="shm"),
        "storage.local_scratch: must be an absolute path, the same on every node (got 'shm')",
    ),
    (
        "sbatch option",
        lambda d: d["environment"].update(sbatch=["exclusive"]),
        "environment.sbatch: each entry must be a long sbatch option",
    ),
]


@pytest.mark.parametrize("name,edit,expected", SITE_CASES, ids=[c[0] for c in SITE_CASES])
def test_site_rules(name: str, edit: tp.Callable[..., None], expected: str, tmp_path: Path) -> None:
    site = write_yaml(tmp_path / "site.yaml", edited(SITE, edit))
    result = cli("validate", str(site))
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith(f"error {site}: ")
    assert expected in line, line


RECIPE_CASES = [
    (
        "unknown key",
        lambda d: d["training"].update(stepz=3),
        "training.stepz: unknown key (valid keys: activation_checkpointing,",
    ),
    ("wrong type", lambda d: d["training"].update(steps="many"), "training.steps: input should be a valid integer"),
    (
        "unknown strategy",
        lambda d: d.update(strategy={"name": "horovod"}),
        "strategy: must be one of 'ddp', 'fsdp', 'deepspeed' (got 'horovod')",
    ),
    (
        "deepspeed stage",
        lambda d: d.update(strategy={"name": "deepspeed", "stage": 5}),
        "strategy.stage: input should be 0, 1, 2 or 3",
    ),
    (
        "param offload needs stage 3",
        lambda d: d.update(strategy={"name": "deepspeed", "stage": 2, "offload_param": "cpu"}),
        "offload_param needs stage 3",
    ),
    ("keep", lambda d: d["checkpoint"].update(keep=1), "checkpoint.keep: keep at least 2 checkpoints"),
    ("model size", lambda d: d["job"].update(model="huge"), "job.model: unknown model size 'huge'"),
    (
        "entrypoint form",
        lambda d: d.update(job={"kind": "entrypoint", "entrypoint": "no colon"}),
        "job.entrypoint: string should match pattern",
    ),
    (
        "command launcher",
        lambda d: d.update(job={"kind": "command", "command": ["python", "x.py"], "launcher": "mpirun"}),
        "job.launcher: input should be 'srun' or 'torchrun' (got 'mpirun')",
    ),
    ("missing name", lambda d: d.pop("name"), "name: required"),
    (
        "partition missing",
        lambda d: d["resources"].update(partition="huge"),
        "resources.partition: site 'mycluster' has no partition 'huge'",
    ),
    ("too many nodes", lambda d: d["resources"].update(nodes=65), "resources.nodes: must be <= 64"),
    (
        "too many gpus",
        lambda d: d["resources"].update(gpus_per_node=9),
        "resources.gpus_per_node: must be <= 8, the GPUs per node",
    ),
    (
        "spares past the partition",
        lambda d: d["resources"].update(nodes=63, spare_nodes=2),
        "resources.spare_nodes: must be <= 64, the most partition 'gpu' allows (got 63 + 2 spare)",
    ),
    (
        "spares without restarts in the job",
        lambda d: (d["resources"].update(spare_nodes=1), d.update(fault={"restarts_in_job": 0})),
        "resources.spare_nodes: spare nodes are used only by restarts inside the job",
    ),
    ("time over limit", lambda d: d["resources"].update(time="3-00:00:00"), "resources.time: must be <= 2-00:00:00"),
    (
        "debug partition time",
        lambda d: d["resources"].update(partition="debug", time="01:00:00"),
        "resources.time: must be <= 00:30:00",
    ),
    (
        "stage field",
        lambda d: d.update(stages=[{"name": "a", "strategy": {"name": "fsdp", "sharding": "diagonal"}}]),
        "stages.0.strategy.sharding",
    ),
    (
        "sweep axis",
        lambda d: d.update(sweep={"axes": {"colour": [1]}}),
        "sweep.axes: axis 'colour' must start with one of",
    ),
    (
        "sweep point",
        lambda d: d.update(sweep={"axes": {"training.steps": [1, -1]}}),
        "training.steps: input should be greater than or equal to 1",
    ),
]


@pytest.mark.parametrize("name,edit,expected", RECIPE_CASES, ids=[c[0] for c in RECIPE_CASES])
def test_recipe_rules(name: str, edit: tp.Callable[..., None], expected: str, tmp_path: Path) -> None:
    recipe = write_yaml(tmp_path / "recipe.yaml", edited(RECIPE, edit))
    result = cli("validate", "--site", "mycluster", str(recipe))
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith(f"error {recipe}: "), line
    assert expected in line, line


@pytest.mark.parametrize(
    "strategy,field,words",
    [
        ({"name": "ddp", "comm_hook": "bf16"}, "strategy.comm_hook", "the bf16 compression hook needs NCCL"),
        ({"name": "fsdp", "cpu_offload": True}, "strategy.cpu_offload", "FSDP CPU offload moves parameters off a GPU"),
    ],
)
def test_gpu_only_options_on_a_cpu_partition(strategy: dict, field: str, words: str, tmp_path: Path) -> None:
    recipe = write_yaml(tmp_path / "r.yaml", {**RECIPE, "strategy": strategy})
    result = cli("validate", "--site", "testcluster", str(recipe))
    assert result.exit_code == 2
    assert f"{recipe}: {field}: {words}" in result.output
    assert cli("validate", "--site", "mycluster", str(recipe)).exit_code == 0  # fine where there are GPUs


def test_spare_nodes_need_slurm(tmp_path: Path) -> None:
    recipe = write_yaml(tmp_path / "recipe.yaml", edited(RECIPE, lambda d: d["resources"].update(spare_nodes=1)))
    result = cli("validate", "--site", "local", str(recipe))
    assert result.exit_code == 2, result.output
    assert "resources.spare_nodes: spare nodes need a SLURM site" in result.output.strip(), result.output


def test_nvme_offload_without_nvme(tmp_path: Path) -> None:
    result = cli("render", "--site", "slingshot", "jobs/zero-infinity.yaml")
    assert result.exit_code == 2
    assert result.output.strip() == (
        "Error: jobs/zero-infinity.yaml: strategy.offload_param: "
        "nvme offload needs storage.nvme in site 'slingshot', which has none"
    )


def test_unknown_site_lists_known_ones() -> None:
    result = cli("render", "--site", "nowhere", "jobs/quickstart.yaml")
    assert result.exit_code == 2
    assert (
        "--site: unknown site 'nowhere'; known sites: aws-efa, local, mycluster, slingshot, testcluster"
        in result.output
    )


def test_bad_yaml_names_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntraining: [unclosed\n")
    result = cli("validate", str(bad))
    assert result.exit_code == 2
    assert f"{bad}: line 3, column 1: invalid YAML" in result.output


def test_debug_shows_traceback() -> None:
    plain = subprocess.run(
        [sys.executable, "-m", "hpcrun.cli", "render", "--site", "nowhere", "jobs/quickstart.yaml"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    debug = subprocess.run(
        [sys.executable, "-m", "hpcrun.cli", "--debug", "render", "--site", "nowhere", "jobs/quickstart.yaml"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    assert plain.stderr.strip().count("\n") == 0
    assert "Traceback" in debug.stderr and "unknown site 'nowhere'" in debug.stderr


def test_site_search_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    own = edited(SITE, lambda d: d.update(name="mine"))
    write_yaml(tmp_path / "mine.yaml", own)
    monkeypatch.setenv("HPCRUN_SITES", str(tmp_path))
    result = cli("sites", "show", "mine")
    assert result.exit_code == 0, result.output
    assert "name: mine" in result.output and "NCCL_IB_HCA: mlx5_0," in result.output
    assert "mine" in cli("sites").output


def test_time_formats() -> None:
    from hpcrun.fields import format_minutes, parse_minutes

    assert [parse_minutes(v) for v in ("30", "30:00", "01:30:00", "1-00", "1-02:03", "1-02:03:04", 90)] == [
        30,
        30,
        90,
        1440,
        1563,
        1564,
        90,
    ]
    assert format_minutes(1564) == "1-02:04:00"
    assert format_minutes(90) == "01:30:00"


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "jobs").glob("*.yaml")))
def test_shipped_recipes_are_valid(name: str) -> None:
    result = cli("validate", str(ROOT / "jobs" / name))
    assert result.exit_code == 0, result.output
