"""The Python API (hpcrun.api): the README's example, run as written, on the local site."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from hpcrun import api
from hpcrun.errors import HpcrunError
from tests.helpers import ROOT
from tests.test_report import check_report_of_real_runs


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## From Python\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL)[1]  # type: ignore[index]


@pytest.mark.slow
def test_the_readme_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As a user runs it: the local site's runs and results under ~/hpcrun (here a fresh HOME).
    Its two runs (ddp, fsdp) are also those `hpcrun report` is checked on (tests/test_report.py)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(readme_example(), "README.md", "exec"), {})  # noqa: S102 - the README's own example
    out = printed.getvalue()
    assert re.search(r"-api-ddp COMPLETED 20\n", out) and re.search(r"-api-fsdp COMPLETED 20\n", out), out
    assert "ddp" in out.split("final_loss", 1)[1] and "fsdp" in out.split("final_loss", 1)[1], out
    runs = api.runs("local")
    assert sorted(r.run_id.rsplit("-", 1)[1] for r in runs) == ["ddp", "fsdp"]
    assert len(api.steps("local", run_id=[r.run_id for r in runs])) == 40
    ended = runs[0]
    with pytest.raises(HpcrunError, match="had already ended"):
        ended.cancel()
    check_report_of_real_runs("local", tmp_path / "report")  # the page and `results --compare` of these two runs


def test_a_dict_recipe_is_checked_like_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))  # the local site's runs directory (~/hpcrun/runs)
    with pytest.raises(HpcrunError) as caught:
        api.submit({"name": "bad", "resources": {"nodes": 0}}, site="local", dry_run=True)
    assert caught.value.format_message().startswith(f"{tmp_path / 'bad.yaml'}: resources.nodes:")
    [run] = api.submit({"name": "dry"}, site=str(ROOT / "sites" / "local.yaml"), dry_run=True)
    assert run.job_id is None and (run.path / "script.sh").exists()
    with pytest.raises(HpcrunError, match="no job was submitted"):
        run.wait(timeout=1)
