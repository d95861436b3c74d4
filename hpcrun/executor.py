"""submitit's executor plugin over hpcrun: `submitit.AutoExecutor(folder, cluster="hpcrun")` or
`hpcrun.Executor(site="mycluster")` submits pickled Python calls as hpcrun runs.

Each call is a run under the site's runs directory (`hpcrun status/logs/results/cancel` know it)
whose recipe has a `function` job (hpcrun.runtime.function): the site's partition, account,
modules, container and interconnect environment, hpcrun's rendered script, its signals, requeue
and failure handling. A `map_array` (or a `batch()`) of several calls is one job array whose
task `i` runs the `i`-th call, throttled by `array_parallelism` (`%N`), like a sweep's arrays.

SlurmExecutor's parameters are mapped as submitit means them (FIELDS, SLURM_NAMES) or refused with
one line saying why (REFUSED). `max_num_timeout` bounds the requeues after a stop at the time
limit (`checkpoint.max_timeouts`); a preemption is requeued without counting against it, as
under submitit, while `checkpoint.max_requeues` (at most 4) still bounds every requeue. The
executor's `folder` holds links to each call's logs and results (HpcrunExecutor).

The plugin's parts are submitit's documented interface (docs/plugins.md): an Executor with
`_internal_process_submissions`, `_convert_parameters` and `_valid_parameters`, the Job classes
(SLURM's own for SLURM jobs, LocalJob for the local controller), and a JobEnvironment. Nothing
here imports torch: it runs on a login node and in notebooks.
"""

from __future__ import annotations

import os
import re
import typing as tp
import warnings
from pathlib import Path

from submitit.core import core
from submitit.core.job_environment import JobEnvironment
from submitit.core.utils import DelayedSubmission, JobPaths
from submitit.slurm.slurm import SlurmJob

from hpcrun import backend, slurm
from hpcrun.errors import HpcrunError
from hpcrun.fields import TOKEN_RE
from hpcrun.plan import RunSpec, new_run_id, plan
from hpcrun.recipe import apply_overrides, parse_recipe
from hpcrun.rundir import LOGS, RunDir, atomic_path, sweep_dir
from hpcrun.site import Site, load_site
from hpcrun.status import controller_alive

NAME = "hpcrun"  # the plugin's name: what submitit.JobEnvironment() recognises (SUBMITIT_EXECUTOR)
DEFAULT_JOB_NAME = "submitit"  # submitit's own default job name

# The parameters this executor takes (submitit's shared names, then hpcrun's own) and the recipe
# field each sets. Through AutoExecutor the second group is prefixed `hpcrun_` (submitit ignores
# another cluster's prefix, `slurm_` included); hpcrun.Executor also takes SlurmExecutor's names.
FIELDS = {
    "name": "name",
    "timeout_min": "resources.time",
    "nodes": "resources.nodes",
    "tasks_per_node": "resources.gpus_per_node",
    "gpus_per_node": "resources.gpus_per_node",
    "cpus_per_task": "resources.cpus_per_task",
    "mem_gb": "resources.mem_gb",
    "partition": "resources.partition",
    "signal_delay_s": "checkpoint.signal_lead_s",
    "max_num_timeout": "checkpoint.max_timeouts",
    "array_parallelism": "",  # the array's `%N`, no recipe field
    "dependency": "",  # sbatch's --dependency (`afterok:<job id>`), no recipe field
    "recipe": "",  # any other recipe fields, as a dict (env, checkpoint, fault, ...)
}
# SlurmExecutor's spellings. Not valid under AutoExecutor (`hpcrun_mem`): submitit maps an
# unprefixed name any executor takes onto that executor's prefix, and would send a SLURM user's `mem` here
SLURM_NAMES = {"time": "timeout_min", "job_name": "name", "ntasks_per_node": "tasks_per_node",
               "num_gpus": "gpus_per_node", "mem": "mem_gb"}
# SlurmExecutor's parameters whose value here can only be what hpcrun does anyway: that value is accepted
AS_HPCRUN: dict[str, object] = {"stderr_to_stdout": False, "use_srun": True, "gpus_per_task": 1}
SITE_SBATCH = "extra #SBATCH lines are the site profile's `environment.sbatch` (sites/<name>.yaml)"
PER_NODE = "hpcrun asks for memory per node: use mem_gb (or mem), sent as --mem"
# what cannot map, and why: a refusal names the parameter instead of dropping it silently
REFUSED = {
    "mem_per_gpu": PER_NODE,
    "mem_per_cpu": PER_NODE,
    "cpus_per_gpu": "hpcrun runs one rank per GPU: use cpus_per_task",
    "gpus_per_task": "hpcrun gives each rank one GPU (gpus_per_task=1): use gpus_per_node",
    "gres": "the site's partition `gpu_request` asks for the GPUs gpus_per_node says",
    "stderr_to_stdout": "hpcrun keeps each rank's stdout and stderr apart (job.stdout(), job.stderr())",
    "account": "the site profile's `account` is used (sites/<name>.yaml)",
    "qos": "the site profile's `qos` is used (sites/<name>.yaml)",
    "constraint": "the site profile's partition `constraint` is used (sites/<name>.yaml)",
    "setup": "the site profile's `modules` and `environment` set up the job (sites/<name>.yaml)",
    "teardown": "hpcrun's script owns what runs after the ranks (its failure step and requeue)",
    "additional_parameters": SITE_SBATCH,
    "exclusive": SITE_SBATCH,
    "mail_type": SITE_SBATCH,
    "mail_user": SITE_SBATCH,
    "wckey": SITE_SBATCH,
    "comment": "hpcrun's --comment tags the job with its submission (how a lost sbatch answer is found)",
    "exclude": "hpcrun sets the job's excluded nodes itself: those that failed the run (fault.exclude_failed_nodes)",
    "nodelist": "hpcrun places the ranks, on the nodes SLURM gives and spares for lost ones (resources.spare_nodes)",
    "srun_args": "hpcrun's template owns the srun line",
    "use_srun": "hpcrun always starts one task per rank with srun",
}
SIZE = re.compile(r"^(\d+(?:\.\d+)?)([KMGT]?)B?$", re.IGNORECASE)


def _canonical(key: str) -> str:
    key = key[len("slurm_"):] if key.startswith("slurm_") else key
    return SLURM_NAMES.get(key, key)


def _gigabytes(value: tp.Any, key: str) -> float:
    """SLURM's `--mem` spelling (`16G`, `500M`, `16GB`; a bare number is megabytes) in GB."""
    found = SIZE.match(str(value).strip()) if not isinstance(value, bool) else None
    if found is None:
        raise HpcrunError(f"must be a size such as 16G or 500M (got {value!r})", field=key)
    scale = {"K": 1 / 1024**2, "M": 1 / 1024, "": 1 / 1024, "G": 1, "T": 1024}[found[2].upper()]
    return float(found[1]) * scale


class HpcrunExecutor(core.Executor):
    """A submitit executor that submits through hpcrun's site `site` (a name on the site search
    path or a YAML path); `recipe` holds any other recipe fields, `max_num_timeout` is submitit's
    (also a parameter).

    Files. A call's files live in its run directory, which hpcrun owns: `job.paths.folder` is the
    run's logs/ (an array's shared log folder), where `<job>_<task>_log.out/.err` and
    `<job>_<task>_result.pkl` are written. The `folder` given here (`%j` and the like formatted
    as submitit does) gets links under submitit's names to them, made at submission: the
    tasks' logs and results, `<job>_submitted.pkl` (the call) and `<job>_submission.sh` (the
    script hpcrun submitted). Without a folder (hpcrun.Executor's default), none are made."""

    def __init__(
        self, folder: str | Path | None = None, site: str = "local", recipe: dict[str, tp.Any] | None = None,
        max_num_timeout: int | None = None,
    ) -> None:
        self.site: Site = load_site(site)
        super().__init__(folder if folder is not None else self.site.storage.runs_dir)
        # where links to each call's files go (`_show`): the folder a user gave, not the runs directory
        runs_dir = Path(self.site.storage.runs_dir).expanduser().absolute()
        self.links = self.folder if folder is not None and self.folder != runs_dir else None
        self.parameters = {}
        self._spelled: dict[str, str] = {}  # each parameter as the user spelled it: errors name that
        given = {k: v for k, v in (("recipe", recipe), ("max_num_timeout", max_num_timeout)) if v is not None}
        self._internal_update_parameters(**given)

    @classmethod
    def name(cls) -> str:
        return NAME

    @classmethod
    def affinity(cls) -> int:
        """Available, but used only when asked for (cluster="hpcrun"): never AutoExecutor's guess."""
        return 0

    @classmethod
    def _valid_parameters(cls) -> set[str]:
        return set(FIELDS)

    def _convert_parameters(self, params: dict[str, tp.Any]) -> dict[str, tp.Any]:
        return {_canonical(key): value for key, value in params.items()}

    def _internal_update_parameters(self, **kwargs: tp.Any) -> None:
        """Check every parameter now, as submitit does: one that cannot map is refused by name."""
        update, spelled = {}, {}
        for key, value in kwargs.items():
            name = _canonical(key)
            if name in REFUSED:
                if name in AS_HPCRUN and value == AS_HPCRUN[name] and type(value) is type(AS_HPCRUN[name]):
                    spelled[name] = key  # gpus_per_task=1 still asks for GPUs: a CPU partition refuses it
                    continue
                raise HpcrunError(f"cannot be mapped onto an hpcrun recipe: {REFUSED[name]}", field=key)
            if name not in FIELDS:
                raise HpcrunError(f"unknown parameter; the hpcrun executor takes {', '.join(sorted(FIELDS))}",
                                  field=key)
            if name == "recipe" and not isinstance(value, dict):
                raise HpcrunError(f"must be a dict of recipe fields (got {type(value).__name__})", field=key)
            if name == "array_parallelism" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise HpcrunError(f"must be a whole number >= 1 (got {value!r})", field=key)
            if name == "dependency":
                if self.site.scheduler == "local":
                    raise HpcrunError("the local site starts each call at once: no dependencies", field=key)
                if not isinstance(value, str) or not TOKEN_RE.match(value):
                    raise HpcrunError(f"must be one sbatch --dependency value, e.g. afterok:123 (got {value!r})",
                                      field=key)
            if key.removeprefix("slurm_") == "mem":  # SLURM's spelling of a size
                value = _gigabytes(value, key)
            update[name], spelled[name] = value, key
        self.parameters.update(update)
        self._spelled.update(spelled)

    def _internal_process_submissions(self, delayed_submissions: list[DelayedSubmission]) -> list[core.Job[tp.Any]]:
        """One run per call; several calls on SLURM are one job array."""
        if len(delayed_submissions) == 1 or self.site.scheduler == "local":
            return [self._submit_one(delayed) for delayed in delayed_submissions]
        return self._submit_array(delayed_submissions)

    def _name(self) -> str:
        return str(self.parameters.get("name") or DEFAULT_JOB_NAME)

    def _recipe(self, folder: Path | None) -> dict[str, tp.Any]:
        """The recipe the parameters describe, as data (validated by the planner)."""
        params = dict(self.parameters)
        gpus, tasks = params.pop("gpus_per_node", None), params.pop("tasks_per_node", None)
        if gpus and tasks and gpus != tasks:
            raise HpcrunError(f"hpcrun runs one rank per GPU: must equal tasks_per_node ({tasks}) (got {gpus})",
                              field="gpus_per_node")
        if gpus and tasks is None:
            tasks = gpus
        overrides = {FIELDS[k]: v for k, v in params.items() if FIELDS[k] and k != "name"}
        if tasks is not None:
            overrides["resources.gpus_per_node"] = tasks
        data = apply_overrides(dict(params.get("recipe") or {}), overrides)
        data["name"] = self._name()
        data["job"] = {"kind": "function", "folder": str(folder) if folder else None}
        # a failed call fails its job, as under submitit: not run again inside it unless asked
        fault = data["fault"] = dict(data.get("fault") or {})
        fault.setdefault("restarts_in_job", 0)
        return data

    def _spec_for(self, folder: Path | None, run_id: str, **ids: tp.Any) -> RunSpec:
        """The run of one call, planned on the site; a value the site cannot give is refused
        naming the parameter that asked for it."""
        where = Path.cwd() / f"{self._name()}.{NAME}-executor"  # errors name it; its directory's git commit is kept
        try:
            recipe = parse_recipe(self._recipe(folder), where).base
            part = recipe.resources.partition or self.site.default_partition
            asked = "gpus_per_node" if self.parameters.get("gpus_per_node") else "gpus_per_task"
            partition = self.site.partitions.get(part)
            if asked in self._spelled and partition is not None and not partition.gpus_per_node:
                raise HpcrunError(f"partition {part!r} has no GPUs (its ranks are CPU processes: use tasks_per_node)",
                                  field=self._spelled[asked])
            return plan(self.site, recipe, where, run_id, **ids)
        except HpcrunError as exc:
            raise _by_parameter(exc, self.parameters, self._spelled) from None

    def _submit_one(self, delayed: DelayedSubmission) -> core.Job[tp.Any]:
        spec = self._spec_for(None, new_run_id(self._name()))
        run_dir = RunDir(backend.prepare_run(spec))
        _dump(delayed, spec)
        job_id = backend.submit(spec, self.parameters.get("dependency"))
        return self._job(spec, run_dir.logs, job_id)

    def _submit_array(self, delayed_submissions: list[DelayedSubmission]) -> list[core.Job[tp.Any]]:
        array_id = new_run_id(self._name())
        log_folder = sweep_dir(self.site.storage.runs_dir, array_id) / LOGS
        specs = [
            self._spec_for(log_folder, f"{array_id}.{i}", sweep_id=array_id, point_id=str(i))
            for i in range(len(delayed_submissions))
        ]
        for spec, delayed in zip(specs, delayed_submissions):
            _dump(delayed, spec)
        job_ids = backend.submit_array(specs, log_folder, self.parameters.get("array_parallelism"),
                                       backend.array_tag(specs), self.parameters.get("dependency"))
        return [self._job(spec, log_folder, job_id) for spec, job_id in zip(specs, job_ids)]

    def _job(self, spec: RunSpec, folder: Path, job_id: str) -> core.Job[tp.Any]:
        tasks = list(range(spec.nodes * spec.tasks_per_node))
        job: core.Job[tp.Any]
        job = LocalJob(folder, job_id, tasks) if spec.scheduler == "local" else SlurmJob(folder, job_id, tasks)
        if not job.paths.submitted_pickle.exists():  # job.submission() reads the call from there
            job.paths.submitted_pickle.symlink_to(RunDir(spec.run_dir).function)
        if self.links is not None:
            self._show(spec, folder, job_id, tasks)
        return job

    def _show(self, spec: RunSpec, folder: Path, job_id: str, tasks: list[int]) -> None:
        """The call's files where a submitit user looks for them, in the folder given to the
        executor (`%j` and the like formatted as submitit does): links named as submitit names
        its files, to the run's (its logs and results appear as the job writes them). A failure
        here is a warning: the job is submitted already, and this returns its handle."""
        assert self.links is not None
        run_dir = RunDir(spec.run_dir)
        links = {JobPaths(self.links, job_id).submitted_pickle: run_dir.function,
                 JobPaths(self.links, job_id).submission_file: run_dir.script}
        for task in tasks:
            mine, theirs = JobPaths(self.links, job_id, task), JobPaths(folder, job_id, task)
            links.update({mine.stdout: theirs.stdout, mine.stderr: theirs.stderr,
                          mine.result_pickle: theirs.result_pickle})
        try:
            for link, target in links.items():
                _link(link, target)
        except OSError as exc:
            warnings.warn(f"{self.links}: no links to job {job_id}'s files ({exc.strerror}): they are in {folder}",
                          stacklevel=2)


def _link(link: Path, target: Path) -> None:
    """`link` to `target`, replacing a link of that name (local job ids are process ids, which
    come again) but never a file: a user's own file stays."""
    if link.exists() and not link.is_symlink():
        return
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)


def _dump(delayed: DelayedSubmission, spec: RunSpec) -> None:
    """The call into its run directory, carrying its limits as submitit's own executors set them."""
    caps = spec.recipe.checkpoint
    delayed.set_timeout(spec.time_min, caps.max_requeues if caps.max_timeouts is None else caps.max_timeouts)
    run_dir = RunDir(spec.run_dir)
    with atomic_path(run_dir.function) as tmp:
        delayed.dump(tmp)


def _by_parameter(exc: HpcrunError, parameters: dict[str, tp.Any], spelled: dict[str, str]) -> HpcrunError:
    """A planner's refusal of a recipe field, said of the executor parameter that set it (as the
    user spelled it: `mem`, `slurm_partition`)."""
    for name, field in FIELDS.items():
        if field and exc.field == field and name in parameters:
            prefix = ": ".join(p for p in (exc.file, exc.field) if p)
            return HpcrunError(exc.message[len(prefix) + 2:], field=spelled.get(name, name))
    return exc


class LocalJob(core.Job[core.R]):
    """A call run by hpcrun's local controller (`--site local`): done when its result is written
    or its controller has exited. Its folder is the run's logs/, so the run is the folder's parent."""

    class Watcher(core.InfoWatcher):
        """No scheduler to ask: LocalJob answers from the controller's process itself."""

        def _make_command(self) -> list[str] | None:
            return None

        def get_state(self, job_id: str, mode: str = "standard") -> str:
            return "UNKNOWN"

    watcher = Watcher()

    @property
    def run_dir(self) -> Path:
        return self.paths.folder.parent

    def done(self, force_check: bool = False) -> bool:
        if self._sub_jobs:
            return all(sub_job.done() for sub_job in self._sub_jobs)
        return self.paths.result_pickle.exists() or not controller_alive(self.job_id, self.run_dir)

    @property
    def state(self) -> str:
        if controller_alive(self.job_id, self.run_dir):
            return "RUNNING"
        return str(RunDir(self.run_dir).state().get("status") or "UNKNOWN").upper()

    def get_info(self, mode: str = "force") -> dict[str, str]:
        return {"State": self.state}

    def cancel(self, check: bool = True) -> None:
        """hpcrun's cancel: SIGTERM to the controller, which the ranks get as on SLURM."""
        from hpcrun.cancel import cancel

        try:
            cancel(self.run_dir)
        except HpcrunError:
            if check:
                raise


class HpcrunJobEnvironment(JobEnvironment):
    """What `submitit.JobEnvironment()` answers inside an hpcrun function job: the ranks hpcrun
    gave the task (hpcrun.runtime.env), under SLURM and under the local controller alike."""

    _env: tp.ClassVar[dict[str, str]] = {
        "job_id": "HPCRUN_JOB_ID",  # SLURM's spelling, `<array>_<index>` for an array task
        "num_tasks": "WORLD_SIZE",
        "num_nodes": "SLURM_STEP_NUM_NODES",  # the step's, not the job's: spares take no part
        "node": "SLURM_NODEID",
        "global_rank": "RANK",
        "local_rank": "LOCAL_RANK",
    }

    def activated(self) -> bool:
        return os.environ.get("SUBMITIT_EXECUTOR", "") == NAME

    @property
    def hostnames(self) -> list[str]:
        """The step's nodes, the first spelled as the script's MASTER_ADDR (its high-speed name):
        submitit's TorchDistributedEnvironment meets there, where hpcrun's own jobs meet."""
        node_list = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
        nodes = slurm.run(slurm.hostnames(node_list)).stdout.split() if node_list else []
        return [os.environ.get("MASTER_ADDR", self.hostname), *nodes[1:]]

    def _requeue(self, countdown: int) -> None:
        """Never called: hpcrun requeues a stopped function job itself (hpcrun.runtime.function)."""
