"""Restarts inside the job off the cluster: which nodes the next start uses, and what the
script asks SLURM for with spares (the cluster tests: tests/test_cluster_in_job.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import typing as tp
from pathlib import Path

import pytest

from hpcrun import slurm
from hpcrun.plan import RunSpec
from hpcrun.recipe import Recipe
from hpcrun.runtime.nodes import Probed, probed_nodes, restart_nodes
from hpcrun.site import load_site
from tests.helpers import ROOT, cli, load_yaml, write_yaml


def spec(nodes: int, spares: int) -> RunSpec:
    from hpcrun.plan import plan

    recipe = Recipe.model_validate(
        {"name": "r", "resources": {"nodes": nodes, "gpus_per_node": 2, "spare_nodes": spares, "partition": "spare"}}
    )
    return plan(load_site("testcluster"), recipe, "r.yaml", "run")


def test_a_lost_node_is_replaced_by_a_spare_in_place() -> None:
    two = spec(2, 1)
    alloc = ["n1", "n2", "n3"]
    assert restart_nodes(two, {}, ["n1", "n2"], alloc, []) == ["n1", "n2"]
    assert restart_nodes(two, {}, ["n1", "n2"], alloc, ["n1"]) == ["n2", "n3"]
    assert restart_nodes(two, {"excluded_nodes": ["n2"]}, ["n1", "n2"], alloc, []) == ["n1", "n3"]
    assert restart_nodes(two, {"failed_nodes": ["n3"]}, ["n1", "n2"], alloc, ["n2"]) is None  # none left


def test_probes_tell_a_lost_node_from_a_busy_controller(tmp_path: Path) -> None:
    """The batch script's probes (templates/sbatch.sh.j2): a node that ran no step while the
    controller answered is lost; with the controller silent too, it is only not to be restarted
    on; a probe that could not run (no srun: 127) or left no line says nothing."""
    ended = f"srun: error: node2: task 2: Killed\n{slurm.SRUN_ENDED}: it outlived its failed task by 10 s\n"
    probes = tmp_path / "probes"
    nodes = ["node1", "node2"]
    probes.write_text("node node2 124\nnode node1 0\ncontroller - 0\n")
    assert probed_nodes(nodes, ended, probes) == Probed(["node2"], [])
    probes.write_text("node node1 124\nnode node2 124\ncontroller - 124\n")
    assert probed_nodes(nodes, ended, probes) == Probed([], ["node1", "node2"])
    probes.write_text("node node1 127\nnode node2 1\ncontroller - 0\n")  # srun failed at once on a DOWN node
    assert probed_nodes(nodes, ended, probes) == Probed(["node2"], [])
    probes.write_text("node node1 0\nnode node2 143\ncontroller - 0\n")  # the probe itself stopped by a SIGTERM
    assert probed_nodes(nodes, ended, probes) == Probed([], [])
    probes.write_text("node node1 0\ncontroller - 0\n")  # node2's probe was cut off before its line
    assert probed_nodes(nodes, ended, probes) == Probed([], [])
    assert probed_nodes(nodes, "srun: error: node2: task 2: Exited with exit code 1\n", probes) == Probed([], [])
    assert probed_nodes(nodes, ended, tmp_path / "none") == Probed([], [])


ENDED = f"srun: error: node2: task 2: Killed\n{slurm.SRUN_ENDED}: it outlived its failed task by 10 s\n"


def failure_step(tmp: Path, spares: int, probes: str) -> tuple[Path, dict[str, str]]:
    """A run directory whose 2-node step the batch script ended, and the failure step's variables
    as the batch script sets them (the step's nodes probed as `probes` says)."""
    run_dir = tmp / "run"
    run_dir.mkdir()
    planned = spec(2, spares).model_copy(update={"results_dir": str(tmp / "results")})
    (run_dir / "runspec.json").write_text(planned.model_dump_json())
    (tmp / "probes").write_text(probes)
    return run_dir, {
        "SLURM_JOB_ID": "77", "HPCRUN_ATTEMPT": "0", "SLURM_RESTART_COUNT": "0", "HPCRUN_RESTARTS_IN_JOB": "0",
        "HPCRUN_STEP_NODES": "node1,node2", "HPCRUN_JOB_NODES": ",".join(["node1", "node2", "node3"][: 2 + spares]),
        "HPCRUN_PROBES": str(tmp / "probes"), "HPCRUN_NEXT_NODES": str(tmp / "next"),
    }


@pytest.mark.parametrize(("spares", "restarted"), [(1, "node1,node3"), (0, "node1,node2")])
def test_silent_nodes_are_not_counted_lost(
    spares: int, restarted: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failure step after probes that a busy controller left unanswered (its squeue silent
    too): the silent node is neither recorded failed nor excluded, and the step starts again in
    the job, on a spare where there is one, else on the same nodes (not a requeue)."""
    from hpcrun.rundir import RunDir
    from hpcrun.runtime.failure import record_failed_step

    path, env = failure_step(tmp_path, spares, "node node1 0\nnode node2 124\ncontroller - 124\n")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    run_dir = RunDir(path)
    reason = record_failed_step(run_dir, 1, ENDED)
    assert reason and "no answer from node2 (nor from SLURM's controller: not counted lost)" in reason, reason
    assert "node lost" not in reason and "restarting in the job" in reason, reason
    assert (tmp_path / "next").read_text().strip() == restarted
    state = run_dir.state()
    assert not state.get("failed_nodes") and not state.get("excluded_nodes"), state


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler for `sig` (/proc's SigCgt mask)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (sig - 1) & 1)


def test_a_stop_signal_to_the_failure_step_is_a_requeue_not_a_restart(tmp_path: Path) -> None:
    """SLURM's USR2 ahead of the time limit reaches every step, the failure step too: it writes
    the attempt's record all the same and asks for a requeue, not a restart inside the job (whose
    ranks no stop would reach). Its requeue fails here: SLURM's tools are shadowed, as in a
    container without them and no batch script to ask."""
    from hpcrun.rundir import RunDir

    path, env = failure_step(tmp_path, 1, "node node1 0\nnode node2 124\ncontroller - 0\n")
    noslurm = ROOT / "tests" / "cluster" / "noslurm" / "bin"
    env = {**os.environ, **env, "PATH": f"{noslurm}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    env.pop("SLURM_ARRAY_JOB_ID", None)
    step = subprocess.Popen(
        [sys.executable, "-m", "hpcrun.runtime.failure", str(path), "1"], env=env,
        stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert step.stdin is not None
    # it reads srun's messages from stdin first: the signal comes while it does, once it catches USR2
    deadline = time.time() + 60
    while time.time() < deadline and not catches(step.pid, signal.SIGUSR2):
        time.sleep(0.05)
    step.send_signal(signal.SIGUSR2)
    _, err = step.communicate(ENDED, timeout=60)
    assert step.returncode == 1, (step.returncode, err)  # the requeue could not be asked for, said in one line
    assert "recording the failed attempt: scontrol show job 77 failed: scontrol: command not found" in err, err
    state = RunDir(path).state()
    assert "SIGUSR2 during the failure step: not restarted in the job" in state["reason"], state
    said = "; not requeued: scontrol show job 77 failed: scontrol: command not found (in the container)"
    assert state["status"] == "failed" and state["reason"].endswith(said), state
    assert "node lost: node2" in state["reason"] and not (tmp_path / "next").exists(), state


def test_spares_are_allocated_and_the_job_outlives_a_lost_node(tmp_path: Path) -> None:
    data = load_yaml(ROOT / "jobs" / "quickstart.yaml")
    data["resources"].update(nodes=2, spare_nodes=1, partition="spare")
    recipe = write_yaml(tmp_path / "r.yaml", data)
    out = cli("render", "--site", "testcluster", str(recipe))
    assert out.exit_code == 0, out.output
    assert "#SBATCH --nodes=3\n" in out.stdout and "#SBATCH --no-kill\n" in out.stdout
    # the step: the training nodes only
    assert '| head -n 2 |' in out.stdout and '--nodes="$step_count" --ntasks=$((step_count * 2))' in out.stdout
    data["resources"].update(spare_nodes=0)
    shrinks = cli("render", "--site", "testcluster", str(write_yaml(tmp_path / "s.yaml", data))).stdout
    # the failure step decides (a shrink to 1 node by default, else its own requeue), whatever the strategy
    assert "#SBATCH --nodes=2\n" in shrinks and "#SBATCH --no-kill\n" in shrinks
    data["fault"] = {"restarts_in_job": 0}  # every failure through the queue: SLURM's NODE_FAIL for a lost node
    plain = cli("render", "--site", "testcluster", str(write_yaml(tmp_path / "p.yaml", data))).stdout
    assert "#SBATCH --nodes=2\n" in plain and "--no-kill" not in plain


def test_plan_names_the_spares(tmp_path: Path) -> None:
    data = load_yaml(ROOT / "jobs" / "quickstart.yaml")
    data["resources"].update(nodes=2, spare_nodes=1, partition="spare")
    out = cli("plan", "--site", "testcluster", str(write_yaml(tmp_path / "r.yaml", data)))
    assert out.exit_code == 0, out.output
    assert "on 2 x 2 of testcluster/spare (fp32; +1 spare node(s), held idle for the job)" in out.output, out.output


def test_snapshots_where_a_restart_can_read_them() -> None:
    from hpcrun.plan import plan

    def takes(site: str, **checkpoint: int) -> bool:
        recipe = Recipe.model_validate({"name": "r", "checkpoint": checkpoint})
        return plan(load_site(site), recipe, "r.yaml", "run").takes_snapshots

    assert takes("testcluster") and not takes("testcluster", memory_interval=0)
    assert not takes("local") and takes("local", memory_interval=25)  # nothing reads them locally unless asked


def test_deepspeed_builds_no_snapshots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's engine keeps no in-memory snapshots: its ranks build no Snapshots, so neither
    their gloo group (a collective on every rank) nor their sweep of the node's scratch. Built
    for an engine that keeps them. DeepSpeed's own build is left out: its engine class is enough."""
    import torch

    from hpcrun.plan import plan
    from hpcrun.runtime import snapshot
    from hpcrun.runtime.context import Context
    from hpcrun.runtime.engine import DeepSpeedEngine
    from hpcrun.runtime.env import DistEnv
    from hpcrun.signals import SignalFlag

    built: list[object] = []

    class Recorded:
        def __init__(self, *args: object, **kwargs: object) -> None:
            built.append(args)

        def restore(self, engine: object, newer_than: int) -> None:
            return None

    class Keeps:
        def snapshot_state(self, keep: bool = True) -> None: ...

    monkeypatch.setattr(snapshot, "Snapshots", Recorded)
    env = DistEnv(0, 0, 1, torch.device("cpu"), "gloo", 0, "7", "localhost", "7")
    deepspeed = DeepSpeedEngine.__new__(DeepSpeedEngine)  # the class, unbuilt: whether it has snapshot_state
    for strategy, engine, expected in (("deepspeed", deepspeed, 0), ("ddp", Keeps(), 1)):
        asked = {"name": "r", "strategy": {"name": strategy}, "checkpoint": {"memory_interval": 2}}
        spec = plan(load_site("local"), Recipe.model_validate(asked), "r.yaml", "run")
        spec = spec.model_copy(update={"run_dir": str(tmp_path / strategy)})
        assert spec.takes_snapshots, strategy
        monkeypatch.setattr(type(spec.strategy), "build", lambda *args, made=engine: made)
        built.clear()
        ctx = Context(spec, env, SignalFlag())
        ctx.setup(torch.nn.Linear(1, 1), lambda parameters: torch.optim.SGD(parameters))
        assert len(built) == expected and (ctx.snapshots is None) == (expected == 0), (strategy, built)


NVME_OPTIMIZER = {"name": "deepspeed", "stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"}


def test_min_nodes_resolved_and_checked(tmp_path: Path) -> None:
    """`fault.min_nodes`: by default half the nodes (rounded up) for the built-in benchmark, none
    less for an entrypoint job (its data loading must take ctx.data_ranks first), a command job or
    DeepSpeed's stage 0; set above `nodes`, or below it for a job that cannot shrink: one line, exit 2."""
    from hpcrun.plan import plan

    def planned(**fields: tp.Any) -> RunSpec:
        data = {"name": "r", "resources": {"nodes": 3, "gpus_per_node": 2, "partition": "spare"}, **fields}
        return plan(load_site("testcluster"), Recipe.model_validate(data), "r.yaml", "run")

    assert (planned().min_nodes, planned().shrinks) == (2, True)
    entry = {"kind": "entrypoint", "entrypoint": "m:f"}
    assert planned(job=entry).min_nodes == 3 and not planned(job=entry).shrinks
    assert planned(job=entry, fault={"min_nodes": 1}).min_nodes == 1
    assert planned(strategy={"name": "deepspeed", "stage": 3}).min_nodes == 2  # universal checkpoint
    assert planned(strategy=NVME_OPTIMIZER).min_nodes == 2  # ZeRO-Infinity: hpcrun.runtime.zeroinfinity
    assert planned(strategy={"name": "deepspeed", "stage": 0}).min_nodes == 3  # untested at another world size
    assert not planned(fault={"restarts_in_job": 0}).shrinks  # only a restart inside the job shrinks
    data = load_yaml(ROOT / "jobs" / "quickstart.yaml")
    data["resources"].update(nodes=2, partition="spare")
    for fault, strategy, words in (
        ({"min_nodes": 3}, None, "fault.min_nodes: must be <= resources.nodes (2)"),
        ({"min_nodes": 1}, {"name": "deepspeed", "stage": 0},
         "fault.min_nodes: strategy deepspeed resumes only at the world size that saved it"),
    ):
        edited = {**data, "fault": fault, **({"strategy": strategy} if strategy else {})}
        out = cli("validate", "--site", "testcluster", str(write_yaml(tmp_path / "r.yaml", edited)))
        assert out.exit_code == 2 and words in out.output, out.output


def test_a_shrunk_deepspeed_engines_micro_batches_count_their_share() -> None:
    """DeepSpeedEngine.micro_step: DeepSpeed divides each micro-batch's loss by its accumulation steps
    and averages over the ranks left, so the loss it is given is scaled to count 1/(W x grad_accum) of
    the step: 6 ranks' batch on 4 (grad_accum 1) runs 2 micro-batches a rank, the second padding on
    ranks 2-3. Unshrunk, the loss goes to DeepSpeed as it came (tests/test_snapshot.py trains through it)."""
    import torch

    from hpcrun.runtime.engine import DeepSpeedEngine

    class Stub:
        optimizer = None

        def __init__(self, gas: int) -> None:
            self.gas, self.loss, self.given = gas, torch.tensor(2.0), list[torch.Tensor]()

        def __call__(self, tokens: tp.Any, targets: tp.Any) -> torch.Tensor:
            return self.loss

        def backward(self, loss: torch.Tensor) -> None:
            self.given.append(loss)

        def step(self) -> None:
            pass

        def gradient_accumulation_steps(self) -> int:
            return self.gas

    plain = Stub(4)
    DeepSpeedEngine(plain, 4).micro_step(torch.zeros(1), torch.zeros(1), last=False)
    assert plain.given == [plain.loss] and plain.given[0] is plain.loss
    shrunk = Stub(2)
    engine = DeepSpeedEngine(shrunk, 1)
    engine.accum = 6 * 1 / 4  # hpcrun.runtime.context: what each loss is divided by in all
    engine.micro_step(torch.zeros(1), torch.zeros(1), last=False)
    engine.micro_step(torch.zeros(1), torch.zeros(1), last=True, weight=0.0)
    counted = [float(loss) / shrunk.gas / 4 for loss in shrunk.given]  # DeepSpeed's division, its average
    assert counted == pytest.approx([2.0 / 6, 0.0], rel=1e-6), counted  # float32 losses


@pytest.mark.parametrize(("least", "restarted"), [(2, "node1,node2"), (3, None)])
def test_a_lost_node_without_a_spare_shrinks_the_job_down_to_min_nodes(
    least: int, restarted: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failure step after node3 of a 3-node job with no spare is lost: with `min_nodes: 2` the
    step starts again in the job on the two nodes left; with 3 (below it) the job is requeued, as
    before (that requeue fails here: SLURM's tools are shadowed)."""
    from hpcrun.errors import HpcrunError
    from hpcrun.plan import plan
    from hpcrun.results import load
    from hpcrun.rundir import RunDir
    from hpcrun.runtime.failure import record_failed_step

    recipe = Recipe.model_validate({"name": "r", "resources": {"nodes": 3, "gpus_per_node": 2, "partition": "spare"},
                                    "fault": {"min_nodes": least}})
    planned = plan(load_site("testcluster"), recipe, "r.yaml", "run").model_copy(
        update={"results_dir": str(tmp_path / "results")})
    run_dir = RunDir(tmp_path / "run")
    run_dir.path.mkdir()
    run_dir.spec.write_text(planned.model_dump_json())
    (tmp_path / "probes").write_text("node node1 0\nnode node2 0\nnode node3 124\ncontroller - 0\n")
    for name, value in {
        "SLURM_JOB_ID": "77", "HPCRUN_ATTEMPT": "0", "SLURM_RESTART_COUNT": "0", "HPCRUN_RESTARTS_IN_JOB": "0",
        "HPCRUN_STEP_NODES": "node1,node2,node3", "HPCRUN_JOB_NODES": "node1,node2,node3",
        "HPCRUN_PROBES": str(tmp_path / "probes"), "HPCRUN_NEXT_NODES": str(tmp_path / "next"),
        "PATH": f"{ROOT / 'tests' / 'cluster' / 'noslurm' / 'bin'}:{os.environ['PATH']}",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    ended = f"srun: error: node3: task 4: Killed\n{slurm.SRUN_ENDED}: it outlived its failed task by 5 s\n"
    if least == 2:  # only a survivor told srun, with its peer's consequence: the cause is the lost node
        from hpcrun.runtime.failure import write_exit_record

        write_exit_record(run_dir, "77", 0, 1, "RuntimeError: [gloo] Connection closed by peer [10.0.0.3]:29500", 12,
                          {})
        ended = f"srun: error: node1: task 1: Exited with exit code 1\n{slurm.SRUN_ENDED}: it outlived its failed task"
    if restarted:
        reason = record_failed_step(run_dir, 1, ended)
        assert reason and reason.startswith("rank 4 on node3: node lost: node3 at step 12"), reason
        assert "on 2 of 3 nodes (node1,node2)" in reason, reason
        assert (tmp_path / "next").read_text().strip() == restarted
    else:
        with pytest.raises(HpcrunError, match="scontrol"):
            record_failed_step(run_dir, 1, ended)
        assert not (tmp_path / "next").exists()
        assert "requeue" in run_dir.state()["reason"], run_dir.state()
    (row,) = load(tmp_path / "results").to_dict("records")
    assert (row["world_size"], row["nodes"]) == (6, 3), row  # the failed attempt's own world


@pytest.mark.parametrize(
    ("data_world", "world", "accum", "sharded", "padding"),
    [
        (6, 4, 1, True, [0, 0, 1, 1]),  # 2, 2, 1, 1 slices
        (6, 4, 3, True, [0, 0, 3, 3]),  # each slice once per accumulation round
        (4, 2, 1, True, [0, 0]),  # even shares: none
        (6, 4, 1, False, [0, 0, 0, 0]),  # DDP reduces once, at the last micro-batch, whatever the share
        (4, 4, 1, True, [0, 0, 0, 0]),  # not shrunk
    ],
)
def test_a_shrunk_sharded_states_ranks_run_as_many_micro_batches(
    data_world: int, world: int, accum: int, sharded: bool, padding: list[int]
) -> None:
    """Context.padding: a shrunk sharded state reduces every micro-batch's gradients, so each rank runs
    as many micro-batches as the one with the most slices (tests/test_snapshot.py trains through it)."""
    from types import SimpleNamespace

    from hpcrun.runtime.context import Context

    got = []
    for rank in range(world):
        ctx = SimpleNamespace(
            engine=SimpleNamespace(sync_every=sharded), data_world=data_world, world_size=world,
            data_ranks=list(range(rank, data_world, world)), shrunk=world < data_world,
            recipe=SimpleNamespace(training=SimpleNamespace(grad_accum=accum)),
        )
        ctx.micro_batches = Context.micro_batches.fget(ctx)  # type: ignore[attr-defined]
        got.append(Context.padding.fget(ctx))  # type: ignore[attr-defined]
        if sharded:  # every rank as many as rank 0, which has the most
            assert len(ctx.data_ranks) * accum + got[-1] == len(range(0, data_world, world)) * accum
    assert got == padding
    with pytest.raises(RuntimeError, match="once ctx.setup"):
        Context.padding.fget(SimpleNamespace(engine=None))  # type: ignore[attr-defined]
