"""Tier 0 of recovery: the ranks that outlive a peer's failure keep the state they hold.

Where every rank holds the same state (DDP: `engine.replicated`), a rank that sees the attempt
end (its collective failed, or its watchdog fired: a peer died, stopped or lost its node) still
holds the model and optimizer of its last completed step, newer than any snapshot. Before it
exits it writes that state as an in-memory snapshot of that step (hpcrun.runtime.snapshot's
layout, no collective: its peers may be gone), and the restart resumes from it: at most the
interrupted step is computed again. One survivor per node writes, the first to claim the step:
the engine state once, and every rank's directory of that step, its engine state (where that
rank's node keeps one) linked to the same files, so that the restart's restore finds a whole
set on any node that had a survivor, the dead ranks' included; the node's other survivors then
put their own trainer state (their losses) in their directories. A dead rank's trainer state is
the survivor's, less its own losses (`STAND_IN`): what a rank needs besides the engine state is
rank-independent (the step; the RNG streams are seeded per step, hpcrun.runtime.checkpoint
`seed_step`).

Sharded states (FSDP, ZeRO) keep their periodic snapshots: a dead rank's shard of the last step
is nowhere else.
"""

from __future__ import annotations

import os
import shutil
import time
import typing as tp
from pathlib import Path

from hpcrun import rundir
from hpcrun.runtime import checkpoint as ckpt
from hpcrun.runtime.snapshotdirs import RankDirs
from hpcrun.runtime.snapshotfiles import manifest_of, publish

STAND_IN = "stand_in"  # a trainer state's key: written by a survivor for another rank (its losses unknown)
SURVIVOR = "survivor"  # a manifest's key: the rank whose save this step is
WRITER_THREADS = 8  # benchmarks/survivor_save.py: 1.4x faster than one on this machine's CPUs
# how long a node's other survivors wait for the claimant's write (a 1.3b model's state: ~13 s on an H200),
# within the batch script's SAVE_GRACE_S (hpcrun.render)
OWN_WAIT_S = 40.0


class Layout(tp.Protocol):
    """What a survivor's save asks of the snapshots' peers (hpcrun.runtime.snapshotexchange `Peers`)."""

    nodes: list[str]

    def engine_rank(self, rank: int, engine: tp.Any) -> int: ...


def keep(
    dirs: RankDirs, peers: Layout, engine: tp.Any, rank: int, world_size: int, attempt: int, run_id: str,
    step: int, state: dict[str, tp.Any],
) -> str:
    """Write `engine`'s live state as step `step` of every rank of the world on this node, unless
    another rank here claimed that step (then this rank's own losses go into its directory once that
    rank has written it, or this rank writes the step itself if that rank gave up); returns what was
    done, for the rank's log. The caller holds the engine's update lock."""
    if len(peers.nodes) != world_size:
        return "not kept: the ranks' nodes were not learnt yet (no snapshot taken)"
    if not dirs.claim(rank):  # (its directory made, where none was: no snapshot taken yet)
        return "not kept: the snapshots were closed"
    claim = claim_file(dirs, attempt, step)
    while True:
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            break
        except FileExistsError:
            said = own(dirs, rank, step, attempt, state, claim)
            if said is not None:
                return said  # else the claimant gave up: claim the step again
    try:
        return _write(dirs, peers, engine, rank, world_size, attempt, run_id, step, state)
    except BaseException:
        claim.unlink(missing_ok=True)  # another survivor of this node may write it yet
        raise


def _write(
    dirs: RankDirs, peers: Layout, engine: tp.Any, rank: int, world_size: int, attempt: int, run_id: str,
    step: int, state: dict[str, tp.Any],
) -> str:
    staged = rundir.survivor_partial_step_dir(dirs.rank_dir(rank), step, "engine")
    if not dirs.new_dir(staged):
        return "not kept: the snapshots were closed"
    # on the restart's critical path, with no training left to leave the cores to
    engine.write_survivor(rundir.engine_state(staged), threads=WRITER_THREADS)
    written = []
    for other in range(world_size):
        final = rundir.step_dir(dirs.rank_dir(other), step)
        if (manifest_of(final) or {}).get("attempt") == attempt:  # this attempt's periodic snapshot of this step
            continue
        if other != rank and not dirs.claim(other):  # (claiming this rank's again would remove `staged`)
            continue
        tmp = rundir.survivor_partial_step_dir(dirs.rank_dir(other), step, "step")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        mine = {**state, "rank": other, "rng": ckpt.rng_state()}
        if other != rank:
            mine = {**mine, "rank_losses": [None] * len(state.get("rank_losses", [])), STAND_IN: True}
        rundir.trainer_state(tmp, other).write_bytes(ckpt.serialise(mine))
        if peers.engine_rank(other, engine) == other:
            link_tree(rundir.engine_state(staged), rundir.engine_state(tmp))
        publish(tmp, final, step=step, rank=other, world_size=world_size, run_id=run_id, attempt=attempt,
                **{SURVIVOR: rank})
        written.append(other)
    shutil.rmtree(staged, ignore_errors=True)
    return f"kept step {step} for rank(s) {', '.join(map(str, written))} on this node"


def claim_file(dirs: RankDirs, attempt: int, step: int) -> Path:
    """The file whose creation makes one survivor of a node the writer of `step` (hpcrun.runtime.
    snapshotsweep `sweep_past` removes it once a restart has read the node)."""
    root = dirs.rank_dir(0).parent
    return root / f"{rundir.SURVIVOR_CLAIM}{attempt}-{rundir.step_dir(root, step).name}"


def own(dirs: RankDirs, rank: int, step: int, attempt: int, state: dict[str, tp.Any], claim: Path,
        wait_s: float = OWN_WAIT_S) -> str | None:
    """On a node where another survivor claimed step `step`: once it has published this rank's
    directory of that step (a stand-in), put this rank's own trainer state (its losses) in it. None:
    the claimant gave up (its claim is gone), so this rank may write the step."""
    final = rundir.step_dir(dirs.rank_dir(rank), step)
    deadline = time.monotonic() + wait_s
    while (manifest_of(final) or {}).get("attempt") != attempt:
        if not claim.exists():
            return None
        if time.monotonic() > deadline:
            return f"step {step} kept by another rank on this node (this rank's losses not added)"
        time.sleep(0.05)
    manifest = manifest_of(final) or {}
    tmp = rundir.survivor_partial_step_dir(dirs.rank_dir(rank), step, "own")
    shutil.rmtree(tmp, ignore_errors=True)
    link_tree(final, tmp, leave=(rundir.MANIFEST, rundir.trainer_state(final, rank).name))
    rundir.trainer_state(tmp, rank).write_bytes(ckpt.serialise({**state, "rank": rank, "rng": ckpt.rng_state()}))
    publish(tmp, final, **{k: v for k, v in manifest.items() if k not in ("files", "complete")})
    return f"step {step} kept by another rank on this node, this rank's losses added"


def link_tree(source: Path, target: Path, leave: tuple[str, ...] = ()) -> None:
    """`target` as a tree of hard links to `source`'s files (but those named in `leave` at its top):
    one copy of the engine state in memory."""
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.rglob("*")):
        dest = target / path.relative_to(source)
        if path.parent == source and path.name in leave:
            continue
        if path.is_dir():
            dest.mkdir(parents=True, exist_ok=True)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, dest)
