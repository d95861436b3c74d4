"""RunSpec -> the sbatch (or local) script. The text returned here is what is submitted."""

from __future__ import annotations

import functools
import shlex
import sys
from pathlib import Path

import jinja2

from hpcrun import __version__, rundir, slurm
from hpcrun.fields import format_minutes
from hpcrun.plan import RunSpec
from hpcrun.site import shipped_dirs

# How long a failed training step may outlive its first failed task before the batch script ends
# srun: srun waits for every task's end, and a lost node's tasks never report one.
STEP_GRACE_S = 5
# while a rank that outlived the failed one still saves its state (rundir.SAVING), up to this long: a 1.3b
# model's DDP state (15.6 GB) took 12.6 s on an H200 (benchmarks/survivor_save.py, RESULTS.md §7b)
SAVE_GRACE_S = 60
STEP_NAME = "hpcrun-attempt"  # and the attempt's number: a training step's name, so a watcher spares the next one
PROBE_NAME = "hpcrun-probe"  # a node probe's step: a watcher ending a step spares the probes still asking


def quote(value: object) -> str:
    """The one quoting filter: every value from YAML that reaches the shell passes here."""
    return shlex.quote(str(value))


@functools.lru_cache(maxsize=8)
def environment(extra_dir: str | None) -> jinja2.Environment:
    dirs = ([extra_dir] if extra_dir else []) + [str(d) for d in shipped_dirs("templates")]
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(dirs),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["q"] = quote
    return env


def sbatch_mem(gigabytes: float | None) -> str | None:
    """`--mem`'s value for memory per node in GB (SLURM's G is 1024 M), as submitit writes it."""
    if gigabytes is None:
        return None
    # never 0 (SLURM's "all of the node's memory") for a fraction of a megabyte
    return f"{int(gigabytes)}G" if gigabytes == int(gigabytes) else f"{max(1, int(gigabytes * 1024))}M"


def python_command(spec: RunSpec) -> str:
    """How a task starts Python: the site's interpreter (e.g. inside a container) or the one
    running hpcrun, which is what submitit does by default. Each word is quoted: the site's
    interpreter is data, not shell code."""
    return " ".join(quote(word) for word in spec.site.environment.python or [sys.executable])


def launch_command(spec: RunSpec) -> str:
    """What each task runs: hpcrun's entry point on the run directory held in the script's
    `$run_dir` (one per script, or picked by the array task's index)."""
    return f'{python_command(spec)} -u -m hpcrun.launch "$run_dir"'


def template_name(spec: RunSpec) -> tuple[str | None, str]:
    """(extra search dir, template file) for the site: its own template or the shipped one."""
    if spec.site.template:
        path = Path(spec.site.template)
        if not path.is_absolute():
            path = Path(spec.site.source).parent / path
        return str(path.parent), path.name
    return None, "local.sh.j2" if spec.site.scheduler == "local" else "sbatch.sh.j2"


def render(spec: RunSpec) -> str:
    """The script for one run, tagged with its run id (hpcrun.backend looks a lost submission up by it)."""
    return _render(spec, None, [spec.run_dir], spec.log_folder, spec.run_id)


def render_array(specs: list[RunSpec], array: str, log_folder: Path, tag: str) -> str:
    """The one script of a job array (`array` is `0-N%M`) tagged `tag`: task `i` runs `specs[i]`,
    whose run directory the script lists, so the submitted file says exactly what each task runs.
    Every spec must render to the same `array_key`."""
    return _render(specs[0], array, [s.run_dir for s in specs], log_folder, tag)


def array_key(spec: RunSpec) -> str:
    """The text of the array script `spec` would share, without the list of points: sweep
    points with the same key can be one array, whatever fields they differ in. The array and
    its log folder are placeholders: a sweep's arrays share one log folder."""
    return _render(spec, "ARRAY", [], Path("LOGS"), "TAG")


def _render(spec: RunSpec, array: str | None, run_dirs: list[str], log_folder: Path, tag: str) -> str:
    extra, name = template_name(spec)
    template = environment(extra).get_template(name)
    site = spec.site
    part = spec.partition_spec
    return template.render(
        version=__version__,
        spec=spec,
        site=site,
        partition=part,
        recipe=spec.recipe,
        time=format_minutes(spec.time_min),
        gpu_directive=part.gpu_directive(spec.gpus_per_node),
        mem=sbatch_mem(spec.recipe.resources.mem_gb),
        constraint=part.constraint,
        env=spec.env,
        container=site.environment.container,
        command=launch_command(spec),
        python=python_command(spec),
        run_dirs=run_dirs,
        log_folder=str(log_folder),
        array=array,
        job_pattern="%A_%a" if array else "%j",
        nvme_dir=spec.nvme_dir,
        snapshot_dir=spec.local_scratch if spec.takes_snapshots else None,  # every strategy: one array shape
        snapshot_name=rundir.snapshot_job_name("$SLURM_JOB_ID", "${SLURM_RESTART_COUNT:-0}"),
        hostname=site.network.hostname,
        comment=slurm.comment(tag),
        starts_dir=rundir.STARTS,
        step_grace_s=STEP_GRACE_S,
        # the ranks that outlive a failed one keep their state before they exit (hpcrun.runtime.snapshotsurvivor):
        # srun must not kill them at once; the watcher ends the step step_grace_s after a task failed
        # (whatever the strategy: a sweep's points of one shape share one array script; only DDP's keep any)
        survivors_keep=spec.takes_snapshots and spec.recipe.job.kind != "function",
        save_grace_s=SAVE_GRACE_S,
        # the next attempt's ranks started early (fault.warm_standby), for restarts in the job
        standby=spec.recipe.fault.restarts_in_job > 0 and spec.recipe.fault.warm_standby,
        standby_env=slurm.STANDBY_ENV,
        warm=slurm.STANDBY_WARM,
        go=slurm.STANDBY_GO,
        exit_word=slurm.STANDBY_EXIT,
        step_name=STEP_NAME,
        probe_name=PROBE_NAME,
        progress=rundir.PROGRESS,
        exits=rundir.EXITS,
        saving_suffix=rundir.SAVING,
        silent_suffix=rundir.SILENT,
        srun_ended=slurm.SRUN_ENDED,
        probe_s=slurm.PROBE_S,
        proxied=slurm.PROXIED,
        tool_timeout_s=slurm.TIMEOUT_S,
    )
