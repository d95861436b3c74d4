"""Hostile values in every string field of a site and a recipe: each is rejected with one line
naming the file and field, or rendered so that `bash -n` passes and running the script (with
the scheduler's tools stubbed at the process boundary) executes nothing that was injected and
carries no extra #SBATCH directive."""

from __future__ import annotations

import stat
import subprocess
import typing as tp
from pathlib import Path

import pytest

from tests.helpers import ROOT, cli, load_yaml, write_yaml

PAYLOADS = [
    'x"; touch {mark}; echo "',
    "x'; touch {mark}; echo '",
    "$(touch {mark})",
    "`touch {mark}`",
    "x\n#SBATCH --account=evil\ntouch {mark}",
    "x;touch {mark}",
    "--account=evil #SBATCH --qos=evil",
]
STUBS = ["srun", "module", "python", "apptainer", "singularity", "mkdir-never"]
# Site setup lines are the site's own shell by design: they are checked for newlines only.
SITE_SHELL = {"environment.setup"}


def leaves(data: tp.Any, prefix: str = "") -> list[str]:
    """Dotted paths of every string leaf (list items included)."""
    if isinstance(data, dict):
        return [p for k, v in data.items() for p in leaves(v, f"{prefix}{k}.")]
    if isinstance(data, list):
        return [p for i, v in enumerate(data) for p in leaves(v, f"{prefix}{i}.")]
    return [prefix[:-1]] if isinstance(data, str) else []


def set_path(data: tp.Any, dotted: str, value: str) -> None:
    keys = dotted.split(".")
    for key in keys[:-1]:
        data = data[int(key)] if isinstance(data, list) else data[key]
    last = keys[-1]
    if isinstance(data, list):
        data[int(last)] = value
    else:
        data[last] = value


def directives(script: str) -> list[str]:
    """#SBATCH option names as sbatch reads them: header lines until the first command."""
    names = []
    for line in script.splitlines()[1:]:
        if line.startswith("#SBATCH"):
            names.append(line.split()[1].split("=")[0])
        elif line.strip() and not line.startswith("#"):
            break
    return names


def run_script(script: str, tmp: Path) -> None:
    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    for name in STUBS:
        stub = bindir / name
        stub.write_text("#!/bin/sh\nexit 0\n")
        stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    (bindir / "scontrol").write_text("#!/bin/sh\necho node1\n")
    (bindir / "scontrol").chmod(0o755)
    path = tmp / "job.sh"
    path.write_text(script)
    env = {
        "PATH": f"{bindir}:/usr/bin:/bin",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_JOB_ID": "123",
        "SLURM_JOB_NUM_NODES": "1",
        "SUBMITIT_LOCAL_JOB_ID": "123",
        "HOME": str(tmp),
    }
    subprocess.run(["bash", str(path)], env=env, cwd=tmp, capture_output=True, timeout=30)


SITE = load_yaml(ROOT / "sites" / "mycluster.yaml")
SITE_CONTAINER = load_yaml(ROOT / "sites" / "slingshot.yaml")
RECIPE = load_yaml(ROOT / "jobs" / "zero-infinity.yaml")
RECIPE["env"] = {"MY_FLAG": "value"}
CASES = (
    [("site", SITE, p) for p in leaves(SITE)]
    + [("site", SITE_CONTAINER, p) for p in leaves(SITE_CONTAINER) if "container" in p]
    + [("recipe", RECIPE, p) for p in leaves(RECIPE)]
)


@pytest.mark.parametrize("kind,base,field", CASES, ids=[f"{k}:{p}" for k, b, p in CASES])
def test_hostile_value(kind: str, base: dict[str, tp.Any], field: str, tmp_path: Path) -> None:
    baseline_site = write_yaml(tmp_path / "base-site.yaml", {**base, "name": "hostile"} if kind == "site" else SITE)
    baseline = cli("render", "--site", str(baseline_site), "--run-id", "r1", str(ROOT / "jobs" / "zero-infinity.yaml"))
    if kind == "site" and "container" in base.get("environment", {}):
        baseline = cli("render", "--site", str(baseline_site), "--run-id", "r1", str(ROOT / "jobs" / "quickstart.yaml"))
    assert baseline.exit_code == 0, baseline.output
    expected = directives(baseline.stdout)
    for n, payload in enumerate(PAYLOADS):
        mark = tmp_path / f"pwned{n}"
        data = load_yaml(write_yaml(tmp_path / "copy.yaml", base))
        set_path(data, field, payload.format(mark=mark))
        site_file = write_yaml(tmp_path / f"site{n}.yaml", data if kind == "site" else SITE)
        recipe_file = write_yaml(tmp_path / f"recipe{n}.yaml", data if kind == "recipe" else (RECIPE if "container" not in str(field) else load_yaml(ROOT / "jobs" / "quickstart.yaml")))
        result = cli("render", "--site", str(site_file), "--run-id", "r1", str(recipe_file))
        if result.exit_code != 0:
            assert result.exit_code == 2, result.output
            lines = result.output.strip().splitlines()
            assert len(lines) == 1 and "Traceback" not in result.output, result.output
            assert str(site_file if kind == "site" else recipe_file) in lines[0], lines[0]
            continue
        script = result.stdout
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)
        assert directives(script) == expected, f"{field}={payload!r} changed the #SBATCH header"
        if any(field.startswith(s) for s in SITE_SHELL):
            continue
        run_script(script, tmp_path)
        assert not mark.exists(), f"{field}={payload!r} executed an injected command"


def test_setup_lines_reject_newlines(tmp_path: Path) -> None:
    data = load_yaml(ROOT / "sites" / "mycluster.yaml")
    data["environment"]["setup"] = ["echo ok\n#SBATCH --account=evil"]
    site = write_yaml(tmp_path / "s.yaml", data)
    result = cli("render", "--site", str(site), "jobs/quickstart.yaml")
    assert result.exit_code == 2
    assert "environment.setup.0: must be a single line" in result.output


def test_injection_detector_works(tmp_path: Path) -> None:
    """The harness itself: an unquoted payload really does run, so a pass above means something."""
    mark = tmp_path / "pwned"
    run_script(f"#!/bin/bash\nexport X=$(touch {mark})\n", tmp_path)
    assert mark.exists()
    assert directives("#!/bin/bash\n#SBATCH --a=1\n#SBATCH --b\necho\n#SBATCH --c\n") == ["--a", "--b"]
