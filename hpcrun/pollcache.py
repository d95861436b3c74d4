"""Polite polling: one user's scheduler answers, shared by every hpcrun process of that user.

However many `hpcrun status`, `--wait` and cron processes a user runs, the accounting daemon is
asked at most once per `max_age`: the first process to find the shared answer too old asks for
the union of the jobs any of them followed recently (one `sacct` call), under a file lock, and
writes the answer with its time; the others wait on the lock and read it. SLURM's own guidance
(and submitit's history: sacct calls that hit the RPC limit, sbatch socket timeouts) is that
polling tools must not multiply their calls with their users' terminals.

Also: a controller that answered slowly is asked less often (`SLOW_FACTOR` times its answer's
duration), and one that failed is not asked again for a growing back-off; meanwhile the last good
answer serves the jobs it covers. The cache is a cache: a missing or unreadable file is asked
again, never mistaken for an answer, and a lock held past LOCK_WAIT_S (its holder stuck) is a
warning line and a query of this process's own, never a wait without end.

Where: `$HPCRUN_CACHE_DIR`, else `$XDG_CACHE_HOME/hpcrun`, else `~/.cache/hpcrun`; one file per
SLURM configuration (`$SLURM_CONF`), so two clusters never share answers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
import typing as tp
from pathlib import Path

import filelock

from hpcrun.errors import HpcrunError
from hpcrun.rundir import lock, replace_whole
from hpcrun.slurm import TIMEOUT_S

POLL_S = 2.0  # the default age after which an answer is asked again
KEEP_S = 600.0  # a job no process asked about for this long leaves the shared query
SLOW_FACTOR = 5.0  # an answer that took t seconds is not asked again within SLOW_FACTOR * t
MAX_BACKOFF_S = 300.0  # the longest pause after failed queries (doubling from POLL_S)
LOCK_WAIT_S = TIMEOUT_S + 15.0  # a holder asks one scheduler tool (at most TIMEOUT_S): one held longer is stuck


def cache_dir() -> Path:
    explicit = os.environ.get("HPCRUN_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hpcrun"


def cluster_key() -> str:
    """Which cluster answers: its configuration file and the ClusterName in it (read, no RPC),
    and this user, so clusters (or users) sharing a home directory never share answers."""
    conf = Path(os.environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf")
    try:
        found = re.search(
            r"^\s*ClusterName\s*=\s*(\S+)", conf.read_text(errors="replace"), re.MULTILINE | re.IGNORECASE
        )
    except OSError:
        found = None
    return hashlib.sha256(f"{conf}|{found[1] if found else ''}|{os.getuid()}".encode()).hexdigest()[:12]


def cache_file(tool: str) -> Path:
    return cache_dir() / f"{tool}-{cluster_key()}.json"


def _load(path: Path) -> dict[str, tp.Any]:
    """The cached answer, or {} when there is none or it is not one this module wrote (torn,
    edited): asked again, never read as an answer."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            return {}
        for key in ("asked_at", "failed_at", "took_s", "failures"):
            float(data.get(key) or 0)
        if not isinstance(data.get("wanted") or {}, dict) or not isinstance(data.get("ids") or [], list):
            return {}
        {str(j): float(t) for j, t in (data.get("wanted") or {}).items()}
        return data
    except (OSError, ValueError, TypeError):
        return {}


def shared(tool: str, job_ids: list[str], max_age: float, ask: tp.Callable[[list[str]], str]) -> str:
    """The text `ask(ids)` returns for a set of ids that includes `job_ids`, no older than
    `max_age` (or the controller's slowness or back-off, when longer). `ask` raises HpcrunError
    when the scheduler fails; that failure is remembered and raised again, without asking, to
    every caller the last good answer does not cover until the back-off has passed."""
    path = cache_file(tool)
    guard = lock(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        guard.acquire(timeout=LOCK_WAIT_S)
    except filelock.Timeout:  # a stuck holder (a stopped process): this one asks alone, not waits for good
        print(f"[hpcrun] warning: {guard.lock_file} held by another process for {LOCK_WAIT_S:.0f} s; asking unshared",
              file=sys.stderr)
        return ask(job_ids)
    except OSError:  # no usable cache directory (read-only home, no locks there): ask, unshared
        return ask(job_ids)
    try:
        return _shared(path, job_ids, max_age, ask)
    finally:
        guard.release()


def _shared(path: Path, job_ids: list[str], max_age: float, ask: tp.Callable[[list[str]], str]) -> str:
    """`shared`, under the cache's lock."""
    cache = _load(path)
    now = time.time()
    known = {j: float(t) for j, t in (cache.get("wanted") or {}).items() if now - float(t) < KEEP_S}
    wanted = {**known, **dict.fromkeys(job_ids, now)}
    stale_marks = any(now - known.get(j, 0.0) > KEEP_S / 10 for j in job_ids)  # worth a write to stay in the union
    covered = set(job_ids) <= set(cache.get("ids") or [])
    failures = int(cache.get("failures") or 0)
    wait = max(max_age, SLOW_FACTOR * float(cache.get("took_s") or 0.0))
    if failures:
        wait = max(wait, min(MAX_BACKOFF_S, POLL_S * 2 ** min(failures, 16)))
    last = max(float(cache.get("asked_at") or 0.0), float(cache.get("failed_at") or 0.0))
    if now - last < wait:
        if covered and "text" in cache:
            if stale_marks:
                _save(path, {**cache, "wanted": wanted})
            return str(cache["text"])
        if failures:
            retry = time.strftime("%H:%M:%S", time.localtime(last + wait))
            raise HpcrunError(f"{cache.get('error')} (not asked again before {retry})")
    ids = sorted(wanted)
    began = time.monotonic()
    try:
        text = ask(ids)
    except HpcrunError as exc:
        _save(
            path,
            {
                **cache,
                "wanted": wanted,
                "failures": failures + 1,
                "failed_at": time.time(),
                "error": exc.format_message(),
            },
        )
        raise
    took = time.monotonic() - began
    _save(path, {"ids": ids, "wanted": wanted, "text": text, "asked_at": time.time(), "took_s": took, "failures": 0})
    return text


def _save(path: Path, cache: dict[str, tp.Any]) -> None:
    try:
        replace_whole(path, json.dumps(cache))
    except OSError:  # a full or read-only disk: the answer is still given, only not shared
        pass
