"""Shared fixtures: the repo root on the site search path, and a hostile temp directory."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Tests run from the repo root so `sites/` is found, with no user site dirs leaking in, and
    each with its own shared-answers cache (hpcrun.pollcache): a faked sacct's answer must never
    reach another test, and a test's job ids never another's."""
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("HPCRUN_SITES", raising=False)
    monkeypatch.setenv("HPCRUN_CACHE_DIR", str(tmp_path / "pollcache"))


def cluster_up() -> str | None:
    """None when the real test cluster answers, else why not (shown as the skip reason)."""
    if shutil.which("sbatch") is None:
        return "sbatch not installed (run tests/cluster/testcluster.sh up)"
    try:
        out = subprocess.run(["sinfo", "-h", "-p", "batch", "-o", "%t %D"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"sinfo failed: {exc}"
    if out.returncode != 0 or "idle" not in out.stdout and "mix" not in out.stdout and "alloc" not in out.stdout:
        said = out.stdout.strip() or out.stderr.strip()
        return f"test cluster not up (sinfo: {said}); run tests/cluster/testcluster.sh up"
    return None


@pytest.hookimpl(trylast=True)  # after `-m` deselected: a run of no cluster test needs no cluster
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # `beside_cluster` tests first: long, and in CI run by the cluster tests' workers, not left for the end
    items.sort(key=lambda item: "beside_cluster" not in item.keywords)
    if not any("cluster" in item.keywords for item in items):
        return
    reason = cluster_up()
    if reason is None:
        return
    if os.environ.get("HPCRUN_REQUIRE_CLUSTER"):
        raise pytest.UsageError(f"HPCRUN_REQUIRE_CLUSTER is set but {reason}")
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "cluster" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """In CI (HPCRUN_REQUIRE_CLUSTER) a skipped test is a failure: nothing skipped counts as passed."""
    if not os.environ.get("HPCRUN_REQUIRE_CLUSTER") or hasattr(session.config, "workerinput"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if skipped and session.exitstatus == 0:
        reporter.write_sep(
            "=", f"HPCRUN_REQUIRE_CLUSTER: {len(skipped)} test(s) skipped, which CI counts as failed", red=True
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
