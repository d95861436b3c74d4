"""Which part of the SLURM test cluster this test process uses.

tests/cluster/testcluster.sh up --nodes N makes N/2 pools of two nodes, each with its own
partitions (pool 0: `batch`, `urgent` on node1, node2; pool k: `batchk`, `urgentk` on the next
two). CI runs the cluster tests in HPCRUN_CLUSTER_POOLS pytest-xdist workers, worker k on pool k,
so tests running at once never share nodes, preempt each other or see each other's jobs in a
partition. Without HPCRUN_CLUSTER_POOLS every test uses pool 0, the two-node cluster's names.
"""

from __future__ import annotations

import os


def index() -> int:
    pools = int(os.environ.get("HPCRUN_CLUSTER_POOLS") or 1)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    k = int(worker[2:]) if pools > 1 and worker.startswith("gw") else 0
    if k >= pools:
        raise RuntimeError(
            f"pytest-xdist worker {worker} has no pool of the test cluster (HPCRUN_CLUSTER_POOLS={pools})"
        )
    return k


def partition(name: str) -> str:
    """`batch`, `urgent`, `fragile` or `spare` (its two nodes and a spare node), as this pool calls
    it (`all` spans every pool)."""
    return name if index() == 0 or name not in ("batch", "urgent", "fragile", "spare") else f"{name}{index()}"


def nodes() -> tuple[str, str]:
    k = index()
    return f"node{2 * k + 1}", f"node{2 * k + 2}"


def spare_node() -> str | None:
    """The pool's hot spare (partition `spare`, tests/cluster/testcluster.sh), None without one."""
    import subprocess

    out = subprocess.run(["sinfo", "-h", "-N", "-p", partition("spare"), "-o", "%N"], capture_output=True, text=True)
    extra = sorted(set(out.stdout.split()) - set(nodes())) if out.returncode == 0 else []
    return extra[0] if extra else None


def node_list() -> str:
    """The pool's two nodes as SLURM writes them in a job's node list (`node[1-2]`)."""
    a, b = (int(n[4:]) for n in nodes())
    return f"node[{a}-{b}]"
