"""How a rank's snapshots reach other nodes (hpcrun.runtime.snapshot): the snapshots' own gloo
group, where every rank runs, and step directories sent between ranks as they lie in memory (tmpfs
pages, mapped: no pickles, no copies), received straight into their files and checked against
their manifest. After its write each rank sends its snapshot to the rank of the same position on
the next node (its peer, `replicate`); a restore sends a lost node's ranks their files (`exchange`)."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import typing as tp
from pathlib import Path

import torch
import torch.distributed as dist

from hpcrun import rundir
from hpcrun.runtime.env import DistEnv
from hpcrun.runtime.snapshotdirs import CLOSED, RankDirs
from hpcrun.runtime.snapshotfiles import mapped

SEND_CHUNK = 1 << 28  # one message's most bytes: gloo's ibverbs transport refuses 1 GiB and more


def chunks(data: torch.Tensor) -> list[torch.Tensor]:
    """`data` as views of at most SEND_CHUNK bytes, sent and received in the same order."""
    return list(data.split(SEND_CHUNK)) if data.numel() else []


def nodes_ranks(nodes: list[str]) -> list[list[int]]:
    """The ranks on each node, nodes in the order of their first rank."""
    order: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        order.setdefault(node, []).append(rank)
    return list(order.values())


def peer_of(nodes: list[str], rank: int) -> int | None:
    """Where `rank` sends its snapshots: the rank at its position on the next node (rank r ->
    r + tasks per node, modulo the world, for SLURM's block layout); None on a single node."""
    groups = nodes_ranks(nodes)
    if len(groups) < 2:
        return None
    index = next(i for i, g in enumerate(groups) if rank in g)
    nxt = groups[(index + 1) % len(groups)]
    return nxt[groups[index].index(rank) % len(nxt)]


class Peers:
    """This rank's view of the others: where each runs (`nodes`, learnt collectively) and the
    snapshots' gloo group its copies and agreements travel on."""

    def __init__(self, env: DistEnv, node: str, timeout_s: float) -> None:
        self.env, self.node = env, node
        distributed = dist.is_initialized() and env.world_size > 1
        # a group of its own: the background thread's sends and agreement never interleave with
        # training's; with the job's collective timeout, so that a dead peer ends the attempt in time
        timeout = dt.timedelta(seconds=timeout_s)
        self.group = dist.new_group(backend="gloo", timeout=timeout) if distributed else None
        self.nodes: list[str] = [node]

    def gather(self, value: tp.Any) -> list[tp.Any]:
        """Every rank's `value`, by rank. Collective."""
        if self.group is None:
            return [value]
        out: list[tp.Any] = [None] * self.env.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def learn_nodes(self) -> None:
        """Where every rank runs, if no restore learnt it. Collective."""
        if len(self.nodes) != self.env.world_size:
            self.nodes = self.gather(self.node)

    def engine_rank(self, rank: int, engine: tp.Any) -> int:
        """The rank whose snapshot directory holds `rank`'s engine state: its own, or where every
        rank holds the same state (DDP, `engine.replicated`) its node's first rank's, one copy per
        node (a restart keeps SLURM's block layout, so the same rank is first again)."""
        if not getattr(engine, "replicated", False):  # an engine that does not say keeps its own
            return rank
        return next(group[0] for group in nodes_ranks(self.nodes) if rank in group)

    def replicate(self, dirs: RankDirs, published: Path | None, step: int) -> str | None:
        """Send this rank's snapshot of `step` (None: it failed, nothing is sent) to its peer and
        receive the copies of the ranks whose peer this rank is; returns why one failed, or None."""
        peer = peer_of(self.nodes, self.env.rank)
        if peer is None:
            return None
        senders = [r for r in range(self.env.world_size) if peer_of(self.nodes, r) == self.env.rank]
        try:
            return self.exchange(dirs, [(peer, published)], [(sender, sender) for sender in senders], step)
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            return f"{type(exc).__name__}: {exc}"

    def exchange(
        self, dirs: RankDirs, outgoing: list[tuple[int, Path | None]], incoming: list[tuple[int, int]], step: int
    ) -> str | None:
        """Send each outgoing step directory to its rank (None: nothing, this rank's snapshot
        failed) and receive each incoming (sender, rank) copy as step `step` of that rank's
        directory here: a header (the files and sizes), then every file's bytes straight from
        and into its mapped pages, written under a temporary name, verified, renamed. Returns
        why a received copy was refused, or None."""
        sends: list[tuple[tp.Any, torch.Tensor]] = []  # each send with its tensor, kept alive until it completes
        for to, directory in outgoing:
            pieces, files = [], []
            try:  # every file mapped before the header goes: an error after it would leave the peer short
                for path in [] if directory is None else sorted(p for p in directory.rglob("*") if p.is_file()):
                    length = path.stat().st_size
                    files.append((path.relative_to(tp.cast(Path, directory)).as_posix(), length))
                    pieces += chunks(mapped(path, length)) if length else []
            except OSError:
                pieces, files = [], []  # the peer is told "nothing" and counts the copy missing
            header = torch.frombuffer(bytearray(json.dumps({"files": files}).encode()), dtype=torch.uint8)
            size = torch.tensor([header.numel()], dtype=torch.int64)
            sends += [(dist.isend(t, to, group=self.group), t) for t in (size, header, *pieces)]
        why = None
        for sender, rank in incoming:
            reason, settled = self._receive(dirs, sender, rank, step)
            # said: the first copy refused before it landed, or the last one refused once it had
            why = (reason or why) if settled else (why or reason)
        for work, _ in sends:
            work.wait()
        return why

    def _receive(self, dirs: RankDirs, sender: int, rank: int, step: int) -> tuple[str | None, bool]:
        """`sender`'s copy of `rank`'s step `step`, into this node's directory of `rank`; every byte
        sent is taken off the wire even when it cannot be kept. Returns why it was refused (or None),
        and whether it was received whole and checked (`RankDirs.settle`)."""
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, sender, group=self.group)
        header = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(header, sender, group=self.group)
        files = json.loads(header.numpy().tobytes())["files"]
        if not files:
            return f"rank {sender} sent no snapshot of rank {rank}", False
        tmp = rundir.partial_step_dir(dirs.rank_dir(rank), step)
        refused = None
        try:
            if not (dirs.claim(rank) and dirs.new_dir(tmp)):
                refused = CLOSED
        except OSError as exc:
            refused = f"{dirs.rank_dir(rank)}: {exc}"
        for name, length in files:
            target = None
            if refused is None:
                try:  # a full tmpfs or a close: still take every byte the sender sends
                    target = dirs.allocated(tmp / name, length)
                    refused = CLOSED if target is None else None
                except OSError as exc:
                    refused = f"{tmp / name}: {exc}"
            if target is None:  # drained through one chunk's buffer, piece by piece as they were sent
                scratch = torch.empty(min(length, SEND_CHUNK), dtype=torch.uint8)
                pieces = [scratch[: min(SEND_CHUNK, length - at)] for at in range(0, length, SEND_CHUNK)]
            else:
                pieces = chunks(target)
            for piece in pieces:
                dist.recv(piece, sender, group=self.group)
        if refused:
            shutil.rmtree(tmp, ignore_errors=True)
            return refused, False
        return dirs.settle(tmp, rundir.step_dir(dirs.rank_dir(rank), step)), True
