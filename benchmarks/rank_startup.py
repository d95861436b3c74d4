"""A rank's start-up and exit in CPU seconds: the imports `hpcrun.launch` makes (torch, DCP, the
runtime), then torch._dynamo (DDP's constructor imports it), then the interpreter's exit, with the
launcher's garbage-collector handling (no collection during the imports, then gc.freeze: the
sequence of hpcrun/launch.py's main, written out here) against plain imports, in the same run,
alternating.

    python benchmarks/rank_startup.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys

IMPORTS = "import hpcrun.runtime.trainer"
CASES = {
    "plain imports": f"{IMPORTS}\nimport torch._dynamo",
    "as hpcrun.launch (gc off, then frozen)": f"import gc\ngc.disable()\n{IMPORTS}\ngc.freeze()\ngc.enable()\n"
                                              "import torch._dynamo",
}


def cpu_of(code: str) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    seen: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.rounds):
        for name, code in CASES.items():
            seen[name].append(cpu_of(code))
    base = statistics.median(seen["plain imports"])
    for name, times in seen.items():
        print(f"{name}: median {statistics.median(times):.2f} s of CPU (min {min(times):.2f}, max {max(times):.2f}), "
              f"{statistics.median(times) / base:.2f}x")


if __name__ == "__main__":
    main()
