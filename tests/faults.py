"""Real faults on the test cluster (tests/cluster/testcluster.sh): kill or stop one rank of a
running job, power a node off (every process in its network namespace, slurmd included) and
back on. Each node is a network namespace, so `ip netns pids NODE` is everything on it.

Also the entrypoint of a job that always crashes at the same step (`crash_entrypoint_job`)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
import typing as tp
from pathlib import Path

from hpcrun.rundir import MANIFEST, STEP, snapshot_job_name
from tests import pool

NODES = pool.nodes()
SPARE = pool.spare_node()
TESTCLUSTER = Path(__file__).parent / "cluster" / "testcluster.sh"


def node_pids(node: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True, check=True).stdout
    return [int(p) for p in out.split()]


def node_scratch(node: str, scratch: Path) -> Path | None:
    """The node-local scratch of `node` as its slurmd sees it (the node's tmpfs lives in its
    mount namespace: /proc/PID/root); None for a node that is off."""
    for pid in node_pids(node):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_bytes().strip() == b"slurmd":
                return Path(f"/proc/{pid}/root") / scratch.relative_to("/")
    return None


def snapshot_dirs(node: str, allocation_id: str, scratch: Path, start: int | str = "*") -> list[str]:
    """The job's in-memory snapshot directories (hpcrun.rundir.snapshot_job_name) on `node`: of
    every start of the job, or of one (0: the first; SLURM's requeue count)."""
    where = node_scratch(node, scratch)
    return [] if where is None else sorted(p.name for p in where.glob(snapshot_job_name(allocation_id, start)))


def snapshots_complete(node: str, allocation_id: str, scratch: Path, start: int = 0) -> list[str]:
    """The complete in-memory snapshots (a step's directory with its manifest) `node` holds of the
    job's start `start`, its own ranks' and its replicas, as `<run>/<node>/rank-N/step-M`."""
    where = node_scratch(node, scratch)
    if where is None:
        return []
    job_dir = where / snapshot_job_name(allocation_id, start)
    return sorted(str(m.parent.relative_to(job_dir)) for m in job_dir.glob(f"*/*/rank-*/{STEP}*/{MANIFEST}"))


def job_pids(allocation_id: str, nodes: tp.Sequence[str] = ()) -> list[int]:
    """Every process of job `allocation_id` on `nodes` (default: the pool's and its spare): its
    batch shell, its steps' tasks and what they started (SLURM_JOB_ID in their environment)."""
    return [pid for node in nodes or NODES + ((SPARE,) if SPARE else ()) for pid in node_pids(node)
            if environ(pid).get("SLURM_JOB_ID") == allocation_id]


def commands(pids: tp.Iterable[int]) -> str:
    """Each of `pids` with its parent, the job start it belongs to (SLURM_RESTART_COUNT) and its
    command line, for a failure's message."""
    def line(pid: int) -> str:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
            ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            return f"{pid}: (gone)"
        return f"{pid} (parent {ppid}, start {environ(pid).get('SLURM_RESTART_COUNT', '0')}): {cmd}"
    return "; ".join(line(pid) for pid in pids)


def environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def rank_pid(
    allocation_id: str, rank: int, timeout: float = 60, attempt: int | None = None, nodes: tp.Sequence[str] = ()
) -> tuple[int, str]:
    """The pid of `rank`'s task (python -m hpcrun.launch) in job `allocation_id` (of hpcrun's
    `attempt` number, when given), and its node (the network namespace it runs in), looked for on
    `nodes` (default: the pool's and its spare). Looks at least once (timeout=0: one look), then
    until `timeout` s have passed."""
    deadline = time.time() + timeout
    while True:
        for node in nodes or NODES + ((SPARE,) if SPARE else ()):
            for pid in node_pids(node):
                env = environ(pid)
                if attempt is not None and env.get("HPCRUN_ATTEMPT") != str(attempt):
                    continue
                if env.get("SLURM_JOB_ID") == allocation_id and env.get("SLURM_PROCID") == str(rank):
                    try:
                        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                    except OSError:
                        continue
                    if b"hpcrun.launch" in cmd and not standing_by(pid, env):
                        return pid, node
        if time.time() >= deadline:
            break
        time.sleep(0.5)
    raise AssertionError(f"no task of rank {rank} of job {allocation_id} on {list(nodes) or NODES}")


def standing_by(pid: int, env: dict[str, str]) -> bool:
    """A warm standby not (yet) told to become its attempt (hpcrun.runtime.standby): still reading the
    batch script's pipe, where a rank's stdin is /dev/null."""
    if not env.get("HPCRUN_STANDBY"):
        return False
    try:
        return os.readlink(f"/proc/{pid}/fd/0") != os.devnull
    except OSError:
        return False


def ranks_alive(allocation_id: str, world: int, attempt: int | None = None) -> list[int]:
    """The ranks of job `allocation_id` (of hpcrun's `attempt` number, when given) whose task still
    runs (one look)."""
    alive = []
    for rank in range(world):
        try:
            rank_pid(allocation_id, rank, timeout=0, attempt=attempt)
            alive.append(rank)
        except AssertionError:
            pass
    return alive


def signal_rank(allocation_id: str, rank: int, sig: signal.Signals = signal.SIGKILL, attempt: int | None = None) -> str:
    """SIGKILL (a dead rank) or SIGSTOP (a hung one) to one rank; returns its node."""
    pid, node = rank_pid(allocation_id, rank, attempt=attempt)
    os.kill(pid, sig)
    return node


CGROUP_V1, CGROUP_V2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")


@contextlib.contextmanager
def throttled(pid: int, share: float) -> tp.Iterator[None]:
    """A slow node, for real: the kernel lets process `pid` (every thread) run only `share` of
    one CPU, in 20 ms periods (a CFS bandwidth cgroup, like a throttled or oversold machine; the
    quota is at least the kernel's 1 ms, so a share of 0.05 at the least).
    The cgroup goes when the block ends (its processes back to the root group)."""
    period = 20_000
    quota = str(max(1000, int(share * period)))
    if (CGROUP_V1 / "cpu.cfs_quota_us").exists():
        group = CGROUP_V1 / f"hpcrun-slow-{pid}"
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text(str(period))
        (group / "cpu.cfs_quota_us").write_text(quota)
    elif (CGROUP_V2 / "cgroup.controllers").exists():
        group = CGROUP_V2 / f"hpcrun-slow-{pid}"
        group.mkdir()
        (group / "cpu.max").write_text(f"{quota} {period}")
    else:
        raise AssertionError("no CPU cgroup controller here (/sys/fs/cgroup/cpu or cgroup v2) to slow a process with")
    # where it was (slurmd may keep its tasks in cgroups of its own): given back at the end
    v1 = group.parent == CGROUP_V1
    was = next((line.split(":", 2)[2] for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
                if ("cpu" in line.split(":")[1].split(",") if v1 else line.split(":")[1] == "")), "/")
    home = (CGROUP_V1 if v1 else CGROUP_V2) / was.lstrip("/")
    try:
        (group / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        with contextlib.suppress(OSError):
            for left in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (home / "cgroup.procs").write_text(left)
        group.rmdir()


def power_off(node: str) -> None:
    """The node is gone: SIGKILL every process in its namespace, slurmd and step daemons too.
    Repeated until none is left (a dying step daemon may spawn nothing, but be sure)."""
    for _ in range(20):
        pids = node_pids(node)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    raise AssertionError(f"{node}: processes survive SIGKILL: {node_pids(node)}")


def node_state(node: str) -> str:
    """sinfo's short state of `node` (one line per partition it is in, the pool's spare in `spare` only)."""
    states = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%t"], capture_output=True, text=True)
    return states.stdout.split()[0] if states.stdout.split() else ""


def node_flags(node: str) -> set[str]:
    """The node's state as slurmctld holds it (`scontrol show node`: DOWN+COMPLETING+NOT_RESPONDING
    -> {"DOWN", "COMPLETING", "NOT_RESPONDING"}): sinfo's short form names one of them, and was
    seen showing `mix*` for a node slurmctld had set DOWN a minute before."""
    out = subprocess.run(["scontrol", "show", "node", node], capture_output=True, text=True).stdout
    found = re.search(r"\bState=(\S+)", out)
    return set(found[1].split("+")) if found else set()


def wait_down(node: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if "DOWN" in node_flags(node):
            return
        time.sleep(1)
    raise AssertionError(f"{node} not DOWN after {timeout} s: {sorted(node_flags(node))} (sinfo: {node_state(node)!r})")


def power_on(node: str, timeout: float = 90) -> None:
    """Start the node's slurmd again and wait until SLURM schedules on it (ReturnToService=2)."""
    if not any(
        b"slurmd" in Path(f"/proc/{p}/comm").read_bytes() for p in node_pids(node) if Path(f"/proc/{p}/comm").exists()
    ):
        # with a new empty node-local scratch, as a rebooted node has
        subprocess.run(["bash", str(TESTCLUSTER), "slurmd", node], check=True)
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = node_state(node)
        if state in ("idle", "mix", "alloc"):
            return
        if state.startswith("down") and "*" not in state:  # answering, but kept down: give it back
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True)
        time.sleep(1)
    raise AssertionError(f"{node} did not come back: {node_state(node)!r}")


def crash_entrypoint_job(root: str, step_delay_s: float, crash_step: int) -> dict[str, tp.Any]:
    """A recipe `job:` whose last rank raises the same error at `crash_step` in every attempt."""
    return {
        "kind": "entrypoint", "entrypoint": "tests.faults:crash_train", "pythonpath": [root],
        "args": {"step_delay_s": step_delay_s, "model": "tiny", "crash_step": crash_step},
    }


def crash_train(ctx: tp.Any) -> None:
    """tests.delayed_training's training, with a bug at a fixed step on the last rank."""
    from tests.delayed_training import train

    crash_step = int(ctx.args["crash_step"])
    steps = ctx.steps

    def crashing() -> tp.Iterator[int]:
        for step in steps():
            if step == crash_step and ctx.rank == ctx.world_size - 1:
                raise RuntimeError(f"deliberate bug at step {crash_step}")
            yield step

    ctx.steps = crashing
    train(ctx)
