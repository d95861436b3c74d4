"""Results scale: 10,000 attempts written the way jobs write them (`write_attempt`, which merges
small files once more than AUTO_COMPACT_FILES accumulate), then read: `load` + a pivot in
process, and `hpcrun results` end to end (target: under 2 s). Baseline in the same run: the same
rows as 10,000 one-row files, never merged (what readers faced before).

    python benchmarks/results_scale.py [--files 10000]
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import subprocess
import sys
import time
from pathlib import Path

from scratch import ROOT, scratch  # benchmarks/scratch.py


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=10_000)
    args = parser.parse_args()
    import pyarrow.parquet as pq

    from hpcrun.compare import compare
    from hpcrun.results import files, load, table, write_attempt

    written, unmerged = scratch("results-scale-"), scratch("results-scale-unmerged-")
    rng = random.Random(0)
    spent = 0.0
    for i in range(args.files):
        row = {
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
        t = time.perf_counter()
        write_attempt(written, row)
        spent += time.perf_counter() - t
        pq.write_table(table([row]), unmerged / f"run{i}.parquet")
    print(
        f"write_attempt x {args.files}: {spent:.1f} s ({1e3 * spent / args.files:.1f} ms each, merges included); "
        f"{len(files(written))} files left"
    )

    def load_and_pivot(directory: Path) -> float:
        t = time.perf_counter()
        df = load(directory)
        compare(df, ["strategy", "nodes"])
        assert len(df) == args.files
        return time.perf_counter() - t

    def cli(directory: Path) -> float:
        t = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "hpcrun.cli", "results", "--dir", str(directory), "--compare", "strategy,nodes"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        return time.perf_counter() - t

    base, subject = load_and_pivot(unmerged), load_and_pivot(written)
    print(
        f"load + pivot: {args.files} one-row files {base:.2f} s; "
        f"as written by jobs {subject:.3f} s ({base / subject:.0f}x faster)"
    )
    base, subject = cli(unmerged), cli(written)
    print(
        f"hpcrun results --compare: {args.files} one-row files {base:.2f} s; "
        f"as written by jobs {subject:.2f} s (target < 2 s)"
    )


if __name__ == "__main__":
    main()
