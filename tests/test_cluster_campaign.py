"""Scale on the real controller: a 1,200-point sweep on the test cluster's `scale` partition (the
upper half of an 8-node cluster, `testcluster.sh up --nodes 8`), held by SLURM as job arrays,
watched by ten `hpcrun status --wait` processes whose RPCs SLURM itself counts (per user: the
watchers run as the unprivileged `hpcwatch`) and which together ask no more than one poller may,
partly run, resubmitted (nothing new), and cancelled whole; a sweep past a user's MaxSubmitJobs,
deferred and finished by later runs; a QOS's per-user cap taken before the association's.

CI runs this file apart from the other cluster tests, at the same time (they use the lower half)."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
import typing as tp
import uuid
from pathlib import Path

import pytest
import yaml

from hpcrun import pollcache
from tests.helpers import ROOT
from tests.runs import baseline_weights, hpcrun, local_baseline, recipe, rows, run_dir_of, scale_site
from tests.slurmstats import WATCHER, hpcrun_as, rpc_counts, run_as
from tests.test_cluster_faults import CHECKPOINT, PAUSED, TRAINING, records, wait_checkpoint, wait_done

pytestmark = [pytest.mark.cluster, pytest.mark.scale, pytest.mark.slow]

POINTS = 1200  # past MaxArraySize (1001): two arrays
WATCH_S = 30.0  # the polling phase: at most (its measured length) / POLL_S + 1 scheduler answers


@pytest.fixture(scope="module")
def base() -> tp.Iterator[Path]:
    """A directory the watcher user can read (pytest's own are private to root), removed after."""
    nodes = subprocess.run(
        ["sinfo", "-h", "-p", "scale", "-N", "-o", "%N"], capture_output=True, text=True
    ).stdout.split()
    assert len(set(nodes)) >= 4, (
        f"needs the `scale` partition of tests/cluster/testcluster.sh up --nodes 8 (found {nodes})"
    )
    path = Path("/var/tmp") / f"hpcrun-scale-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def watcher_env(home: Path, cache: str) -> dict[str, str]:
    """The watcher user's environment: its home, and `cache` for the shared scheduler answers."""
    return {**os.environ, "HOME": str(home), "HPCRUN_CACHE_DIR": str(home / cache), "PYTHONPATH": str(ROOT)}


def watchers(site: Path, sweep: str, count: int, home: Path) -> tuple[tuple[int, int], float]:
    """RPCs of `count` concurrent `hpcrun status --wait SWEEP` processes (as the watcher user)
    over WATCH_S seconds, counted once all of them are polling, and the seconds between the two
    readings of the counters (WATCH_S and the readings themselves: seconds under CI's load)."""
    env = watcher_env(home, "cache")
    cmd = [*hpcrun_as(WATCHER), "status", "--site", str(site), "--wait", sweep]
    logs = [home / f"watcher-{count}-{i}.log" for i in range(count)]
    procs = []
    for log in logs:
        with log.open("w") as out:
            # Ctrl-C as at a terminal: a pytest run in the background (CI) has SIGINT ignored,
            # and its children would inherit that
            procs.append(subprocess.Popen(cmd, env=env, cwd=home, stdout=out, stderr=subprocess.STDOUT, text=True,
                                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)))
    try:
        deadline = time.time() + 120
        while not all(log.stat().st_size for log in logs):  # each has printed its first states: it polls
            assert time.time() < deadline and all(p.poll() is None for p in procs), told(procs, logs)
            time.sleep(0.5)
        began = time.monotonic()
        before = rpc_counts(WATCHER)
        time.sleep(WATCH_S)
        after = rpc_counts(WATCHER)
        window = time.monotonic() - began
        assert all(p.poll() is None for p in procs), told(procs, logs)  # still following, none died
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)  # Ctrl-C: stops following, never the jobs
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()  # never left polling after the test
                p.wait()
    assert all(p.returncode == 130 for p in procs), told(procs, logs)
    return (after[0] - before[0], after[1] - before[1]), window


def told(procs: list[subprocess.Popen[str]], logs: list[Path]) -> str:
    """Short enough for CI's excerpt of a failure: each watcher's exit status (None: running) and
    the last line it printed."""
    last = [(log.read_text(errors="replace").strip().splitlines() or [""])[-1] for log in logs]
    return "; ".join(f"watcher {i}: exit {p.poll()}, last line {ln!r}" for i, (p, ln) in enumerate(zip(procs, last)))


def one_poll(site: Path, sweep: str, home: Path) -> tuple[int, int]:
    """RPCs of one `hpcrun status SWEEP` (no --wait) with no shared answer to read: what a poll costs."""
    before = rpc_counts(WATCHER)
    out = subprocess.run(
        [*hpcrun_as(WATCHER), "status", "--site", str(site), sweep],
        env=watcher_env(home, "cache-one-poll"),
        cwd=home,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    after = rpc_counts(WATCHER)
    return after[0] - before[0], after[1] - before[1]


def held_tasks(arrays: set[str]) -> collections.Counter[str]:
    """Every array task SLURM holds (pending, running or ended but still in memory), by id."""
    out = subprocess.run(
        ["squeue", "-h", "-r", "-t", "all", "-j", ",".join(sorted(arrays)), "-o", "%i"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return collections.Counter(out.split())


def test_a_campaign_on_the_real_controller(base: Path) -> None:
    site = scale_site(base)
    recipe = base / "campaign.yaml"
    recipe.write_text(yaml.safe_dump({
        # one task per array at a time, 20 s each: a few complete during the test, and starting
        # them (a Python process each) costs the CI machine little
        "name": "campaign", "job": {"kind": "command", "command": ["sleep", "20"]},
        "resources": {"nodes": 1, "gpus_per_node": 1, "time": "00:05:00"},
        "sweep": {"axes": {"training.seed": list(range(POINTS))}, "max_concurrent": 1},
    }))
    began = time.monotonic()
    out = hpcrun("sweep", "--site", str(site), str(recipe)).stdout
    submitted_in = time.monotonic() - began
    assert f"submitted {POINTS} point(s)" in out, out[-2000:]
    assert out.count("  array 0-1000%1:") == 1 and out.count("  array 0-198%1:") == 1, out[-2000:]
    sweep_dir = next((base / "runs" / "sweeps").iterdir())
    ledger = json.loads((sweep_dir / "ledger.json").read_text())["points"]
    jobs = [e["job_id"] for e in ledger.values()]
    arrays = {j.split("_")[0] for j in jobs}
    assert len(jobs) == POINTS and len(arrays) == 2  # one sbatch call per array chunk
    try:
        held = held_tasks(arrays)
        assert sorted(held) == sorted(jobs) and set(held.values()) == {1}, "a point held twice or not at all"
        print(f"hpcrun sweep of {POINTS} points: {submitted_in:.1f} s")
        watched_resubmitted_cancelled(site, recipe, base, sweep_dir, arrays)
    finally:  # a failed check must not leave 1,200 jobs queued beside the other tests
        subprocess.run(["scancel", *sorted(arrays)], capture_output=True)


def watched_resubmitted_cancelled(site: Path, recipe: Path, base: Path, sweep_dir: Path, arrays: set[str]) -> None:
    """Ten watchers (RPCs by SLURM's counters), a subset run, a second sweep that submits
    nothing, and one `hpcrun cancel` that leaves nothing queued."""
    home = base / "watcher"
    home.mkdir()
    shutil.chown(home, WATCHER)
    poll = one_poll(site, sweep_dir.name, home)
    assert poll[1] > 0, "a poll never asked slurmdbd: the count is not of it"
    ten, window = watchers(site, sweep_dir.name, 10, home)
    # The bound is what ONE poller may ask in the window (never twice within POLL_S), not a
    # one-watcher phase measured beside it: under load a lone watcher asks less often (a slow
    # answer defers the next, pollcache.SLOW_FACTOR), and the ratio of two such phases was seen
    # failing at 9 RPCs against 15. Ten watchers each asking for themselves would make ~10 times this.
    most = int(window / pollcache.POLL_S) + 1
    print(
        f"RPCs (slurmctld, slurmdbd): one poll {poll}; 10 watchers over {window:.0f} s {ten}, "
        f"at most {most} polls' worth"
    )
    assert ten[0] <= poll[0] * most and ten[1] <= poll[1] * most, (poll, ten)

    # A subset runs to its end meanwhile. Waited for, not read once: under CI's load SLURM was
    # seen starting the second array's first task late, one task completed 60 s in.
    deadline = time.time() + 120
    while (states := subprocess.run(["sacct", "-X", "-n", "-P", "-j", ",".join(sorted(arrays)), "-o", "JobID,State"],
                                    capture_output=True, text=True, check=True).stdout).count("|COMPLETED") < 2:
        assert time.time() < deadline, states[:2000]
        time.sleep(2)
    again = hpcrun("sweep", "--site", str(site), str(recipe)).stdout
    assert f"submitted 0 point(s); {POINTS} already submitted" in again, again[-2000:]
    assert {j.split("_")[0] for j in held_tasks(arrays)} == arrays  # no new array: still the two
    hpcrun("cancel", "--site", str(site), sweep_dir.name)
    # a running task ends through its SIGTERM, KillWait (20 s) and slurmd's answer, late under load
    deadline = time.time() + 120
    while subprocess.run(
        ["squeue", "-h", "-r", "-j", ",".join(sorted(arrays))], capture_output=True, text=True
    ).stdout.strip():
        assert time.time() < deadline, "jobs still queued 120 s after hpcrun cancel"
        time.sleep(1)


QUOTA, CAP = "hpcquota", 25  # tests/cluster/testcluster.sh: this user's MaxSubmitJobs, enforced


def as_quota(home: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    # USER and LOGNAME still root's, as setpriv leaves them: SLURM goes by the uid
    env = {
        **os.environ,
        "HOME": str(home),
        "HPCRUN_CACHE_DIR": str(home / "cache"),
        "PYTHONPATH": str(ROOT),
        "USER": "root",
        "LOGNAME": "root",
    }
    out = subprocess.run([*hpcrun_as(QUOTA), *args], env=env, cwd=home, capture_output=True, text=True, timeout=300)
    assert not check or out.returncode == 0, (
        f"hpcrun {' '.join(args)} as {QUOTA}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    )
    return out


def queued(user: str, field: str = "%i") -> list[str]:
    """The jobs (array tasks one by one) SLURM holds for `user`, pending or running: their ids,
    or squeue's `field` of each."""
    return subprocess.run(
        ["squeue", "-h", "-r", "-u", user, "-o", field], capture_output=True, text=True, check=True
    ).stdout.split()


@contextlib.contextmanager
def quota_jobs_queue_only() -> tp.Iterator[None]:
    """None of QUOTA's jobs starts and leaves the queue while a test counts them (the scale
    partition queues, never runs), and none is left before or after."""
    subprocess.run(["scontrol", "update", "PartitionName=scale", "State=DOWN"], check=True)
    try:
        subprocess.run(["scancel", "-u", QUOTA], check=True)  # what a run of these tests killed halfway left
        wait = time.time() + 60
        while queued(QUOTA):
            assert time.time() < wait, f"{QUOTA}'s earlier jobs still queued: {queued(QUOTA)}"
            time.sleep(1)
        yield
    finally:
        subprocess.run(["scancel", "-u", QUOTA], capture_output=True)
        subprocess.run(["scontrol", "update", "PartitionName=scale", "State=UP"], check=True)


def quota_sweep(home: Path, name: str, points: int, **site_changes: tp.Any) -> tuple[Path, Path]:
    """(site, recipe) in `home`, a directory of QUOTA's: a sweep of `points` jobs that sleep."""
    home.mkdir()
    shutil.chown(home, QUOTA)
    rec = home / f"{name}.yaml"
    rec.write_text(yaml.safe_dump({
        "name": name, "job": {"kind": "command", "command": ["sleep", "300"]},
        "resources": {"nodes": 1, "gpus_per_node": 1, "time": "00:10:00"},
        "sweep": {"axes": {"training.seed": list(range(points))}},
    }))
    return scale_site(home, **site_changes), rec


def test_a_sweep_past_max_submit_jobs_is_deferred_then_submitted(base: Path) -> None:
    """A 30-point sweep by a user SLURM lets hold 25 jobs: hpcrun submits 25 and defers 5 (one
    more job is refused by slurmctld: the cap is real), a second run with no headroom submits
    nothing, and once 5 of them have left the queue the next run submits the 5 deferred."""
    home = base / "quota"
    site, rec = quota_sweep(home, "quota", CAP + 5)
    with quota_jobs_queue_only():
        first = as_quota(home, "sweep", "--site", str(site), str(rec)).stdout
        assert f"submitted {CAP} point(s); 0 already submitted" in first and first.count("  deferred ") == 5, first
        assert f"no room under association {QUOTA}/quota's MaxSubmitJobs ({CAP}; 0 held)" in first, first
        sweep_dir = next((home / "runs" / "sweeps").iterdir())
        jobs = sorted(e["job_id"] for e in json.loads((sweep_dir / "ledger.json").read_text())["points"].values())
        assert sorted(queued(QUOTA)) == jobs and len(jobs) == CAP
        extra = subprocess.run([*run_as(QUOTA), "sbatch", "-p", "scale", "-o", "/dev/null", "--wrap", "true"],
                               capture_output=True, text=True, cwd=home)
        assert extra.returncode != 0 and "limit" in extra.stderr.lower(), (
            extra.stdout,
            extra.stderr,
            "a slurmctld started before AccountingStorageEnforce was set needs a restart",
        )  # SLURM enforces the cap

        second = as_quota(home, "sweep", "--site", str(site), str(rec)).stdout
        assert f"submitted 0 point(s); {CAP} already submitted" in second and second.count("  deferred ") == 5, second

        subprocess.run(["scancel", *jobs[-5:]], check=True)
        wait = time.time() + 60
        while len(queued(QUOTA)) > CAP - 5:
            assert time.time() < wait, queued(QUOTA)
            time.sleep(1)
        third = as_quota(home, "sweep", "--site", str(site), str(rec)).stdout
        assert f"submitted 5 point(s); {CAP} already submitted" in third and "  deferred " not in third, third
        ledger = json.loads((sweep_dir / "ledger.json").read_text())["points"]
        assert len(ledger) == CAP + 5 and len(queued(QUOTA)) == CAP

        as_quota(home, "cancel", "--site", str(site), sweep_dir.name)
        wait = time.time() + 60
        while queued(QUOTA):
            assert time.time() < wait, f"still queued after hpcrun cancel: {queued(QUOTA)}"
            time.sleep(1)


def test_a_qos_cap_binds_before_the_association(base: Path) -> None:
    """SLURM takes MaxSubmitJobs from the job's QOS before the association (QUOTA's holds 25):
    in QOS `capped` (10 per user) a 12-point sweep submits 10 and defers 2, and SLURM refuses an
    11th job in it; in QOS `wide` (30 per user) a 28-point sweep submits all 28, past the
    association's 25 (tests/cluster/testcluster.sh makes both QOS)."""
    with quota_jobs_queue_only():
        home = base / "qos-capped"
        site, rec = quota_sweep(home, "capped", 12, qos="capped")
        out = as_quota(home, "sweep", "--site", str(site), str(rec)).stdout
        assert "submitted 10 point(s); 0 already submitted" in out and out.count("  deferred ") == 2, out
        assert "no room under QOS capped's MaxSubmitJobsPerUser (10; 0 held)" in out, out
        held = queued(QUOTA, "%q")
        assert held == ["capped"] * 10, held
        extra = subprocess.run(
            [*run_as(QUOTA), "sbatch", "-p", "scale", "--qos", "capped", "-o", "/dev/null", "--wrap", "true"],
            capture_output=True,
            text=True,
            cwd=home,
        )
        assert extra.returncode != 0 and "QOSMaxSubmitJobPerUserLimit" in extra.stderr, (
            extra.stdout,
            extra.stderr,
        )  # SLURM's cap, real

        home = base / "qos-wide"
        site, rec = quota_sweep(home, "wide", CAP + 3, qos="wide")
        out = as_quota(home, "sweep", "--site", str(site), str(rec)).stdout
        assert f"submitted {CAP + 3} point(s); 0 already submitted" in out and "  deferred " not in out, out
        assert len(queued(QUOTA)) == 10 + CAP + 3


def test_four_nodes_train_and_resume_bit_identical(base: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The built-in benchmark on 4 nodes, one rank per node, over the nodes' interface (rendezvous
    on the first node of the compressed node list), cut by USR2, requeued and resumed on all four:
    the same weights as an uninterrupted 4-rank run."""
    baseline = local_baseline(tmp_path_factory, 4, training=TRAINING, checkpoint=CHECKPOINT)
    site = scale_site(base)
    # one intra-op thread per rank, as the 4 ranks of the local baseline on this machine's cores
    # get: a rank alone on a 2-CPU node would take 2, and a matrix product summed by 2 threads
    # differs in its last bits (seen: the same sha256 interrupted or not on 4 nodes, another
    # than the local run's from step 4 on)
    rec = recipe(
        base,
        "four-nodes",
        job=PAUSED,
        training=TRAINING,
        checkpoint=CHECKPOINT,
        resources={"nodes": 4, "gpus_per_node": 1, "time": "00:10:00"},
        env={"OMP_NUM_THREADS": "1"},
    )
    run_dir = run_dir_of(hpcrun("submit", "--site", str(site), str(rec)))
    job = json.loads((run_dir / "jobs.json").read_text())[-1]["job_id"]
    wait_checkpoint(run_dir)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    final = wait_done(run_dir, timeout=300)
    assert final["status"] == "completed" and final["attempt"] == 1, final
    assert records(job) == ["REQUEUED", "COMPLETED"], records(job)
    table = rows(base, run_dir)
    assert list(table.world_size) == [4, 4] and set(table.nodes) == {4}, table[["world_size", "nodes", "node_list"]]
    node_list = table.node_list.iloc[0]
    assert re.fullmatch(r"node\[\d+-\d+\]", node_list) and set(table.node_list) == {node_list}, (
        table.node_list
    )  # compressed, the same four
    first = subprocess.run(
        ["scontrol", "show", "hostnames", node_list], capture_output=True, text=True, check=True
    ).stdout.split()[0]
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("*_log.*"))
    assert "resumed from disk checkpoint" in logs
    assert (run_dir / "weights.sha256").read_text() == baseline_weights(baseline)
    print(f"4 nodes {node_list} (MASTER_ADDR: the first, {first}, from the rendered script)")
