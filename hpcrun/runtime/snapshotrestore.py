"""What an attempt's start restores from in-memory snapshots (hpcrun.runtime.snapshot), collectively:
the ranks exchange what their nodes hold (`inventory`), pick the newest step of which every rank
has a verified copy written by one attempt on some node (ranks of different attempts never make
one state), have a holder send the files of any rank whose node lacks them (a lost node's ranks,
started on another node), and load it when it is newer than the newest disk checkpoint. A torn
copy (a file short or changed, no manifest) is never used: that rank's files come from another
holder, or an older step, or the disk checkpoint is used (a copy that fails to arrive sends the
restart to disk)."""

from __future__ import annotations

import dataclasses
import typing as tp
from pathlib import Path

import torch

from hpcrun import rundir
from hpcrun.runtime import checkpoint as ckpt
from hpcrun.runtime.snapshotdirs import RankDirs
from hpcrun.runtime.snapshotexchange import Peers, nodes_ranks
from hpcrun.runtime.snapshotfiles import manifest_of, verify
from hpcrun.runtime.snapshotsurvivor import SURVIVOR


@dataclasses.dataclass(frozen=True)
class Restored:
    """Where an attempt resumed from: `memory` (every rank's own node held its files), `replica`
    (some rank's files came from another node) or `survivor` (the ranks that outlived the failure
    kept their last step: hpcrun.runtime.snapshotsurvivor), the step, and this rank's trainer state."""

    source: str
    step: int
    state: dict[str, tp.Any]


Copy = tuple[int, int, int]
"""A snapshot copy: (rank, step, attempt that wrote it)."""


def inventory(dirs: RankDirs, world_size: int, larger: bool = False) -> list[Copy]:
    """(rank, step, attempt) of every complete snapshot of this run's world size on this node (with
    `larger`, of a larger one too: a replicated state resumes on fewer ranks after a shrink)."""
    found = []
    for rank, path in rundir.snapshot_ranks(dirs.job_dir, dirs.run_id, dirs.host).items():
        for step, step_path in rundir.step_dirs(path).items():
            manifest = manifest_of(step_path)
            saved_by = manifest.get("world_size") if manifest else None
            usable = saved_by == world_size or (larger and isinstance(saved_by, int) and saved_by > world_size)
            if manifest and usable and manifest.get("step") == step:
                found.append((rank, step, int(manifest.get("attempt", -1))))
    return found


def restore(
    peers: Peers, dirs: RankDirs, engine: tp.Any, newer_than: int, info: tp.Callable[[str], None]
) -> Restored | None:
    """Load the newest step every rank has a verified copy of, written by one attempt, if newer
    than `newer_than` (the newest disk checkpoint's step); None: resume from disk. Collective."""
    env = peers.env
    # every rank's engine state is the same (DDP): saved by more ranks, it serves fewer as well
    gathered = peers.gather((peers.node, inventory(dirs, env.world_size, larger=getattr(engine, "replicated", False))))
    peers.nodes = [node for node, _ in gathered]
    holders: dict[Copy, list[int]] = {}
    for group in nodes_ranks(peers.nodes):  # one holder per node: its first rank
        for copy in gathered[group[0]][1]:
            holders.setdefault(tuple(copy), []).append(group[0])
    for step, attempt in sorted({(s, a) for _, s, a in holders if s > newer_than}, reverse=True):
        plan = _plan(peers, dirs, step, attempt, holders, info)
        if plan is None:
            continue
        source = "memory" if all(peers.nodes[h] == peers.nodes[r] for r, h in plan.items()) else "replica"
        refused = peers.gather(_fetch(peers, dirs, step, plan))
        # after that gather every rank's files of this step are on its own node, its node's
        # first rank's too (the engine state of a rank that keeps none, DDP's)
        shared = rundir.step_dir(dirs.rank_dir(peers.engine_rank(env.rank, engine)), step)
        if not any(refused):
            missing = None if rundir.engine_state(shared).exists() else f"{shared}: no engine state"
            refused = peers.gather(missing)
        if any(refused):
            why = "; ".join(w for w in refused if w)
            info(f"snapshot of step {step} not usable: {why}; resuming from disk")
            return None
        path = rundir.step_dir(dirs.rank_dir(env.rank), step)
        if SURVIVOR in (manifest_of(path) or {}):  # the ranks that outlived the failure kept this step
            source = SURVIVOR
        engine.load(rundir.engine_state(shared), local=True)
        state = torch.load(rundir.trainer_state(path, env.rank), weights_only=True)
        ckpt.set_rng_state(state["rng"])
        return Restored(source, step, state)
    return None


def _plan(
    peers: Peers, dirs: RankDirs, step: int, attempt: int, holders: dict[Copy, list[int]],
    info: tp.Callable[[str], None],
) -> dict[int, int] | None:
    """Which rank's node serves each rank's files of `step` as `attempt` wrote it: the rank's
    own node where it holds a verified copy, else another holder; None when some rank has no
    verified copy of that attempt anywhere."""
    nodes = peers.nodes
    refused: set[tuple[int, int]] = set()  # (holder, rank) whose copy failed verification
    while True:
        plan = {}
        for rank in range(peers.env.world_size):
            usable = [h for h in holders.get((rank, step, attempt), []) if (h, rank) not in refused]
            if not usable:
                return None
            own = [h for h in usable if nodes[h] == nodes[rank]]
            plan[rank] = (own or usable)[0]
        mine = [r for r, h in plan.items() if h == peers.env.rank]
        checked = [(r, verify(rundir.step_dir(dirs.rank_dir(r), step))) for r in mine]
        bad = [(holder, r, why) for holder, found in enumerate(peers.gather(checked)) for r, why in found if why]
        if not bad:
            return plan
        for holder, rank, why in bad:
            info(f"snapshot of rank {rank} at step {step} on {nodes[holder]} not used: {why}")
            refused.add((holder, rank))


def _fetch(peers: Peers, dirs: RankDirs, step: int, plan: dict[int, int]) -> str | None:
    """Send and receive the files of ranks whose node lacks them (point to point over the
    snapshots' group); returns why a received copy was refused, or None."""
    moves = [(h, r) for r, h in sorted(plan.items()) if peers.nodes[h] != peers.nodes[r]]
    mine = peers.env.rank
    outgoing: list[tuple[int, Path | None]] = [
        (rank, rundir.step_dir(dirs.rank_dir(rank), step)) for holder, rank in moves if holder == mine
    ]
    return peers.exchange(dirs, outgoing, [(holder, mine) for holder, rank in moves if rank == mine], step)
