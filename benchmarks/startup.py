"""Login-node start-up: `hpcrun --help` and `hpcrun render` wall time against `python -c pass`
in the same run, and proof that torch was not imported.

    python benchmarks/startup.py [--repeat 10]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(cmd: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    py = sys.executable
    base = timed([py, "-c", "pass"], args.repeat)
    cases = {
        "hpcrun --help": [py, "-m", "hpcrun.cli", "--help"],
        "hpcrun render": [
            py,
            "-m",
            "hpcrun.cli",
            "render",
            "--site",
            "mycluster",
            "--run-id",
            "x",
            "jobs/quickstart.yaml",
        ],
    }
    print(f"python -c pass: {base * 1000:.0f} ms (median of {args.repeat})")
    for name, cmd in cases.items():
        t = timed(cmd, args.repeat)
        print(f"{name}: {t * 1000:.0f} ms, {t / base:.1f}x python -c pass, +{(t - base) * 1000:.0f} ms")
    probe = (
        "import sys; from hpcrun.cli import main\n"
        "try: main(['render','--site','mycluster','jobs/quickstart.yaml'], standalone_mode=False)\n"
        "finally: print('torch imported:', 'torch' in sys.modules, file=sys.stderr)"
    )
    out = subprocess.run([py, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    print(out.stderr.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
