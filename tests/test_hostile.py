"""Hostile values in every string field of a site and a recipe: each is rejected with one line
naming the file and field, or rendered so that `bash -n` passes and running the script (with
the scheduler's tools stubbed at the process boundary) executes nothing that was injected,
carries no extra #SBATCH directive, exits 0 and reaches its last line: the stub srun logs the
task's launch. The sites' setup line sources a file the test creates, so the script does not
stop there. Each hostile script is also run with a failing srun, so the failure step after it
runs too: it must be started with exactly the site's interpreter words, handed srun's messages,
and inject nothing. `environment.python` is covered as a string and as a list of words."""

from __future__ import annotations

import copy
import re
import shlex
import stat
import subprocess
import sys
import time
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
# The scheduler's and the site's tools, stubbed at the process boundary: each logs its call
# (srun also the environment it was handed) and runs nothing it was given.
STUBS = ["srun", "sbatch", "module", "python", "apptainer", "singularity", "enroot"]
STUB = """#!/bin/sh
line=$(basename "$0")
for word in "$@"; do line="$line $word"; done
# one write: a step's srun and its standby's run at once
printf '%s\\n' "$line | MASTER_ADDR=$MASTER_ADDR MY_FLAG=$MY_FLAG HPCRUN_STANDBY=$HPCRUN_STANDBY" >>{log}
"""
# srun also keeps each call's exact words (NUL-separated, one file per call), and the failure
# step's stdin; the launch exits with {status} after srun's message for a failed task.
SRUN_STUB = (
    STUB
    + """call=$(mktemp {calls}/call.XXXXXX)
printf '%s\\0' "$@" >"$call"
case " $* " in
  *" -m hpcrun.runtime.failure "*) cat >"$call.stdin" ;;
  *" -m hpcrun.launch "*) if [ {status} -ne 0 ]; then \
echo "srun: error: node1: task 0: Exited with exit code {status}" >&2; exit {status}; fi ;;
esac
"""
)
# Site setup lines are the site's own shell by design: they are checked for newlines only.
SITE_SHELL = {"environment.setup"}
# What the test sites' setup line sources, relative to the script's directory: it logs that it ran.
ACTIVATE = "venv/bin/activate"


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


def run_script(script: str, tmp: Path, srun_status: int = 0, stubs: dict[str, str] | None = None) -> tuple[int, str]:
    """Run `script` as sbatch would start it, with stubs for the scheduler's and the site's
    tools on PATH (the launch srun exiting `srun_status`; `stubs`: others, or other texts, by name);
    (exit status, the stubs' call log)."""
    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    log = tmp / "calls.log"
    log.unlink(missing_ok=True)
    calls = tmp / "srun-calls"
    if calls.exists():
        for old in calls.iterdir():
            old.unlink()
    calls.mkdir(exist_ok=True)
    for name in STUBS:
        stub = bindir / name
        text = SRUN_STUB if name == "srun" else STUB
        stub.write_text(text.format(log=shlex.quote(str(log)), calls=shlex.quote(str(calls)), status=srun_status))
        stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    (bindir / "scontrol").write_text("#!/bin/sh\necho node1\n")
    (bindir / "scontrol").chmod(0o755)
    for name, text in (stubs or {}).items():
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    activate = tmp / ACTIVATE
    activate.parent.mkdir(parents=True, exist_ok=True)
    activate.write_text(f"echo setup >>{shlex.quote(str(log))}\n")
    path = tmp / "job.sh"
    path.write_text(script)
    env = {
        "PATH": f"{bindir}:/usr/bin:/bin",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_JOB_ID": "123",
        "SLURM_JOB_NUM_NODES": "1",
        "HPCRUN_LOCAL_JOB_ID": "123",
        "HOME": str(tmp),
    }
    out = subprocess.run(["bash", str(path)], env=env, cwd=tmp, capture_output=True, text=True, timeout=30)
    return out.returncode, (log.read_text() if log.exists() else "") + out.stderr


def srun_calls(tmp: Path) -> list[tuple[list[str], str | None]]:
    """Every srun call's exact words, and what it read on stdin (the failure step only)."""
    found = []
    for call in sorted((tmp / "srun-calls").glob("call.??????")):
        stdin = call.with_name(call.name + ".stdin")
        found.append((call.read_text().split("\0")[:-1], stdin.read_text() if stdin.exists() else None))
    return found


def python_words(site: dict[str, tp.Any]) -> list[str]:
    """The interpreter words the site names (a string is split as the shell would: the site
    model does so; hpcrun's own interpreter when it names none)."""
    python = site["environment"].get("python")
    return shlex.split(python) if isinstance(python, str) else list(python or [sys.executable])


def check_failure_step(tmp: Path, site: dict[str, tp.Any], what: str) -> None:
    """The failure step ran once, as srun's task, as the site's interpreter words exactly (each
    one word, whatever it holds), on the run directory and the step's status, with srun's
    messages on its stdin."""
    calls = srun_calls(tmp)
    steps = [(words, stdin) for words, stdin in calls if "hpcrun.runtime.failure" in words]
    launch = next(words for words, _ in calls if "hpcrun.launch" in words)  # the step's or its standby's: the same
    assert len(steps) == 1, f"{what}: {calls}"
    words, stdin = steps[0]
    python = python_words(site)
    expected = [*python, "-m", "hpcrun.runtime.failure", launch[-1], "1"]  # launch[-1]: the run directory
    assert words[-len(expected):] == expected, f"{what}: {words}"
    # inside the ranks' container: after srun's own options, the same words as the launch line's
    wrapper = words[: -len(expected)][5:]  # --overlap --nodes --ntasks --ntasks-per-node --nodelist
    launch_error = next(i for i, w in enumerate(launch) if w.startswith("--error="))
    assert wrapper == launch[launch_error + 1: -len(python) - 4], f"{what}: {words} vs {launch}"
    if site["environment"].get("container"):
        assert wrapper and wrapper[-1] == site["environment"]["container"]["image"], f"{what}: {words}"
    assert stdin == "srun: error: node1: task 0: Exited with exit code 1\n", f"{what}: {stdin!r}"


def launched(calls: str) -> bool:
    """The script reached its last command: srun started the task entry point."""
    return any(line.startswith("srun ") and "-m hpcrun.launch" in line for line in calls.splitlines())


def with_setup(site: dict[str, tp.Any], python: tp.Any = None) -> dict[str, tp.Any]:
    """A site whose setup line works in the test's directory (a shipped site's sources a
    virtualenv this machine lacks, and `set -e` would stop the script there)."""
    data = copy.deepcopy(site)
    if data["environment"].get("setup"):
        data["environment"]["setup"] = [f"source {ACTIVATE}"]
    if python is not None:
        data["environment"]["python"] = python
    return data


SITE = with_setup(load_yaml(ROOT / "sites" / "mycluster.yaml"))
SITE_WORDS = with_setup(SITE, python=["conda", "run", "-n", "ml", "python"])  # environment.python as a list
SITE_CONTAINER = with_setup(load_yaml(ROOT / "sites" / "slingshot.yaml"))
RECIPE = load_yaml(ROOT / "jobs" / "zero-infinity.yaml")
RECIPE["env"] = {"MY_FLAG": "value"}
QUICKSTART = load_yaml(ROOT / "jobs" / "quickstart.yaml")  # a container site has no NVMe for zero-infinity
CASES = (
    [("site", "mycluster", SITE, p) for p in leaves(SITE)]
    + [("site", "words", SITE_WORDS, p) for p in leaves(SITE_WORDS) if p.startswith("environment.python.")]
    + [
        ("site", "container", SITE_CONTAINER, p)
        for p in leaves(SITE_CONTAINER)
        if p.startswith(("environment.container", "environment.python"))
    ]
    + [("recipe", "zero-infinity", RECIPE, p) for p in leaves(RECIPE)]
)


@pytest.mark.parametrize("kind,base,field", [(k, b, f) for k, _, b, f in CASES], ids=[f"{c[1]}:{c[3]}" for c in CASES])
def test_hostile_value(kind: str, base: dict[str, tp.Any], field: str, tmp_path: Path) -> None:
    site = base if kind == "site" else SITE
    recipe = base if kind == "recipe" else (QUICKSTART if site is SITE_CONTAINER else RECIPE)
    baseline = cli(
        "render",
        "--site",
        str(write_yaml(tmp_path / "base-site.yaml", site)),
        "--run-id",
        "r1",
        str(write_yaml(tmp_path / "base-recipe.yaml", recipe)),
    )
    assert baseline.exit_code == 0, baseline.output
    expected = directives(baseline.stdout)
    status, calls = run_script(baseline.stdout, tmp_path)
    assert status == 0 and launched(calls), calls
    for n, payload in enumerate(PAYLOADS):
        mark = tmp_path / f"pwned{n}"
        data = copy.deepcopy(base)
        set_path(data, field, payload.format(mark=mark))
        site_file = write_yaml(tmp_path / f"site{n}.yaml", data if kind == "site" else site)
        recipe_file = write_yaml(tmp_path / f"recipe{n}.yaml", data if kind == "recipe" else recipe)
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
        status, calls = run_script(script, tmp_path)
        assert not mark.exists(), f"{field}={payload!r} executed an injected command"
        assert status == 0, f"{field}={payload!r}: the script exited {status}\n{calls}"
        assert launched(calls), f"{field}={payload!r}: the script stopped before its srun line\n{calls}"
        assert not [w for w, _ in srun_calls(tmp_path) if "hpcrun.runtime.failure" in w], (
            "failure step after a good step"
        )
        status, calls = run_script(script, tmp_path, srun_status=1)
        assert not mark.exists(), f"{field}={payload!r} executed an injected command (failed step)"
        assert status == 1 and launched(calls), (
            f"{field}={payload!r}: the failed step's script exited {status}\n{calls}"
        )
        check_failure_step(tmp_path, data if kind == "site" else site, f"{field}={payload!r}")


def test_setup_lines_reject_newlines(tmp_path: Path) -> None:
    data = load_yaml(ROOT / "sites" / "mycluster.yaml")
    data["environment"]["setup"] = ["echo ok\n#SBATCH --account=evil"]
    site = write_yaml(tmp_path / "s.yaml", data)
    result = cli("render", "--site", str(site), "jobs/quickstart.yaml")
    assert result.exit_code == 2
    assert "environment.setup.0: must be a single line" in result.output


@pytest.mark.parametrize(
    "site,recipe,launch",
    [
        (SITE, "zero-infinity", "srun --unbuffered --kill-on-bad-exit=0"),  # in-job restarts: the ranks end themselves
        (SITE_WORDS, "zero-infinity", "conda run -n ml python -u -m hpcrun.launch"),
        (
            SITE_CONTAINER,
            "quickstart",
            "apptainer exec --nv --bind /pscratch /global/common/images/pytorch.sif python -u -m hpcrun.launch",
        ),
    ],
    ids=["mycluster", "python-words", "container"],
)
def test_rendered_script_runs_every_line(site: dict[str, tp.Any], recipe: str, launch: str, tmp_path: Path) -> None:
    """The harness reaches the end of each kind of script: setup, modules, exports, the first
    node's name, the NVMe directory and the launch line all really execute."""
    data = load_yaml(ROOT / "jobs" / f"{recipe}.yaml")
    data["env"] = {"MY_FLAG": "value"}
    result = cli(
        "render",
        "--site",
        str(write_yaml(tmp_path / "s.yaml", site)),
        "--run-id",
        "r1",
        str(write_yaml(tmp_path / "r.yaml", data)),
    )
    assert result.exit_code == 0, result.output
    status, calls = run_script(result.stdout, tmp_path)
    assert status == 0, calls
    lines = calls.splitlines()
    assert any(line.startswith("module load ") for line in lines), calls
    assert ("setup" in lines) == (site is not SITE_CONTAINER), calls
    launches = [line for line in lines if "-m hpcrun.launch" in line]  # the two sruns run at once: either order
    (task,) = [line for line in launches if line.endswith("HPCRUN_STANDBY=")]
    assert task.startswith("srun ") and launch in task, task
    # the next attempt's ranks, waiting (fault.warm_standby, on by default with restarts in the job): the same
    # srun but for the step's name, the next attempt's (the watcher spares that one when it ends a step)
    (standby,) = [line for line in launches if line.endswith("HPCRUN_STANDBY=1")]
    names = [int(re.search(r"--job-name=hpcrun-attempt(\d+) ", line)[1]) for line in (task, standby)]
    assert names[1] == names[0] + 1, (task, standby)
    assert re.sub(r"--job-name=\S+ ", "", standby.rsplit("|", 1)[0]) == re.sub(
        r"--job-name=\S+ ", "", task.rsplit("|", 1)[0]), (standby, task)
    expected = "MASTER_ADDR=node1-ib" if site is not SITE_CONTAINER else "MASTER_ADDR=node1 "
    assert expected in task and "MY_FLAG=value" in task, task
    if recipe == "zero-infinity":
        assert any(
            line.startswith("srun ") and " mkdir -p /local/nvme/" in line and "/hpcrun-123 |" in line for line in lines
        ), calls
        assert " rm -rf /local/nvme/" in lines[-1], calls  # the EXIT trap


def test_injection_detector_works(tmp_path: Path) -> None:
    """The harness itself: an unquoted payload really does run, a failing line is seen, and a
    script that stops early is told apart, so a pass above means something."""
    mark = tmp_path / "pwned"
    status, calls = run_script(f"#!/bin/bash\nexport X=$(touch {mark})\nsrun python -u -m hpcrun.launch x\n", tmp_path)
    assert mark.exists() and status == 0 and launched(calls)
    status, calls = run_script(
        "#!/bin/bash\nset -e\nsource /nonexistent/activate\nsrun python -u -m hpcrun.launch x\n", tmp_path
    )
    assert status != 0 and not launched(calls)
    assert directives("#!/bin/bash\n#SBATCH --a=1\n#SBATCH --b\necho\n#SBATCH --c\n") == ["--a", "--b"]


def test_a_standby_dismissed_for_other_nodes_is_cancelled_by_its_own_name(tmp_path: Path) -> None:
    """The failed step's restart goes to other nodes (the failure step names node2: a lost node's
    spare), so the standby waiting beside it on node1 is dismissed: its srun killed and its step
    scancelled, found by its own name, hpcrun-attempt1, before the restart started cold on node2
    takes that name too; never the standby started beside the restart (hpcrun-attempt2), whose step
    the job's end leaves to SLURM (a scancel retried past a requeue would reach the next start's step
    of the same id)."""
    site = copy.deepcopy(SITE)  # the run directory (its starts file numbers the attempts) the test's own
    site["storage"]["runs_dir"] = str(tmp_path / "runs")
    result = cli("render", "--site", str(write_yaml(tmp_path / "s.yaml", site)), "--run-id", "r1",
                 str(write_yaml(tmp_path / "r.yaml", QUICKSTART)))
    assert result.exit_code == 0, result.output
    cancelled, moved, restarted = tmp_path / "scancel.log", tmp_path / "moved", tmp_path / "restarted"
    srun = f"""#!/bin/sh
case " $* " in
  *" -m hpcrun.runtime.failure "*)
    cat >/dev/null
    if [ ! -e {moved} ]; then : >{moved}; echo node2 >"$HPCRUN_NEXT_NODES"; fi ;;
  *" -m hpcrun.launch "*)
    if [ -n "$HPCRUN_STANDBY" ]; then cat >/dev/null; while :; do sleep 0.2; done; fi
    if [ -e {moved} ]; then : >{restarted}; fi
    echo "srun: error: node1: task 0: Exited with exit code 1" >&2; exit 1 ;;
esac
"""
    # SLURM's steps: the restart on node2, once started, is step 4 and has the dismissed standby's name; a
    # listing takes a moment (a restart started meanwhile is in it)
    squeue = f"""#!/bin/sh
sleep 0.5
printf '123.0,hpcrun-attempt0\\n123.1,hpcrun-attempt1\\n123.3,hpcrun-attempt2\\n'
[ ! -e {restarted} ] || echo 123.4,hpcrun-attempt1
"""
    stubs = {"srun": srun, "squeue": squeue, "scancel": f"#!/bin/sh\necho \"$*\" >>{cancelled}\n"}
    status, _ = run_script(result.stdout, tmp_path, srun_status=1, stubs=stubs)
    assert status == 1 and moved.exists(), status
    deadline = time.time() + 10  # the scancel runs in the background: the script does not wait for it
    while time.time() < deadline and not cancelled.exists():
        time.sleep(0.1)
    time.sleep(1)  # nothing more comes: the job's end leaves the last standby's step to SLURM
    said = cancelled.read_text().splitlines()
    assert said == ["--signal=KILL 123.1"], said
