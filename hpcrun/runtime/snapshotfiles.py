"""One snapshot step directory on disk (hpcrun.runtime.snapshot): its files' sizes and CRC-32s, its
manifest written last and the rename that makes it visible, the check a restore makes before it
uses a copy, and files mapped as tensors, so that a send reads a file's tmpfs pages and a receive
writes into them with no copy in the process."""

from __future__ import annotations

import os
import shutil
import typing as tp
import zlib
from pathlib import Path

import torch

from hpcrun import rundir

CHUNK = 1 << 24  # bytes read at a time to check a file


def file_hashes(directory: Path) -> dict[str, str]:
    """`<size>:<CRC-32>` of every file below `directory` but its manifest, by relative path.
    CRC-32 finds a torn or changed file at ~3.5 GiB/s on one core (sha256: ~1.5): it guards
    against accidents, not against an adversary, who could write the manifest too."""
    found = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.name != rundir.MANIFEST:
            found[path.relative_to(directory).as_posix()] = _checksum(path)
    return found


def _checksum(path: Path) -> str:
    crc, size = 0, 0
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return f"{size}:{crc:08x}"


def publish(tmp: Path, final: Path, **fields: tp.Any) -> None:
    """Write `tmp`'s manifest (the hashes of its files) last, then rename it to `final`. A `final`
    there already (the same step written before a restart, or a survivor's stand-in getting its own
    losses) is renamed aside first and removed after: a kill between the two renames leaves the old
    copy under a partial step's name (swept), never no copy and a removed one."""
    manifest = {**fields, "files": file_hashes(tmp), "complete": True}
    rundir.write_json(rundir.manifest(tmp), manifest)
    aside = final.with_name(f"{rundir.PARTIAL_STEP}{final.name}.old")
    shutil.rmtree(aside, ignore_errors=True)  # (a kill's leftover)
    try:
        os.rename(final, aside)
    except FileNotFoundError:
        pass
    os.rename(tmp, final)
    shutil.rmtree(aside, ignore_errors=True)


def manifest_of(step_dir: Path) -> dict[str, tp.Any] | None:
    """A snapshot's manifest; None when it has none, so is incomplete. An unreadable one is
    reported by `verify`; here it makes the snapshot count as absent (the disk stays)."""
    try:
        manifest = rundir.read_json(rundir.manifest(step_dir), missing=None)
    except rundir.CorruptStateError:
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("complete") else None


def verify(step_dir: Path) -> str | None:
    """Why the snapshot in `step_dir` may not be used, or None: its manifest lists exactly the
    files there, each with its size and CRC-32."""
    manifest = manifest_of(step_dir)
    if manifest is None:
        return f"{rundir.manifest(step_dir)}: missing or unreadable"
    try:
        found = file_hashes(step_dir)
    except OSError as exc:
        return f"{step_dir}: {exc}"
    listed = manifest.get("files", {})
    wrong = sorted(name for name in set(listed) | set(found) if listed.get(name) != found.get(name))
    return f"{step_dir}: files differ from the manifest: {', '.join(wrong)}" if wrong else None


def mapped(path: Path, size: int) -> torch.Tensor:
    """The bytes of `path` as a tensor over its pages: on tmpfs a send reads the file's memory
    and a receive writes into it, with no copy in the process."""
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)


def allocated(path: Path, size: int) -> torch.Tensor:
    """A new file of `size` bytes, its blocks reserved (a full tmpfs is ENOSPC here, not a fault
    while a receive writes into the mapping), mapped."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        if size:
            os.posix_fallocate(f.fileno(), 0, size)
    return mapped(path, size)
