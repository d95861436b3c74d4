"""Status scale: `hpcrun status` over 1,000 running SLURM runs, each with jobs.json and rank 0's
progress.json, with `sacct` faked on PATH (one call answering for all of them, as the real
one does). Baseline in the same run: the same runs without progress files (what status cost
before it showed step, rate and ETA). Timed end to end (a fresh `hpcrun status` process, as
a user runs it) and in-process (`hpcrun.status.statuses`), median of several rounds.

    python benchmarks/status_scale.py [--runs 1000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import statistics
import subprocess
import sys
import time
from pathlib import Path

from scratch import ROOT, scratch, scratch_site  # benchmarks/scratch.py

TARGET_S = 2.0


def runs(tmp: Path, count: int, with_progress: bool) -> list[Path]:
    """`count` run directories as `hpcrun submit` leaves them on a SLURM site, while training."""
    now = time.time()
    dirs = []
    for index in range(count):
        run_dir = tmp / "runs" / f"scale.{index:04d}"
        run_dir.mkdir(parents=True)
        job = str(100000 + index)
        (run_dir / "runspec.json").write_text("{}")
        (run_dir / "jobs.json").write_text(
            json.dumps(
                [{"job_id": job, "scheduler": "slurm", "submitted": now - 3600, "log_folder": str(run_dir / "logs")}],
                indent=1,
            )
        )
        if with_progress:
            (run_dir / "progress.json").write_text(
                json.dumps(
                    {
                        "step": 400 + index,
                        "total": 5000,
                        "loss": 3.0 + index / 1000,
                        "tokens_per_s": 51234.5,
                        "step_time_s": 0.8,
                        "eta_s": (5000 - 400 - index) * 0.8,
                        "updated": now - 5,
                        "job_id": job,
                        "attempt": index % 3,
                        "checkpoint_step": 400,
                    },
                    indent=1,
                    sort_keys=True,
                )
            )
        dirs.append(run_dir)
    return dirs


def fake_sacct(tmp: Path, count: int) -> Path:
    """A `sacct` that logs its call and prints a RUNNING record for every job (requeued ones
    with their earlier records, as `sacct -D` does)."""
    bindir = tmp / "bin"
    bindir.mkdir()
    lines = []
    for index in range(count):
        job = 100000 + index
        lines += [f"{job}|REQUEUED|node{index % 64}|600|None"] * (index % 3)
        lines.append(f"{job}|RUNNING|node{index % 64}|3600|None")
    (tmp / "sacct.out").write_text("\n".join(lines) + "\n")
    for name, body in {"sacct": f'echo sacct >>"{tmp}/calls"; cat "{tmp}/sacct.out"', "squeue": "exit 0"}.items():
        path = bindir / name
        path.write_text("#!/bin/bash\n" + body + "\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return bindir


def cli_seconds(site: Path, env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "hpcrun.cli", "status", "--site", str(site)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    seconds = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"hpcrun status exited {out.returncode}: {out.stderr}")
    return seconds, out.stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    cases = {}
    for name, with_progress in (("with progress", True), ("baseline (no progress files)", False)):
        tmp = scratch("status-scale-")
        cases[name] = (tmp, runs(tmp, args.runs, with_progress), scratch_site(tmp, "testcluster"), with_progress)
        fake_sacct(tmp, args.runs)
    base_path = os.environ["PATH"]
    os.environ["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"

    from hpcrun.status import statuses

    results: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in cases}
    for round_ in range(args.rounds + 1):  # round 0 warms the page cache and imports, not counted
        for name, (tmp, dirs, site, with_progress) in cases.items():  # alternating, so drift hits both alike
            os.environ["PATH"] = f"{tmp / 'bin'}{os.pathsep}{base_path}"
            # each measurement with an empty shared-answers cache (hpcrun.pollcache): a cold poll, one sacct
            os.environ["HPCRUN_CACHE_DIR"] = str(scratch("pollcache-"))
            start = time.perf_counter()
            rows = statuses(dirs)
            inproc = time.perf_counter() - start
            os.environ["HPCRUN_CACHE_DIR"] = str(scratch("pollcache-"))
            (tmp / "calls").write_text("")
            seconds, stdout = cli_seconds(site, dict(os.environ))
            calls = (tmp / "calls").read_text().count("sacct")
            assert calls == 1, f"{name}: {calls} sacct calls for one status"
            assert len(rows) == args.runs and all(r.state == "RUNNING" for r in rows)
            shown = sum(1 for line in stdout.splitlines() if "/5000" in line)
            assert shown == (args.runs if with_progress else 0), f"{name}: {shown} runs show a step"
            if round_:
                results[name][0].append(seconds)
                results[name][1].append(inproc)

    print(f"hpcrun status of {args.runs} running runs (one sacct call each time), median of {args.rounds} rounds:")
    for name, (cli, inproc) in results.items():
        print(
            f"  {name:30} end to end {statistics.median(cli):.2f} s   "
            f"in-process statuses() {statistics.median(inproc):.3f} s"
        )
    (cli, inproc), (base_cli, base_inproc) = results.values()
    end_to_end = statistics.median(cli)
    print(
        f"ratio to baseline: end to end {end_to_end / statistics.median(base_cli):.2f}, "
        f"in-process {statistics.median(inproc) / statistics.median(base_inproc):.2f}"
    )
    print(
        f"target < {TARGET_S:.0f} s end to end: {'met' if end_to_end < TARGET_S else 'NOT met'} "
        f"({end_to_end / TARGET_S:.2f} of the budget)"
    )


if __name__ == "__main__":
    main()
