"""Goodput under a fault storm on the test cluster: one job of 2 nodes x 2 ranks (CPU, gloo) training
for about `--minutes` uninterrupted, hit by four faults spread over the run, in three arms:

  a  uninterrupted: the baseline, in the same run
  b  hpcrun's path inside the allocation: `fault.restarts_in_job` at hpcrun's default, a hot spare
     (`resources.spare_nodes: 1` on the pool's `spare` partition), and in-memory snapshots at
     hpcrun's default `checkpoint.memory_interval` where this hpcrun has them
  c  today's path: `fault.restarts_in_job: 0`, no spare, no snapshots; every failure goes through a
     SLURM requeue, a lost node through SLURM's NODE_FAIL and the requeue with exclusion (on the
     `spare` partition too, so excluding the lost node leaves two nodes)
  d  hpcrun's path without a spare (`--shrink`, an arm of its own pool): `fault.min_nodes: 1`, so the
     lost node shrinks the job to the one node left, the same global batch by gradient accumulation
     (its weights equal arm a's only up to floating-point order: README, "Training on through a lost node")

The faults, in this order, each when the training reaches its step:
  kill  SIGKILL to rank 3
  hang  SIGSTOP to rank 1 (no hang timeout set: hpcrun's defaults, the pulse ring, see it)
  node  every process of rank 3's node killed, slurmd included (`tests/faults.power_off`; never the
        first node, which holds the batch script), powered on again once the job resumed without it,
        or once it has pended for it 10 s past its requeue hold (a requeued job with a spare asks for
        N+K nodes again; a pool has none other to give: the row says "waited for the node")
  all   SIGKILL to every rank at once (the batch script alive)

Per fault and arm it prints the path hpcrun took (in job, requeue, NODE_FAIL requeue: the failed
attempt's results row), the detection time (fault -> no rank of the attempt left, and fault ->
the failed attempt's results row written, its `end_time`), fault -> first resumed step, and the
steps recomputed (the last step the faulted attempt reached minus the step the next one resumed
from); per arm the training's wall time (first step -> last step) and goodput = the uninterrupted
arm's wall time / the arm's. The same table goes to `--out` as JSON. The final weights (sha256)
of every arm are compared: each arm trains the same numbers.

Why these sizes: steps pause `STEP_DELAY_S` (tests/delayed_training.py's way: time-bounded steps,
~0.38 s with the tiny model's compute), so the run lasts its minutes on any CPU and a fault lands
mid-step as on a real cluster; a disk checkpoint every `INTERVAL` steps (~15 s) makes the steps a
rude fault loses (half an interval on average, ~8 s) as large as a restart's own cost, as on a real
cluster; each fault lands half an interval after a disk checkpoint, that average case (in-memory
snapshots, where arm b has them, fall elsewhere in their own interval).

Each arm is a process of its own driving its job (`--pools`: arms b, c, a take the pools in turn;
arms sharing a pool run one after the other, the others at once). Arms at once share this
machine's CPUs, the uninterrupted one included: their start-ups slow each other's steps a little.
Step times come from the job itself (rank 0 appends `attempt step time` to a file after each
step), not from the per-step table, which a killed rank 0 may not have flushed.

    python benchmarks/goodput.py --minutes 10 [--pools 0,1,2] [--out goodput.json]
    python benchmarks/goodput.py --minutes 10 --shrink --pools 0,1,2,3   # arm d too
    python benchmarks/goodput.py --minutes 10 --arms b,a --pools 0,1 --rounds 3   # arm b beside its baseline only
    python benchmarks/goodput.py --minutes 3   # a quick check
Needs tests/cluster/testcluster.sh up; pools 0-2 have the spare nodes arms b and c need.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import typing as tp
from pathlib import Path

import yaml
from scratch import ROOT, scratch, scratch_site  # benchmarks/scratch.py

STEP_DELAY_S = 0.35
STEP_S = 0.38  # the delay and the tiny model's compute on this machine's CPUs, to size `--minutes`
INTERVAL = 40
NODE_WAIT_S = 10  # a job pending this long past its requeue hold with a node down waits for that node
WORLD = 4
FAULTS = ("kill", "hang", "node", "all")
ARMS = {"a": "uninterrupted", "b": "in-job (restarts, spare)", "c": "requeue (today's path)",
        "d": "in-job, no spare (shrinks)"}
FAULTED = ("b", "c", "d")


def train(ctx: tp.Any) -> None:
    """The job's entrypoint (`goodput:train`): the built-in benchmark with a pause after each step,
    rank 0 appending `attempt step unix-time` to `args.progress` as each step ends."""
    from hpcrun.runtime.jobs import builtin_benchmark
    from hpcrun.sizes import SIZES

    delay = float(ctx.args["step_delay_s"])
    attempt = os.environ.get("HPCRUN_ATTEMPT", "0")
    with open(ctx.args["progress"], "a") if ctx.rank == 0 else open(os.devnull, "w") as log:

        def after(step: int) -> None:
            log.write(f"{attempt} {step + 1} {time.time():.3f}\n")
            log.flush()
            time.sleep(delay)

        builtin_benchmark(ctx, SIZES["tiny"], after_step=after)


def progress(path: Path) -> list[tuple[int, int, float]]:
    """(attempt, step, time) for every step rank 0 completed so far (a half-written last line skipped)."""
    lines = path.read_text().splitlines() if path.exists() else []
    out = []
    for line in lines:
        parts = line.split()
        if len(parts) == 3:
            out.append((int(parts[0]), int(parts[1]), float(parts[2])))
    return out


def has_snapshots() -> bool:
    """Whether this hpcrun's recipe has in-memory snapshots (`checkpoint.memory_interval`)."""
    from hpcrun.recipe import Checkpoint

    return "memory_interval" in Checkpoint.model_fields


def fault_steps(steps: int) -> list[int]:
    """Where each fault lands: spread over the run, half a checkpoint interval past a checkpoint."""
    return [max(1, (steps * (k + 1) // (len(FAULTS) + 1)) // INTERVAL) * INTERVAL + INTERVAL // 2
            for k in range(len(FAULTS))]


def recipe(arm: str, steps: int, tmp: Path, pool: int, restarts: int | None) -> dict[str, tp.Any]:
    suffix = str(pool) if pool else ""
    fault: dict[str, tp.Any] = {}  # detection at hpcrun's defaults: the pulse ring, the derived hang timeout
    checkpoint: dict[str, tp.Any] = {"interval": INTERVAL, "max_requeues": 4, "export_final": True}
    resources: dict[str, tp.Any] = {"nodes": 2, "gpus_per_node": 2, "time": "00:59:00", "partition": f"spare{suffix}"}
    if arm == "a":
        resources["partition"] = f"batch{suffix}"
    if arm == "b":
        resources["spare_nodes"] = 1
    if arm in ("b", "d"):  # hpcrun's defaults: in-memory snapshots and the survivors' state
        if restarts is not None:
            fault["restarts_in_job"] = restarts
    elif has_snapshots():
        checkpoint["memory_interval"] = 0  # today's path and its baseline: disk checkpoints only
    if arm == "c":
        fault["restarts_in_job"] = 0
    if arm == "d":
        resources["partition"] = f"batch{suffix}"
        fault["min_nodes"] = 1
    return {
        "name": f"goodput-{arm}",
        "job": {
            "kind": "entrypoint", "entrypoint": "goodput:train", "pythonpath": [str(ROOT / "benchmarks")],
            "args": {"step_delay_s": STEP_DELAY_S, "progress": str(tmp / "progress.txt")},
        },
        "resources": resources,
        "training": {"steps": steps, "lr": 0.003, "micro_batch": 2, "seq_len": 32},
        "checkpoint": checkpoint,
        "fault": fault,
    }


def wait(predicate: tp.Callable[[], tp.Any], what: str, timeout: float, every: float = 0.2) -> tp.Any:
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(every)
    raise SystemExit(f"goodput: timed out after {timeout:.0f} s waiting for {what}")


def sacct_records(job: str) -> list[str]:
    out = subprocess.run(["sacct", "-X", "-D", "-n", "-P", "-j", job, "-o", "State"], capture_output=True, text=True)
    return [line.split()[0] for line in out.stdout.split()] if out.stdout.strip() else []


def queue_state(job: str) -> tuple[str, str] | None:
    """The job's state and reason in the queue (`("PENDING", "BeginTime")`), None once it left."""
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], capture_output=True, text=True).stdout.split()
    return (out[0], out[1]) if len(out) >= 2 else None


def inject(fault: str, job: str, log: Path, at: int, powered_off: list[str],
           power_ons: list[threading.Thread], world: int = WORLD) -> dict[str, tp.Any]:
    """Wait for step `at` with every rank of the attempt alive (`world` of them: fewer once it shrank),
    inject `fault`, and time what follows. A node powered off is named in `powered_off` first, its
    power-on thread (named after it) in `power_ons`."""
    from tests import faults

    def attempt_at() -> int | None:  # the attempt (+1: 0 is an attempt) once it completed step `at`
        seen = progress(log)
        return seen[-1][0] + 1 if seen and seen[-1][1] >= at else None

    attempt = wait(attempt_at, f"step {at}", timeout=1800) - 1
    wait(lambda: faults.ranks_alive(job, world, attempt=attempt) == list(range(world)),
         f"every rank of attempt {attempt}", timeout=120)
    targets = {"kill": [world - 1], "hang": [1], "node": [world - 1], "all": list(range(world))}[fault]
    pids = [faults.rank_pid(job, rank, timeout=10, attempt=attempt) for rank in targets]
    node = pids[0][1]
    fault_at = time.time()
    if fault == "node":
        powered_off.append(node)
        faults.power_off(node)
    else:
        for pid, _ in pids:
            os.kill(pid, signal.SIGSTOP if fault == "hang" else signal.SIGKILL)
    wait(lambda: not faults.ranks_alive(job, WORLD, attempt=attempt), f"attempt {attempt}'s end", 600, every=0.1)
    ended = time.time() - fault_at
    waited_since: list[float] = []  # when the job was first seen pending for nodes (not the requeue hold)

    def resumed_or_power_on() -> tuple[int, int, float] | None:
        # a lost node comes back once the job resumed without it, or once the job waits for it: a
        # requeued job that asks for the node's place (a spare arm's N+K nodes) pends until then
        found = next((p for p in progress(log) if p[0] > attempt), None)
        if fault == "node" and not any(thread.name == node for thread in power_ons):
            pending = queue_state(job)
            if pending and pending[0] == "PENDING" and pending[1] != "BeginTime":
                waited_since.append(time.time())
            if found or (waited_since and time.time() - waited_since[0] > NODE_WAIT_S):
                power_ons.append(threading.Thread(target=faults.power_on, args=(node,), name=node, daemon=True))
                power_ons[-1].start()
        return found

    resumed = wait(resumed_or_power_on, "a resumed step", timeout=900, every=0.5)
    reached = max(p[1] for p in progress(log) if p[0] == attempt)
    return {
        "fault": fault, "node": node, "ranks": targets, "attempt": attempt, "fault_at": fault_at,
        "ended_s": round(ended, 1), "first_step_s": round(resumed[2] - fault_at, 1),
        "last_step": reached, "resumed_from": resumed[1] - 1, "recomputed": reached - (resumed[1] - 1),
        "job_waited_for_node": bool(waited_since) and fault == "node" and waited_since[0] + NODE_WAIT_S < resumed[2],
    }


def drive(arm: str, pool: int, steps: int, restarts: int | None, out: Path) -> None:
    """One arm on one pool (this process's environment names the pool for tests/faults)."""
    from hpcrun.results import load
    from tests import faults

    tmp = scratch(f"goodput-{arm}-", "/var/tmp")
    base = yaml.safe_load((ROOT / "sites" / "testcluster.yaml").read_text())
    suffix = str(pool) if pool else ""
    scratch_site(tmp, "testcluster", name=f"goodput-{arm}",
                 partitions={f"{name}{suffix}": value for name, value in base["partitions"].items()},
                 default_partition=f"batch{suffix}")
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe(arm, steps, tmp, pool, restarts)))
    done = subprocess.run(
        [sys.executable, "-m", "hpcrun.cli", "submit", "--site", str(tmp / "site.yaml"), str(tmp / "recipe.yaml")],
        cwd=ROOT, capture_output=True, text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"goodput: arm {arm}: hpcrun submit exited {done.returncode}\n{done.stdout}{done.stderr}")
    run_dir = Path(next(ln.split("run dir:")[1].strip() for ln in done.stdout.splitlines() if "run dir:" in ln))
    job = json.loads((run_dir / "jobs.json").read_text())[-1]["job_id"]
    log = tmp / "progress.txt"
    events: list[dict[str, tp.Any]] = []
    powered_off: list[str] = []
    power_ons: list[threading.Thread] = []
    try:
        world = WORLD
        for fault, at in zip(FAULTS, fault_steps(steps)) if arm != "a" else ():
            events.append(inject(fault, job, log, at, powered_off, power_ons, world))
            if arm == "d" and fault == "node":
                world //= 2  # on the one node left
            print(f"[{arm}] {fault}: {events[-1]}", file=sys.stderr, flush=True)

        def finished() -> dict[str, tp.Any] | None:
            state = json.loads((run_dir / "state.json").read_text()) if (run_dir / "state.json").exists() else {}
            # gone from the queue too: sacct then holds the job's last record (COMPLETED, not RUNNING)
            ended = state.get("status") in ("completed", "failed") and not str(state.get("reason")).endswith("requeued")
            return state if ended and queue_state(job) is None else None

        state = wait(finished, f"arm {arm}'s end", timeout=steps * STEP_S * 4 + 1200, every=2)
    except BaseException:  # the pool is shared: leave no job of ours running there
        subprocess.run(["scancel", job], check=False)
        raise
    finally:  # and no node of it off
        for node in powered_off:
            if not any(thread.name == node for thread in power_ons):
                faults.power_on(node)
        for thread in power_ons:
            thread.join(timeout=120)
    rows = load(tmp / "results", run_id=run_dir.name)
    for event in events:
        failed = rows[(rows.attempt == event["attempt"]) & (rows.status == "failed")]
        event["recorded_s"] = (
            round(failed.iloc[0]["end_time"].timestamp() - event["fault_at"], 1) if len(failed) else None
        )
        event["reason"] = failed.iloc[0]["reason"] if len(failed) else None
    seen = progress(log)
    last = max((p for p in seen if p[1] == steps), key=lambda p: p[2], default=None)
    weights = run_dir / "weights.sha256"
    out.write_text(json.dumps({
        "arm": arm, "pool": pool, "job_id": job, "status": state.get("status"), "reason": state.get("reason"),
        "restarts_in_job": state.get("restarts_in_job"), "sacct": sacct_records(job), "steps": steps,
        "wall_s": round(last[2] - seen[0][2], 1) if last and seen else None,
        "weights": weights.read_text().split()[0] if weights.exists() else None, "faults": events,
    }, indent=1, default=str))


def arm_env(pool: int, pools: int) -> dict[str, str]:
    """What makes tests/pool.py (and so tests/faults.py) name `pool`'s nodes in the arm's process."""
    return {**os.environ, "HPCRUN_CLUSTER_POOLS": str(pools), "PYTEST_XDIST_WORKER": f"gw{pool}"}


def run_round(args: argparse.Namespace, steps: int, tmp: Path, n: int) -> dict[str, dict[str, tp.Any]]:
    """Every arm once: arms on different pools at once, on the same pool one after the other."""
    pools = [int(p) for p in args.pools.split(",")]
    lanes: dict[int, list[str]] = {}
    arms = tuple(args.arms.split(",")) if args.arms else ("b", "c", "a", "d") if args.shrink else ("b", "c", "a")
    for i, arm in enumerate(arms):  # the faulted arms first: each on a pool of its own when there are two
        lanes.setdefault(pools[i % len(pools)], []).append(arm)
    failures: list[str] = []

    def lane(pool: int, arms: list[str]) -> None:
        for arm in arms:
            command = [sys.executable, __file__, "--arm", arm, "--pool", str(pool), "--steps", str(steps),
                       "--out", str(tmp / f"{arm}{n}.json")]
            if args.restarts_in_job is not None:
                command += ["--restarts-in-job", str(args.restarts_in_job)]
            code = subprocess.run(command, env=arm_env(pool, max(pools) + 1)).returncode
            if code != 0:
                failures.append(f"arm {arm} on pool {pool} exited {code}")

    threads = [threading.Thread(target=lane, args=item) for item in lanes.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise SystemExit("goodput: " + "; ".join(failures))
    print("arms by pool: " + "; ".join(f"pool {p}: {' then '.join(a)}" for p, a in lanes.items()), flush=True)
    return {arm: json.loads((tmp / f"{arm}{n}.json").read_text()) for arm in arms}


def path(reason: str | None) -> str:
    """How the failed attempt went on, from its results row's reason."""
    if not reason:
        return "-"
    for word, said in (("restarting in the job", "in job"), ("NODE_FAIL", "NODE_FAIL requeue"), ("requeue", "requeue")):
        if word in reason:
            return said
    return reason[:40]


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10, help="the uninterrupted run's length, about")
    parser.add_argument("--pools", default="0,1,2", help="test-cluster pools for the arms (0-2 have spare nodes)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--restarts-in-job", type=int, default=None, help="arm b's (default: hpcrun's)")
    parser.add_argument("--shrink", action="store_true", help="arm d too (a fourth pool: 0,1,2,3)")
    parser.add_argument("--arms", default="", help="the arms, faulted ones first (e.g. b,a: arm b beside its "
                        "baseline only, no other job restarting on the same CPUs); default b,c,a (and d with --shrink)")
    parser.add_argument("--out", type=Path, default=Path("goodput.json"))
    parser.add_argument("--arm", choices=sorted(ARMS), help=argparse.SUPPRESS)  # one arm's driver process
    parser.add_argument("--pool", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        sys.path.insert(0, str(ROOT))  # tests/faults.py, the fault helpers the tests use
        drive(args.arm, args.pool, args.steps, args.restarts_in_job, args.out)
        return
    if args.arms and ("a" not in args.arms.split(",") or not set(args.arms.split(",")) <= set(ARMS)):
        raise SystemExit(f"goodput: --arms: some of {','.join(ARMS)}, arm a among them (got {args.arms})")
    if not 3 <= args.minutes <= 30:  # 3: two checkpoint intervals between faults; 30: partitions allow an hour
        raise SystemExit(f"goodput: --minutes: between 3 and 30 (got {args.minutes})")
    steps = int(args.minutes * 60 / STEP_S)
    from hpcrun.recipe import Fault

    restarts = args.restarts_in_job if args.restarts_in_job is not None else Fault().restarts_in_job
    print(
        f"goodput: 2 nodes x 2 ranks (CPU, gloo), tiny model, {steps} steps pausing {STEP_DELAY_S} s, "
        f"checkpoint.interval {INTERVAL}, faults at steps {fault_steps(steps)}; arm b: restarts_in_job {restarts}, "
        f"spare_nodes 1, " + ("memory snapshots at hpcrun's default" if has_snapshots() else "no memory snapshots "
                              "(this hpcrun has none)") + f"; detection at hpcrun's defaults; {args.rounds} round(s)",
        flush=True,
    )
    tmp = scratch("goodput-", "/var/tmp")
    rounds = [run_round(args, steps, tmp, n) for n in range(args.rounds)]
    print("| round | fault | arm | path | fault -> no rank left | fault -> failure recorded | "
          "fault -> first resumed step | steps recomputed (reached - resumed from) |")
    print("|---|---|---|---|---|---|---|---|")
    for n, arms in enumerate(rounds):
        for k, fault in enumerate(FAULTS):
            for arm in (a for a in FAULTED if a in arms):
                e = arms[arm]["faults"][k]
                waited = " (waited for the node)" if e["job_waited_for_node"] else ""
                print(f"| {n} | {fault} | {arm} | {path(e['reason'])} | {seconds(e['ended_s'])} | "
                      f"{seconds(e['recorded_s'])} | {seconds(e['first_step_s'])}{waited} | "
                      f"{e['recomputed']} ({e['last_step']} - {e['resumed_from']}) |")
    print("| round | arm | wall time (first -> last step) | goodput | in-job restarts | sacct | weights = arm a's |")
    print("|---|---|---|---|---|---|---|")
    goodputs: dict[str, list[float]] = {arm: [] for arm in FAULTED}
    for n, arms in enumerate(rounds):
        base = arms["a"]
        for arm in arms:
            r = arms[arm]
            ratio = base["wall_s"] / r["wall_s"] if base["wall_s"] and r["wall_s"] else None
            if ratio is not None and arm in goodputs:
                goodputs[arm].append(ratio)
            print(f"| {n} | {arm} {ARMS[arm]} | {seconds(r['wall_s'])} | {'-' if ratio is None else f'{ratio:.3f}'} | "
                  f"{r['restarts_in_job'] or 0} | {','.join(r['sacct'])} | "
                  f"{'yes' if r['weights'] and r['weights'] == base['weights'] else 'n/a' if arm == 'd' else 'NO'} |")
    for arm, values in goodputs.items():
        if values:
            print(f"goodput {arm} ({ARMS[arm]}): median {statistics.median(values):.3f} over {len(values)} round(s), "
                  f"spread {min(values):.3f}-{max(values):.3f}")
    args.out.write_text(json.dumps({"steps": steps, "step_delay_s": STEP_DELAY_S, "interval": INTERVAL,
                                    "restarts_in_job": restarts, "snapshots": has_snapshots(), "rounds": rounds},
                                   indent=1))
    print(f"table: {args.out}")


if __name__ == "__main__":
    main()
