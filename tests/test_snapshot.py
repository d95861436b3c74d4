"""In-memory snapshots (hpcrun.runtime.snapshot) off the cluster: four real rank processes on this
machine as two pretend nodes of two ranks, each node with a scratch directory of its own
(`HPCRUN_LOCAL_SCRATCH`), started the way srun starts an in-job restart (same job id, same
SLURM requeue count). The training is SIGKILLed whole after a snapshot, a node's scratch is deleted (a
lost node) or a snapshot torn, the ranks are started again, and the run must end with the weights
(sha256) and losses of a run never interrupted, having resumed from the source the case calls for.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import typing as tp
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from hpcrun import rundir, slurm
from hpcrun.backend import prepare
from hpcrun.plan import plan
from hpcrun.recipe import load_recipe
from hpcrun.runtime import snapshot, snapshotfiles
from hpcrun.runtime.env import DistEnv, cpu_threads
from hpcrun.site import load_site
from tests.delayed_training import entrypoint_job
from tests.helpers import ROOT
from tests.runs import (
    STRATEGIES,
    baseline_weights,
    hpcrun,
    local_baseline,
    losses,
    recipe,
    rows,
    run_dir_of,
    session_dir,
    site_copy,
    state,
    wait_for,
)
from tests.test_cluster_faults import CHECKPOINT as CLUSTER_CHECKPOINT
from tests.test_cluster_faults import TRAINING as CLUSTER_TRAINING
from tests.test_fault_tolerance import alive, weights

pytestmark = pytest.mark.slow

WORLD, PER_NODE = 4, 2
# the cluster tests' training: DDP's and FSDP's uninterrupted runs at world 4 are theirs (local_baseline)
TRAINING = CLUSTER_TRAINING
STEP_DELAY_S = 0.4  # 12 s of training: time to see a snapshot on both nodes and kill before the end


def prepared(tmp: Path, name: str, delay: float, memory_interval: int, disk_interval: int, strategy: str) -> Path:
    partition = {"max_nodes": 1, "gpus_per_node": 0, "cpus_per_node": WORLD, "memory_gb": 16, "max_time": "1-00:00:00"}
    site = load_site(str(site_copy(tmp, partitions={"local": partition})))
    path = recipe(
        tmp, name, job=entrypoint_job(str(ROOT), delay), training=TRAINING,
        resources={"nodes": 1, "gpus_per_node": WORLD, "time": "00:10:00"}, strategy=STRATEGIES[strategy],
        checkpoint={"interval": disk_interval, "memory_interval": memory_interval, "export_final": True},
    )
    return prepare(plan(site, load_recipe(path).base, path, name))


def launch(
    run_dir: Path, nodes: list[Path], job_id: str, attempt: int = 0, world: int = WORLD
) -> list[subprocess.Popen[bytes]]:
    """One start of the training step: every rank as srun would start it, ranks 2k and 2k+1 on
    pretend node k; a restart inside the job keeps SLURM's job id and requeue count and raises
    hpcrun's attempt number (HPCRUN_ATTEMPT), as the batch script does. `world`: fewer ranks than
    planned, as after a shrink. Each rank has the intra-op threads of a baseline's rank (four on one
    node, tests/runs.py local_baseline): CPU sums differ in the last bit with the thread count."""
    procs = []
    for rank in range(world):
        env = {
            **os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank % PER_NODE), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(PER_NODE), "HPCRUN_LOCAL_JOB_ID": job_id, "HPCRUN_REQUEUES": "0",
            "HPCRUN_ATTEMPT": str(attempt), "OMP_NUM_THREADS": str(cpu_threads(WORLD)),
            rundir.SCRATCH_ENV: str(nodes[rank // PER_NODE]), "PYTHONPATH": str(ROOT),
        }
        with (run_dir / f"rank{rank}.log").open("ab") as log:
            procs.append(subprocess.Popen(["bash", str(run_dir / "script.sh")], env=env, stdout=log, stderr=log))
    return procs


def finished(procs: list[subprocess.Popen[bytes]], run_dir: Path) -> None:
    for proc in procs:
        assert proc.wait(timeout=300) == 0, (run_dir / "rank0.log").read_text()[-3000:]


def held(node: Path, job_id: str, run_id: str) -> dict[int, list[int]]:
    """The complete snapshot steps of each rank directory on `node`."""
    job_dir = rundir.snapshot_job_dir(node, job_id, 0)
    return {
        rank: sorted(s for s, p in rundir.step_dirs(path).items() if rundir.manifest(p).exists())
        for rank, path in rundir.snapshot_ranks(job_dir, run_id, slurm.node_name(os.environ)).items()
    }


def killed_after_snapshot(tmp: Path, name: str, disk_interval: int, strategy: str) -> tuple[Path, list[Path], str]:
    """A run started, SIGKILLed whole once both nodes hold every rank's snapshot of step >= 6
    (their own ranks' and the other node's replicas) and, with disk checkpoints due before step 6,
    one of them is complete (it is written on a thread, and may end after a later snapshot)."""
    run_dir = prepared(tmp, name, STEP_DELAY_S, 2, disk_interval, strategy)
    nodes = [tmp / "nodeA", tmp / "nodeB"]
    job_id = str(random.randint(1000, 11000))  # the local script's rendezvous port derives from it
    procs = launch(run_dir, nodes, job_id)

    def both_hold() -> bool:
        assert all(p.poll() is None for p in procs), "the training ended before it was killed"
        on_disk = disk_interval > 6 or any(
            rundir.manifest(step).exists() for step in rundir.step_dirs(run_dir / "checkpoints").values()
        )
        return on_disk and all(
            set(found) == set(range(WORLD)) and all(steps and steps[-1] >= 6 for steps in found.values())
            for found in (held(node, job_id, run_dir.name) for node in nodes)
        )

    wait_for(both_hold, what="snapshots of step 6 on both nodes", timeout=120)
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
    wait_for(lambda: not any(alive(p.pid) for p in procs), what="the kill")
    for proc in procs:
        proc.wait()
    return run_dir, nodes, job_id


def baseline(factory: pytest.TempPathFactory, strategy: str) -> Path:
    """The same training never interrupted, finished: once per strategy and test session. DDP's and
    FSDP's are the cluster tests' (tests/runs.py local_baseline: the same numbers on one node as on
    two pretend ones; in CI one run serves both pytest runs); ZeRO-Infinity's is trained here, on two
    pretend nodes, pytest-xdist's workers sharing it (a lock, and a file naming the finished run)."""
    if strategy != "zero3-nvme-offload":
        named = {} if strategy == "ddp" else {"strategy": STRATEGIES[strategy]}  # the cluster tests' DDP: the default
        run_dir = local_baseline(factory, WORLD, training=TRAINING, checkpoint=CLUSTER_CHECKPOINT, **named)
        baseline_weights(run_dir)
        return run_dir
    shared = session_dir(factory, "snapshot-baselines")
    done = shared / f"{strategy}.run"
    with FileLock(shared / f"{strategy}.lock"):
        if not done.exists():
            tmp = shared / strategy
            shutil.rmtree(tmp, ignore_errors=True)  # a failed try's
            tmp.mkdir()
            run_dir = prepared(tmp, "whole", 0.0, 0, 1000, strategy)
            finished(launch(run_dir, [tmp / "nodeA", tmp / "nodeB"], str(random.randint(1000, 11000))), run_dir)
            done.write_text(str(run_dir))
    return Path(done.read_text())


def resumed(tmp: Path, run_dir: Path, nodes: list[Path], job_id: str, baseline: Path) -> dict[str, tp.Any]:
    """Start the job again; it must finish with the baseline's weights and losses. Returns the row."""
    finished(launch(run_dir, nodes, job_id, attempt=1), run_dir)
    assert state(run_dir)["status"] == "completed", state(run_dir)
    assert weights(run_dir) == weights(baseline)
    assert losses(run_dir) == losses(baseline)
    assert not rundir.snapshot_job_dir(nodes[0], job_id, 0).exists(), "a finished run's snapshots are removed"
    (row,) = rows(tmp, run_dir).to_dict("records")
    return dict(row)


# the ddp case on the oldest torch too (CI's `-m oldest_torch`): its one restore from a snapshot (a replica,
# over gloo); local processes, no cluster: ~45 s on 2 loaded cores
@pytest.mark.parametrize(
    "strategy", [pytest.param("ddp", marks=[pytest.mark.oldest_torch, pytest.mark.oldest_only]), "fsdp"]
)
def test_lost_node_resumes_from_the_replica(
    strategy: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    run_dir, nodes, job_id = killed_after_snapshot(tmp_path, "lost", 1000, strategy)
    kept = max(held(nodes[0], job_id, run_dir.name)[2])  # what node A holds of node B's rank 2
    # DDP's ranks hold the same state: each node keeps one copy, its first rank's (0 and 2), and
    # so does the replica; FSDP's shards are every rank's own
    job_dir, host = rundir.snapshot_job_dir(nodes[0], job_id, 0), slurm.node_name(os.environ)
    engine_files = {
        rank: rundir.engine_state(
            rundir.step_dir(rundir.snapshot_rank_dir(job_dir, run_dir.name, host, rank), max(steps))
        ).exists()
        for rank, steps in held(nodes[0], job_id, run_dir.name).items()
    }
    assert engine_files == {r: strategy == "fsdp" or r % PER_NODE == 0 for r in range(WORLD)}, engine_files
    shutil.rmtree(nodes[1])  # node B is lost with its ranks' own snapshots
    row = resumed(tmp_path, run_dir, nodes, job_id, baseline(tmp_path_factory, strategy))
    assert row["resumed_from"] == "replica" and row["first_step"] == kept >= 6, row
    assert f"resumed from replica snapshot (step {kept})" in (run_dir / "rank0.log").read_text()


def test_a_torn_snapshot_is_never_used(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Rank 1's newest snapshot is truncated on its own node, and its replica on the other node
    has lost its manifest: no node has a whole copy, so that step is not used and the run resumes
    from the older disk checkpoint (every 5 steps), although every other rank's copies are intact."""
    run_dir, nodes, job_id = killed_after_snapshot(tmp_path, "torn", 5, "ddp")
    host = slurm.node_name(os.environ)
    own = rundir.snapshot_rank_dir(rundir.snapshot_job_dir(nodes[0], job_id, 0), run_dir.name, host, 1)
    replica = rundir.snapshot_rank_dir(rundir.snapshot_job_dir(nodes[1], job_id, 0), run_dir.name, host, 1)
    newest = max(held(nodes[0], job_id, run_dir.name)[1])
    data = max((p for p in rundir.step_dir(own, newest).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    rundir.manifest(rundir.step_dir(replica, newest)).unlink()
    disk = max(rundir.step_dirs(run_dir / "checkpoints"))
    # killed within a step of snapshot 6 on both nodes, 4 steps (1.6 s) before the disk's step 10
    assert newest > disk, f"the disk checkpoint ({disk}) is newer than the torn snapshot ({newest}) anyway"
    row = resumed(tmp_path, run_dir, nodes, job_id, baseline(tmp_path_factory, "ddp"))
    assert row["resumed_from"] == "disk" and row["first_step"] == disk, row
    assert "not used" in (run_dir / "rank1.log").read_text() + (run_dir / "rank0.log").read_text()


def test_a_step_written_by_two_attempts_is_never_mixed(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Rank 0's newest snapshot, both copies, says a later attempt wrote it (as when a restart
    wrote that step again on some ranks before it died): the other ranks' copies of the same step
    are another attempt's, so no attempt has the whole set and the run resumes from disk."""
    run_dir, nodes, job_id = killed_after_snapshot(tmp_path, "attempts", 5, "ddp")
    host = slurm.node_name(os.environ)
    newest = max(held(nodes[0], job_id, run_dir.name)[0])
    for node in nodes:
        rank_dir = rundir.snapshot_rank_dir(rundir.snapshot_job_dir(node, job_id, 0), run_dir.name, host, 0)
        path = rundir.manifest(rundir.step_dir(rank_dir, newest))
        manifest = json.loads(path.read_text())
        assert manifest["attempt"] == 0, manifest
        path.write_text(json.dumps({**manifest, "attempt": 3}))
    disk = max(rundir.step_dirs(run_dir / "checkpoints"))
    assert newest > disk, f"the disk checkpoint ({disk}) is newer than the snapshot ({newest}) anyway"
    row = resumed(tmp_path, run_dir, nodes, job_id, baseline(tmp_path_factory, "ddp"))
    assert row["resumed_from"] == "disk" and row["first_step"] == disk, row


def test_verify_refuses_what_differs_from_the_manifest(tmp_path: Path) -> None:
    step = tmp_path / "step"
    (step / "state").mkdir(parents=True)
    (step / "state" / "a").write_bytes(b"abc" * 100)
    (step / "b").write_bytes(b"x")
    snapshotfiles.publish(step, tmp_path / "done", step=1)
    done = tmp_path / "done"
    assert snapshotfiles.verify(done) is None
    (done / "state" / "a").write_bytes(b"abc" * 50)  # truncated
    assert "state/a" in (snapshotfiles.verify(done) or "")
    (done / "state" / "a").write_bytes(b"abc" * 100)
    (done / "c").write_bytes(b"")  # a file the manifest does not list
    assert "c" in (snapshotfiles.verify(done) or "")
    rundir.manifest(done).unlink()
    assert "missing" in (snapshotfiles.verify(done) or "")


# a snapshot of the tiny model (its write and the ranks' agreement) measured 0.03 s here paced, 0.2 s unpaced
# on 2 loaded cores, its buffers' allocation ~ms: 2 s between due snapshots leave each ~60 times what it takes
PACED_STEP_S = 1.0


@pytest.mark.oldest_torch
def test_local_run_with_snapshots_finishes_identically(tmp_path: Path) -> None:
    """`hpcrun submit --site local` with snapshots every 2 steps into the default scratch
    (/dev/shm): the same weights and losses as with none, none failed, and nothing left in
    /dev/shm. Both benchmark runs' rows say what the saves and snapshots cost: the wall clock over
    the timed steps holds those steps, every stall (one warm-up step: no save or snapshot before the
    wall clock starts) and nothing negative, and the share lost is the stalls'. With steps slower
    than a snapshot (the same training, paced: an entrypoint job, whose rows count no tokens) the
    cadence takes every snapshot due, none skipped."""
    site = site_copy(tmp_path)
    digests = {}
    for name, interval, paced in (("none", 0, False), ("every-2", 2, False), ("paced", 2, True)):
        job = {"job": entrypoint_job(str(ROOT), PACED_STEP_S)} if paced else {}
        path = recipe(
            tmp_path, name, training={"steps": 12, "micro_batch": 2, "seq_len": 32, "warmup_steps": 1},
            checkpoint={"interval": 5, "memory_interval": interval, "export_final": True}, **job,
        )
        run_dir = run_dir_of(hpcrun("submit", "--site", str(site), "--wait", str(path)))
        assert state(run_dir)["status"] == "completed", state(run_dir)
        digests[name] = (weights(run_dir), losses(run_dir))
        (row,) = rows(tmp_path, run_dir).to_dict("records")
        assert row["checkpoint_saves"] == 3 and row["checkpoint_stall_s"] > 0 and row["steps_timed"] == 11, row
        assert (row["snapshot_stall_s"] > 0) == (interval > 0), row
        if not paced:
            tokens = row["steps_timed"] * row["global_batch"] * row["seq_len"]
            wall_s, steps_s = tokens / row["wall_tokens_per_s"], tokens / row["tokens_per_s"]
            lost_s = row["checkpoint_stall_s"] + row["snapshot_stall_s"]
            assert row["wall_tokens_per_s"] < row["tokens_per_s"] and wall_s >= steps_s + lost_s - 1e-9, row
            assert row["recovery_overhead"] == pytest.approx(lost_s / wall_s, rel=1e-9), row
        job_id = json.loads((run_dir / "jobs.json").read_text())[-1]["job_id"]
        assert not rundir.snapshot_job_dir("/dev/shm", job_id, 0).exists()
        logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*_0_log.out"))
        taken = re.search(r"in-memory snapshots: (\d+) \(buffers allocated aside\), the first .*, (\d+) failed", logs)
        made = re.search(r"snapshots every 2 steps \(the recipe's\); (\d+) made([^;\n]*)", logs)
        if interval:
            # due at steps 2, 4, 6, 8 (10 saves to disk, 12 is the end): each taken or skipped, none failed
            assert taken and made, logs
            skipped = re.search(r", (\d+) skipped", made[2])
            counts = int(taken[1]), int(made[1]), int(skipped[1]) if skipped else 0, int(taken[2])
            assert counts[0] == counts[1] and counts[1] + counts[2] == 4 and counts[3] == 0, (counts, taken[0])
        if paced:  # the buffers, allocated after step 1, are ready within step 2, each snapshot within a step
            assert counts == (4, 4, 0, 0), (counts, taken[0], made[0])
    assert digests["none"] == digests["every-2"] == digests["paced"]


class HeldWrite:
    """An engine whose snapshot write waits until the test lets it go: a snapshot in flight
    (a large state still being written or replicated) for as long as the test wants."""

    replicated = False

    def __init__(self) -> None:
        self.writing, self.release = threading.Event(), threading.Event()

    def snapshot_state(self, keep: bool) -> dict[str, tp.Any]:
        return {}

    def write_snapshot(self, staged: dict[str, tp.Any], path: Path) -> None:
        self.writing.set()
        self.release.wait(60)


@pytest.mark.oldest_torch
def test_a_stop_abandons_the_snapshot_in_flight(tmp_path: Path) -> None:
    """A stop must fit in SLURM's KillWait, and a snapshot is of no use to a requeue (it resumes
    from disk): closing after a stop returns while the snapshot is still being written, and the
    snapshot is never published; its directories go."""
    env = DistEnv(0, 0, 1, torch.device("cpu"), "gloo", 0, "7", "localhost", "7")
    snaps = snapshot.Snapshots(tmp_path, "run", env, timeout_s=60, on_slurm=False)
    engine = HeldWrite()
    snaps.save(engine, 5, {"step": 5})
    assert engine.writing.wait(30), "the snapshot's background write never began"
    started = time.monotonic()
    snaps.close(abandon=True)
    assert time.monotonic() - started < 5, "the stop waited for the snapshot in flight"
    engine.release.set()
    wait_for(lambda: not snaps.busy, "the abandoned snapshot's thread", timeout=30)
    assert not snaps.job_dir.exists(), sorted(str(p) for p in snaps.job_dir.rglob("*"))


HUNG_PEER = """
import os, signal, sys, time
import torch, torch.distributed as dist
from pathlib import Path
from hpcrun.runtime import snapshot
from hpcrun.runtime.env import DistEnv

class Engine:
    replicated = False
    def snapshot_state(self, keep):
        return {}
    def write_snapshot(self, staged, path):
        Path(path).write_bytes(b"state")

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
env = DistEnv(rank, rank, 2, torch.device("cpu"), "gloo", 0, "7", "localhost", "7")
snaps = snapshot.Snapshots(Path(sys.argv[1]), "run", env, timeout_s=float(sys.argv[2]), on_slurm=False)
snaps.save(Engine(), 1, {"step": 1})
snaps.wait()  # both ranks agreed on step 1
dist.barrier()
if rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)  # hung, not dead: its sockets stay open
time.sleep(0.5)
snaps.save(Engine(), 2, {"step": 2})  # its agreement waits for rank 1
started = time.monotonic()
snaps.close(abandon=False)  # a completed run waits for the snapshot in flight
print(f"closed after {time.monotonic() - started:.1f} s", flush=True)
os._exit(0)
"""


@pytest.mark.oldest_torch
def test_a_hung_peer_holds_the_snapshot_no_longer_than_the_collective_timeout(tmp_path: Path) -> None:
    """The snapshots' own gloo group has the job's collective timeout (fault.collective_timeout_s),
    not torch's 30 minutes: with its peer SIGSTOPped, a rank waiting for its snapshot's agreement
    (the end of a completed run) goes on within that timeout, the snapshot reported failed."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + random.randrange(2000)),
           "PYTHONPATH": str(ROOT)}  # this checkout's hpcrun, whichever is installed
    script = tmp_path / "hung_peer.py"
    script.write_text(HUNG_PEER)
    procs = [
        subprocess.Popen([sys.executable, str(script), str(tmp_path / f"node{rank}"), "5"],
                         env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(2)
    ]
    try:
        out, err = procs[0].communicate(timeout=90)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode == 0, err[-3000:]
    waited = float(re.search(r"closed after ([\d.]+) s", out)[1])  # type: ignore[index]
    assert 3 <= waited < 2 * 5 + 3, (waited, err[-2000:])
    assert "snapshot of step 2 failed" in err, err[-2000:]


@pytest.mark.oldest_torch
def test_the_first_snapshot_copies_into_buffers_allocated_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first snapshot's host buffers are allocated on a thread of their own (pinning a GPU's
    15.6 GB held training ~4 s), the snapshots `busy` until then (what the schedule skips on), and
    the first snapshot copies into those very buffers: the weights and Adam's state alike. Before
    the optimizer has state (an fp16 run's skipped first step) nothing is taken, so it is not stepped."""
    from types import SimpleNamespace

    from hpcrun.runtime import checkpoint
    from hpcrun.runtime.engine import TorchEngine

    env = DistEnv(0, 0, 1, torch.device("cpu"), "gloo", 0, "7", "localhost", "7")
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 8))
    optimizer = torch.optim.Adam(model.parameters())
    recipe = SimpleNamespace(precision="fp32", training=SimpleNamespace(grad_accum=1))
    engine = TorchEngine(model, optimizer, tp.cast(tp.Any, recipe), env, model)
    snaps = snapshot.Snapshots(tmp_path, "run", env, timeout_s=60, on_slurm=False)
    allocated: list[str] = []
    allocate_like = checkpoint.allocate_like

    def observed(shapes: tp.Any, pinned: bool) -> tp.Any:  # hpcrun's own function, observed
        allocated.append(threading.current_thread().name)
        return allocate_like(shapes, pinned)

    monkeypatch.setattr(checkpoint, "allocate_like", observed)
    snaps.prepare(engine)  # no optimizer state yet: asked again later, the optimizer untouched
    assert snaps.prepare_pending and not optimizer.state and not allocated, (snaps.prepare_pending, optimizer.state)
    model(torch.randn(4, 512)).sum().backward()
    optimizer.step()
    snaps.prepare(engine)
    assert not snaps.prepare_pending
    wait_for(lambda: not snaps.busy, "the snapshot buffers' allocation", timeout=30)
    assert set(allocated) == {"hpcrun-snapshot-buffers"}, allocated  # once per tensor and container
    assert snaps.buffers is engine.snapshot_buffers and snaps.prepared  # one object: the engine's
    allocation = engine.snapshot_buffers._allocation  # noqa: SLF001
    assert allocation is not None
    prepared = allocation.result()
    staged = engine.snapshot_state()
    assert staged is not None
    assert staged["model"]["0.weight"].data_ptr() == prepared["model"]["0.weight"].data_ptr()
    assert torch.equal(staged["model"]["0.weight"], model[0].weight)
    exp_avg = staged["optim"]["state"]["0.weight"]["exp_avg"]
    assert exp_avg.data_ptr() == prepared["optim"]["state"]["0.weight"]["exp_avg"].data_ptr()
    snaps.save(engine, 1, {"step": 1})
    snaps.close(abandon=False)


WRITER = """
import sys, time
import torch
from pathlib import Path
from hpcrun.runtime import snapshot
from hpcrun.runtime.env import DistEnv

scratch, allocation, rank, release = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])

class HeldWrite:
    replicated = False
    def snapshot_state(self, keep):
        return {}
    def write_snapshot(self, staged, path):
        Path(path).mkdir(parents=True)
        (Path(path) / "shard").write_bytes(b"x" * (1 << 20))
        while not release.exists():
            time.sleep(0.05)

env = DistEnv(rank, rank, 1, torch.device("cpu"), "gloo", 0, allocation, "localhost", allocation)
snaps = snapshot.Snapshots(scratch, "run", env, timeout_s=60, on_slurm=False)
snaps.save(HeldWrite(), 8, {"step": 8})
snaps.wait()
"""


def writing(tmp: Path, scratch: Path, allocation: str, rank: int) -> tuple[subprocess.Popen[bytes], Path]:
    """A real rank process whose snapshot of step 8 is being written (its engine's shard is on the
    node, the write held until the returned release file exists). Returns it and that file."""
    script, release = tmp / "writer.py", tmp / f"release-{allocation}-{rank}"
    script.write_text(WRITER)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(scratch), allocation, str(rank), str(release)],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE,
    )
    job_dir = rundir.snapshot_job_dir(scratch, allocation, 0)
    tmp_step = rundir.partial_step_dir(rundir.snapshot_rank_dir(job_dir, "run", slurm.node_name(os.environ), rank), 8)

    def shard() -> bool:
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        return any(tmp_step.rglob("shard"))

    wait_for(shard, f"rank {rank}'s snapshot write", timeout=60)
    return proc, release


def local_env(rank: int, allocation: str, slurm_requeues: int = 0) -> DistEnv:
    return DistEnv(rank, rank, 1, torch.device("cpu"), "gloo", 0, allocation, "localhost", allocation, slurm_requeues)


def test_a_killed_attempts_partial_steps_are_removed_a_live_writers_kept(tmp_path: Path) -> None:
    """On a tight tmpfs the partial steps a killed attempt left make every later snapshot fail
    (ENOSPC): the next attempt's start on the node removes them, its own rank's and a replica's,
    and keeps the complete steps a restore reads and a live process's snapshot being written."""
    scratch, host = tmp_path / "node", slurm.node_name(os.environ)
    killed, _ = writing(tmp_path, scratch, "7", 0)
    killed.kill()
    killed.wait()
    live, release = writing(tmp_path, scratch, "7", 1)
    job_dir = rundir.snapshot_job_dir(scratch, "7", 0)
    own, live_dir, replica = (rundir.snapshot_rank_dir(job_dir, "run", host, rank) for rank in (0, 1, 2))
    complete = rundir.step_dir(own, 6)
    complete.mkdir()
    (complete / "state").write_bytes(b"s")
    # a replica the killed attempt was receiving (planted: no process ever held it)
    rundir.partial_step_dir(replica, 8).mkdir(parents=True)
    (rundir.partial_step_dir(replica, 8) / "state").write_bytes(b"r" * (1 << 20))
    try:
        snaps = snapshot.Snapshots(scratch, "run", local_env(0, "7"), timeout_s=60, on_slurm=False)
        assert rundir.partial_step_dirs(own) == [] and rundir.partial_step_dirs(replica) == []
        assert (complete / "state").exists()
        assert (rundir.partial_step_dir(live_dir, 8) / "trainer-rank00001.pt").exists(), "a live write was removed"
        release.touch()
        assert live.wait(timeout=60) == 0, live.communicate()[1].decode()[-2000:]
        assert rundir.manifest(rundir.step_dir(live_dir, 8)).exists()
        snaps.close(abandon=False)
    finally:
        release.touch()
        live.kill()
        live.wait()


def test_the_runs_snapshots_of_earlier_job_starts_are_removed(tmp_path: Path) -> None:
    """Snapshots never serve across job starts (a requeue or a new job resumes from disk): a start
    of run `run` removes the run's directories of earlier starts on its node, this job's before a
    requeue and another job's whose exit could not clear the node although SLURM may still list it,
    but not another run's, nor one a live process of the run is writing, nor its own start's."""
    scratch, host = tmp_path / "node", slurm.node_name(os.environ)

    def planted(allocation: str, start: int, run: str) -> Path:
        rank_dir = rundir.snapshot_rank_dir(rundir.snapshot_job_dir(scratch, allocation, start), run, host, 0)
        rundir.step_dir(rank_dir, 4).mkdir(parents=True)
        (rundir.step_dir(rank_dir, 4) / "state").write_bytes(b"s" * (1 << 20))  # planted: no process holds it
        return rank_dir

    requeued, other_job, other_run, current = (
        planted("7", 0, "run"), planted("5", 0, "run"), planted("5", 0, "other"), planted("7", 1, "run"),
    )
    live, release = writing(tmp_path, scratch, "6", 1)
    try:
        snaps = snapshot.Snapshots(scratch, "run", local_env(0, "7", slurm_requeues=1), timeout_s=60, on_slurm=False)
        assert not requeued.exists() and not rundir.snapshot_job_dir(scratch, "7", 0).exists()
        assert not other_job.exists() and not (rundir.snapshot_job_dir(scratch, "5", 0) / "run").exists()
        assert (rundir.step_dir(other_run, 4) / "state").exists()
        assert (rundir.step_dir(current, 4) / "state").exists()
        live_dir = rundir.snapshot_rank_dir(rundir.snapshot_job_dir(scratch, "6", 0), "run", host, 1)
        assert (rundir.partial_step_dir(live_dir, 8) / "trainer-rank00001.pt").exists(), "a live write was removed"
        snaps.close(abandon=False)
    finally:
        release.touch()
        live.kill()
        live.wait()


TWO_RANKS = """
import errno, os, sys, time
import torch, torch.distributed as dist
from pathlib import Path
from hpcrun import rundir
from hpcrun.runtime import snapshot
from hpcrun.runtime.env import DistEnv

tmp, case = Path(sys.argv[1]), sys.argv[2]
rank = int(os.environ["RANK"])
release = tmp / "release"

class Engine:
    replicated = False
    def __init__(self, fail=False, held=False):
        self.fail, self.held = fail, held
    def snapshot_state(self, keep):
        return {}
    def write_snapshot(self, staged, path):
        if self.fail:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        while self.held and not release.exists():
            time.sleep(0.05)
        Path(path).write_bytes(b"state" * 1000)

def until(predicate):
    deadline = time.monotonic() + 60
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.05)

dist.init_process_group("gloo", rank=rank, world_size=2)
env = DistEnv(rank, rank, 2, torch.device("cpu"), "gloo", 0, "7", "localhost", "7")
if case == "failed":  # one node: the ranks only agree, no copy is exchanged
    snaps = snapshot.Snapshots(tmp / "node", "run", env, timeout_s=30, on_slurm=False)
    snaps.save(Engine(fail=rank == 1), 1, {"step": 1})
    snaps.wait()
    snaps.save(Engine(), 2, {"step": 2})
    snaps.wait()
    print(f"failures={snaps.failures}", flush=True)
    snaps.close(abandon=False)
else:  # two nodes: rank 1 closes while it waits for rank 0's copy
    snaps = snapshot.Snapshots(tmp / f"node{rank}", "run", env, timeout_s=30, on_slurm=False)
    snaps.save(Engine(held=rank == 0), 1, {"step": 1})
    if rank == 1:
        until(lambda: rundir.step_dir(snaps.rank_dir(1), 1).exists())  # published: now sending and receiving
        time.sleep(1.0)
        snaps.close(abandon=True)
        release.touch()
        until(lambda: not snaps.busy)
        left = sorted(str(p) for p in snaps.job_dir.rglob("*")) if snaps.job_dir.exists() else []
        print(f"left={left}", flush=True)
    else:
        snaps.wait()
        snaps.close(abandon=False)
os._exit(0)
"""


def two_ranks(tmp: Path, case: str) -> list[tuple[str, str]]:
    """TWO_RANKS' `case` in two real rank processes (gloo); each one's stdout and stderr."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + random.randrange(2000)),
           "PYTHONPATH": str(ROOT)}
    script = tmp / "two_ranks.py"
    script.write_text(TWO_RANKS)
    procs = [
        subprocess.Popen([sys.executable, str(script), str(tmp), case], env={**env, "RANK": str(rank)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    return outputs


def test_a_snapshot_failed_on_any_rank_is_counted_and_said_on_rank_0s_output(tmp_path: Path) -> None:
    """Rank 1's snapshot write fails (ENOSPC: a full tmpfs): rank 0, whose summary line counts the
    failed snapshots and whose output is where a run is read, counts it and says it there, not
    only rank 1 on its stderr; the next snapshot, whole on both, counts nothing."""
    (out0, _), (out1, err1) = two_ranks(tmp_path, "failed")
    assert "failures=1" in out0 and "failures=1" in out1, (out0, out1)
    assert re.search(r"snapshot of step 1 failed on rank 1 \(rank 1: OSError: \[Errno 28\]", out0), out0
    assert "snapshot of step 1 failed: OSError" in err1, err1[-2000:]


def test_a_copy_arriving_after_close_creates_no_directory(tmp_path: Path) -> None:
    """Rank 1 closes its snapshots (a stop) while its peer's copy is still on its way: the copy
    is taken off the wire but written nowhere, and nothing of the job is left on rank 1's node."""
    (out0, _), (out1, _) = two_ranks(tmp_path, "race")
    assert "left=[]" in out1, out1
    assert not rundir.snapshot_job_dir(tmp_path / "node1", "7", 0).exists()
    assert "snapshot of step 1 failed on rank 1 (rank 1: abandoned" in out0, out0  # rank 1 holds no copy


# README "Training on through a lost node": a step's loss after a shrink within SHRINK_RTOL of the
# uninterrupted run's (measured 4e-8: fp32 sums in another order), every final weight within
# SHRINK_WTOL of its tensor's largest (measured 9e-4: Adam moves a weight whose gradient is noise-level
# by up to lr a step, whichever its sign); without the accumulation (a smaller batch) the loss parted by 0.5
SHRINK_RTOL, SHRINK_WTOL = 1e-5, 1e-2


def past_the_disk(
    tmp: Path, name: str, memory_interval: int, strategy: str
) -> tuple[Path, list[Path], str, list[subprocess.Popen[bytes]]]:
    """A run started on two pretend nodes, a few steps past its first disk checkpoint (step 5)."""
    run_dir = prepared(tmp, name, STEP_DELAY_S, memory_interval, 5, strategy)
    nodes = [tmp / "nodeA", tmp / "nodeB"]
    job_id = str(random.randint(1000, 11000))
    procs = launch(run_dir, nodes, job_id)
    checkpoints = run_dir / "checkpoints"
    wait_for(lambda: any(rundir.manifest(p).exists() for p in rundir.step_dirs(checkpoints).values()),
             what="the disk checkpoint of step 5", timeout=120)
    time.sleep(3 * STEP_DELAY_S)  # a few steps past it
    return run_dir, nodes, job_id, procs


def test_a_shrunk_job_trains_the_same_global_batch(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tier 0, then a shrink. Rank 3 alone SIGKILLed mid-run (DDP, no periodic snapshot, disk every 5
    steps): the three others see their collective fail, keep the state of their last completed step
    (one survivor per pretend node writes every rank's directory of it, the other adds its own
    losses) and exit. Then pretend node B is lost with its scratch: the restart runs ranks 0 and 1
    only (the job shrank to one node), each taking two of the four slices of every step by gradient
    accumulation, from the survivors' state (saved by four ranks, loaded by two), past the disk
    checkpoint. Every later step's loss and the final weights match the uninterrupted 4-rank run
    within SHRINK_RTOL and SHRINK_WTOL. (The survivors' restart at the same world size, bit-identical:
    tests/test_cluster_in_job.py.)"""
    run_dir, nodes, job_id, procs = past_the_disk(tmp_path, "shrink", 1000, "ddp")
    checkpoints = run_dir / "checkpoints"
    procs[3].send_signal(signal.SIGKILL)
    codes = [proc.wait(timeout=60) for proc in procs]  # the survivors end by themselves
    assert codes[3] == -signal.SIGKILL and all(code != 0 for code in codes[:3]), codes
    kept = {node.name: held(node, job_id, run_dir.name) for node in nodes}
    steps = {s for found in kept.values() for held_steps in found.values() for s in held_steps}
    assert len(steps) == 1 and all(set(found) == set(range(WORLD)) for found in kept.values()), kept
    (survived,) = steps
    assert survived > max(rundir.step_dirs(checkpoints)), f"the survivors' step {survived} is not past the disk's"
    logs = "".join((run_dir / f"rank{r}.log").read_text() for r in range(WORLD))
    assert logs.count(f"survivor's save: kept step {survived} for rank(s) 0, 1, 2, 3") == 2, logs[-3000:]
    assert f"step {survived} kept by another rank on this node, this rank's losses added" in logs, logs[-3000:]
    shutil.rmtree(nodes[1])
    finished(launch(run_dir, nodes, job_id, attempt=1, world=2), run_dir)
    assert state(run_dir)["status"] == "completed", state(run_dir)
    log = (run_dir / "rank0.log").read_text()
    assert "training on 2 of 4 ranks: the same global batch" in log, log[-3000:]
    same_training(tmp_path, run_dir, baseline(tmp_path_factory, "ddp"), survived)
    row = rows(tmp_path, run_dir).sort_values("attempt").iloc[-1]
    assert (row["world_size"], row["resumed_from"], row["first_step"]) == (2, "survivor", survived), row


def same_training(tmp: Path, run_dir: Path, whole: Path, since: int) -> None:
    """A shrunk run's losses from step `since` on and its final weights against the uninterrupted
    run's, within README's tolerances; every step's throughput in the per-step table counted in the
    planned global batch's tokens, the shrunk attempt's steps too."""
    from hpcrun.steps import load_steps

    table = load_steps(tmp / "results", run_id=run_dir.name)
    tokens = table.tokens_per_s * table.step_time_s / (WORLD * TRAINING["micro_batch"] * TRAINING["seq_len"])
    assert 1 in set(table.attempt) and ((tokens - 1).abs() < 1e-9).all(), table[["attempt", "step", "tokens_per_s"]]
    got, want = losses(run_dir), losses(whole)
    assert want[-1] < want[0] - 0.05, want  # the uninterrupted run trains (for ZeRO-Infinity, the only check of it)
    worst = max(abs(g - w) / abs(w) for g, w in zip(got[since:], want[since:]))
    mine = torch.load(rundir.RunDir(run_dir).final_weights, weights_only=True)
    theirs = torch.load(rundir.RunDir(whole).final_weights, weights_only=True)
    weights_off = max(((mine[k] - theirs[k]).abs().max() / theirs[k].abs().max()).item() for k in theirs)
    print(f"\n[shrink] from step {since}: largest relative loss difference {worst:.2e}, weights {weights_off:.2e}")
    assert len(got) == len(want) and worst <= SHRINK_RTOL and weights_off <= SHRINK_WTOL, (got, want, weights_off)


# ZeRO-2: tests/test_cluster_shrink.py, the same path on the cluster; ZeRO-Infinity (optimizer and weights on
# NVMe): plain ZeRO-3's conversion, hpcrun.runtime.zeroinfinity's load (the tiny model's partitions stay in
# memory, under DeepSpeed's swap minimum; the swapped ones' path was run by hand with the small model)
@pytest.mark.parametrize("strategy", ["fsdp", "zero3-nvme-offload"])
def test_a_shrunk_sharded_job_reshards_the_disk_checkpoint(
    strategy: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """FSDP (full shard) or ZeRO-Infinity (optimizer and weights on NVMe) loses pretend node B (ranks 2 and 3
    SIGKILLed, its scratch gone): its survivors keep nothing (a dead rank's shard of the last step is nowhere
    else), FSDP's periodic snapshots are shards of four ranks (DeepSpeed keeps none), so the restart resumes
    from the disk checkpoint, resharded (DCP; DeepSpeed's universal checkpoint), each rank reducing every
    micro-batch's gradients (FSDP: no full unsharded gradients held, sync_every; DeepSpeed always). On three
    ranks (rank 2 on a replacement for node B, its scratch empty): the four slices of a step are shared unevenly
    (2, 1, 1), so ranks 1 and 2 run one micro-batch of weight 0 (Context.padding) to join rank 0's second
    reduction; the same global batch, within README's tolerances."""
    run_dir, nodes, job_id, procs = past_the_disk(tmp_path, f"shrink-{strategy}", 2, strategy)
    checkpoints = run_dir / "checkpoints"
    for proc in procs[2:]:
        proc.send_signal(signal.SIGKILL)
    codes = [proc.wait(timeout=60) for proc in procs]
    assert codes[2:] == [-signal.SIGKILL] * 2 and all(code != 0 for code in codes[:2]), codes
    shutil.rmtree(nodes[1], ignore_errors=True)
    disk = max(s for s, p in rundir.step_dirs(checkpoints).items() if rundir.manifest(p).exists())
    finished(launch(run_dir, nodes, job_id, attempt=1, world=3), run_dir)
    assert state(run_dir)["status"] == "completed", state(run_dir)
    same_training(tmp_path, run_dir, baseline(tmp_path_factory, strategy), disk)
    row = rows(tmp_path, run_dir).sort_values("attempt").iloc[-1]
    assert (row["world_size"], row["resumed_from"], row["first_step"]) == (3, "disk", disk), row


class _Layout:
    nodes = ["a", "a"]

    def engine_rank(self, rank: int, engine: tp.Any) -> int:
        return 0


class _Engine:
    """An engine whose survivor's save writes one file, or fails (a CUDA error, a full tmpfs)."""

    def __init__(self, fails: bool) -> None:
        self.fails = fails

    def write_survivor(self, directory: Path, threads: int) -> None:
        if self.fails:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        directory.mkdir(parents=True)
        (directory / "state.distcp").write_bytes(b"weights")


def test_a_survivor_whose_save_fails_leaves_the_step_to_another(tmp_path: Path) -> None:
    """Rank 0 (the rank whose own error ended the attempt, first to claim its node's save) fails to
    write: its claim goes, and rank 1, which was waiting for it, writes the step for both ranks."""
    from hpcrun.runtime import snapshotsurvivor
    from hpcrun.runtime.snapshotdirs import RankDirs

    dirs = [RankDirs(tmp_path / "job", "run", "a") for _ in range(2)]
    state = {"step": 7, "rank_losses": [1.0, 2.0]}
    with pytest.raises(RuntimeError, match="CUDA error"):
        snapshotsurvivor.keep(dirs[0], _Layout(), _Engine(True), 0, 2, 0, "run", 7, state)
    assert not snapshotsurvivor.claim_file(dirs[0], 0, 7).exists()
    said = snapshotsurvivor.keep(dirs[1], _Layout(), _Engine(False), 1, 2, 0, "run", 7, state)
    assert said == "kept step 7 for rank(s) 0, 1 on this node", said
    for rank in (0, 1):
        step = rundir.step_dir(dirs[1].rank_dir(rank), 7)
        assert snapshotfiles.verify(step) is None and rundir.engine_state(step).exists() == (rank == 0)
