"""Results scale: load and pivot 10,000 run files before and after compaction (target: under
1 s after).

    python benchmarks/results_scale.py [--files 10000]
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import time

from scratch import scratch  # benchmarks/scratch.py


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=10_000)
    args = parser.parse_args()
    from hpcrun.compare import compare
    from hpcrun.results import compact, load, write_attempt

    tmp = scratch("results-scale-")
    rng = random.Random(0)
    start = time.perf_counter()
    for i in range(args.files):
        write_attempt(tmp, {
            "run_id": f"run{i}", "status": "completed", "strategy": rng.choice(["ddp", "fsdp", "deepspeed"]),
            "nodes": rng.choice([1, 2, 4, 8]), "tokens_per_s": rng.uniform(1e4, 1e5), "tokens_per_s_per_gpu": rng.uniform(1e3, 1e4),
            "mfu": rng.uniform(0.2, 0.6), "peak_memory_bytes": rng.randint(2**30, 2**36), "step_time_p50_s": rng.uniform(0.1, 1),
            "start_time": dt.datetime.now(dt.timezone.utc),
        })
    print(f"wrote {args.files} files in {time.perf_counter() - start:.1f} s")

    def load_and_pivot() -> float:
        t = time.perf_counter()
        df = load(tmp)
        compare(df, ["strategy", "nodes"])
        assert len(df) == args.files
        return time.perf_counter() - t

    before = load_and_pivot()
    t = time.perf_counter()
    merged, rows = compact(tmp)
    compaction = time.perf_counter() - t
    after = load_and_pivot()
    print(f"load + pivot, {args.files} files: {before:.2f} s")
    print(f"compact: {merged} files -> 1 ({rows} rows) in {compaction:.2f} s")
    print(f"load + pivot after compaction: {after:.3f} s ({before / after:.0f}x faster; target < 1 s)")


if __name__ == "__main__":
    main()
