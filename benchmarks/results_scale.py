"""Results scale: N attempts written the way jobs write them (`write_attempt`: one file each, never
merged), then read the way users read them, `load` + a pivot in process and `hpcrun results
--compare strategy,nodes` end to end (target: under 2 s at 10,000 attempts). Since ed7e179 readers
merge: `load` first calls `compact_when_many`, which merges the directory once more than
AUTO_COMPACT_FILES (256) files wait. So each way of reading is timed three times over the same rows:

  first read          the directory as jobs leave it (N files): this read merges them, then reads one
  after compaction    the next read: one merged file
  files waiting       after as many new attempts as a read leaves unmerged (256 files with the
                      merged one): the slowest read that merges nothing, a campaign's steady state

Baseline in the same run, for each way of reading: the same read of the same N files as jobs leave
them while the compaction lock is held, as when another process is compacting (`compact_when_many`
then merges nothing and the read takes every file as it is): what readers faced before any
merging. The command runs on a copy of the directory, so both ways of reading find it as jobs left it.

    python benchmarks/results_scale.py [--files 10000]
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import shutil
import subprocess
import sys
import time
import typing as tp
from pathlib import Path

from scratch import ROOT, scratch  # benchmarks/scratch.py


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=10_000, help="attempts written (one file each)")
    args = parser.parse_args()

    from hpcrun.compare import compare
    from hpcrun.results import AUTO_COMPACT_FILES, files, load, write_attempt
    from hpcrun.rundir import compact_lock

    written, copy = scratch("results-scale-"), scratch("results-scale-cli-")
    rng = random.Random(0)

    def attempt(i: int) -> dict[str, tp.Any]:
        return {
            "run_id": f"run{i}",
            "attempt_id": f"{i:032x}",
            "status": "completed",
            "strategy": rng.choice(["ddp", "fsdp", "deepspeed"]),
            "nodes": rng.choice([1, 2, 4, 8]),
            "tokens_per_s": rng.uniform(1e4, 1e5),
            "tokens_per_s_per_gpu": rng.uniform(1e3, 1e4),
            "mfu": rng.uniform(0.2, 0.6),
            "peak_memory_bytes": rng.randint(2**30, 2**36),
            "step_time_p50_s": rng.uniform(0.1, 1),
            "start_time": dt.datetime.now(dt.timezone.utc),
        }

    attempts = [attempt(i) for i in range(args.files)]
    spent = 0.0
    for row in attempts:
        t = time.perf_counter()
        write_attempt(written, row)
        spent += time.perf_counter() - t
    shutil.copytree(written, copy, dirs_exist_ok=True)
    print(
        f"write_attempt x {args.files}: {spent:.1f} s ({1e3 * spent / args.files:.1f} ms each); "
        f"{len(files(written))} files left (jobs never merge)"
    )

    def load_and_pivot(directory: Path, rows: int | None = None) -> None:
        df = load(directory)
        compare(df, ["strategy", "nodes"])
        assert len(df) == (rows or len(attempts)), (len(df), rows or len(attempts))

    def cli(directory: Path) -> None:
        subprocess.run(
            [sys.executable, "-m", "hpcrun.cli", "results", "--dir", str(directory), "--compare", "strategy,nodes"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )

    def timed(how: tp.Callable[[Path], None], directory: Path, merges: bool) -> tuple[float, int]:
        """Seconds for one read, and the files it left; `merges`: whether it must have merged."""
        before = len(files(directory))
        t = time.perf_counter()
        how(directory)
        seconds = time.perf_counter() - t
        after = len(files(directory))
        assert (after < before) == merges, f"{before} files before the read, {after} after"
        return seconds, after

    warm = scratch("results-scale-warm-")  # imports (pandas, pyarrow.dataset) and a first process before any timing
    write_attempt(warm, attempts[0])
    load_and_pivot(warm, 1)
    cli(warm)
    ways = {"load + pivot": (load_and_pivot, written), "hpcrun results --compare": (cli, copy)}
    timings: dict[str, list[tuple[float, int]]] = {}
    for name, (how, directory) in ways.items():
        with compact_lock(directory):  # another process compacting: this read merges nothing
            timings[name] = [timed(how, directory, merges=False)]
        timings[name].append(timed(how, directory, merges=args.files > AUTO_COMPACT_FILES))
        timings[name].append(timed(how, directory, merges=False))
    # as many new attempts as a read leaves unmerged: compact_when_many counts the merged file too
    extra = max(0, AUTO_COMPACT_FILES - len(files(written)))
    attempts.extend(attempt(args.files + i) for i in range(extra))
    for row in attempts[args.files:]:
        write_attempt(written, row)
        write_attempt(copy, row)
    for name, (how, directory) in ways.items():
        timings[name].append(timed(how, directory, merges=False))

    first = "first read (merges)" if args.files > AUTO_COMPACT_FILES else "first read (nothing to merge)"
    second = "after compaction" if args.files > AUTO_COMPACT_FILES else "second read"
    labels = (first, second, f"{extra} more files waiting (no merge)")
    for name, ((base, n), *arms) in timings.items():
        target = " (target < 2 s)" if name.startswith("hpcrun") else ""
        print(f"{name}{target}: baseline, {n} files read unmerged (compaction lock held): {base:.3f} s")
        for label, (seconds, left) in zip(labels, arms):
            print(f"  {label}: {seconds:.3f} s = {seconds / base:.2f} x baseline, {left} files after")


if __name__ == "__main__":
    main()
