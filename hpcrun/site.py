"""Site profiles: what a cluster is (partitions, GPUs, network, storage, environment).

A site is data: syntax that differs between clusters (how GPUs are requested, how the fast
hostname is spelled, which NCCL variables the fabric needs) lives in the YAML, never in an
`if cluster == ...` here.
"""

from __future__ import annotations

import getpass
import os
import shlex
import string
import sys
import typing as tp
from pathlib import Path

import pydantic

from hpcrun.cadence import NODE_MTBF_HOURS
from hpcrun.errors import HpcrunError
from hpcrun.fields import TOKEN_RE, Cpus, EnvName, HostPart, Line, Minutes, Name, PathStr, Token
from hpcrun.loader import Frozen, read_yaml, validate

Interconnect = tp.Literal["infiniband", "roce", "efa", "slingshot", "ethernet"]


class GPU(Frozen):
    """The accelerator model of a partition; peaks feed MFU, memory feeds the planner."""

    model: Token
    memory_gb: float = pydantic.Field(gt=0)
    peak_tflops_bf16: float = pydantic.Field(gt=0)
    peak_tflops_fp16: float | None = pydantic.Field(default=None, gt=0)

    @property
    def peak_fp16(self) -> float:
        return self.peak_tflops_fp16 or self.peak_tflops_bf16


class Partition(Frozen):
    """One SLURM partition. `gpus_per_node: 0` means a CPU partition: each rank is a process,
    and `cpu_peak_tflops_per_rank` (if known) gives MFU a denominator there."""

    max_nodes: int = pydantic.Field(ge=1)
    gpus_per_node: int = pydantic.Field(ge=0)
    gpu: GPU | None = None
    cpus_per_node: Cpus = pydantic.Field(ge=1)
    memory_gb: float = pydantic.Field(gt=0)
    max_time: Minutes
    gpu_request: str = "--gres=gpu:{n}"
    constraint: Token | None = None
    cpu_peak_tflops_per_rank: float | None = pydantic.Field(default=None, gt=0)
    node_mtbf_hours: float = pydantic.Field(default=NODE_MTBF_HOURS, gt=0)
    """One node's expected time between interruptions (hardware, software, network): with the
    job's node count it spaces checkpoints and snapshots (hpcrun.cadence)."""

    @pydantic.field_validator("gpu_request")
    @classmethod
    def _has_placeholder(cls, value: str) -> str:
        if "{n}" not in value or not value.startswith("--") or not TOKEN_RE.match(value.replace("{n}", "1")):
            raise ValueError(
                f"must be an sbatch option with a {{n}} placeholder, e.g. '--gres=gpu:{{n}}' (got {value!r})"
            )
        return value

    @pydantic.model_validator(mode="after")
    def _gpu_declared(self) -> Partition:
        if self.gpus_per_node > 0 and self.gpu is None:
            raise ValueError("gpu: required when gpus_per_node > 0 (its model and peak FLOP/s feed MFU)")
        return self

    @property
    def max_ranks_per_node(self) -> int:
        return self.gpus_per_node or self.cpus_per_node

    def gpu_directive(self, gpus: int) -> str | None:
        return self.gpu_request.replace("{n}", str(gpus)) if self.gpus_per_node else None


class Hostname(Frozen):
    """How the high-speed name of a node is spelled: `prefix + node + suffix` (e.g. `-ib`)."""

    prefix: HostPart = ""
    suffix: HostPart = ""


class Network(Frozen):
    """The fabric ranks talk over; `interface` is what NCCL and GLOO bind to."""

    interface: Token
    interconnect: Interconnect
    hca: list[Token] = []
    gid_index: int | None = pydantic.Field(default=None, ge=0)
    hostname: Hostname = Hostname()
    nominal_busbw_gbps: float | None = pydantic.Field(default=None, gt=0)
    env: dict[EnvName, Line | None] = {}


class NVMe(Frozen):
    """Node-local NVMe for ZeRO-Infinity; each job gets its own directory below `path`."""

    path: PathStr
    size_gb: float = pydantic.Field(gt=0)


class Storage(Frozen):
    """Shared directories (seen from login and compute nodes) and optional node-local NVMe."""

    runs_dir: PathStr
    results_dir: PathStr | None = None
    nvme: NVMe | None = None
    local_scratch: PathStr | None = None
    """A node-local directory (tmpfs: host memory) for in-memory snapshots
    (`checkpoint.memory_interval`); each job start uses `<local_scratch>/hpcrun-<job>-<SLURM requeue count>/`.
    None: `/dev/shm`."""

    @pydantic.field_validator("local_scratch")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError(f"must be an absolute path, the same on every node (got {value!r})")
        return value


class Container(Frozen):
    """Run the task inside a container: apptainer/singularity wrap the command, pyxis adds srun flags."""

    runtime: tp.Literal["apptainer", "singularity", "pyxis"]
    image: PathStr
    mounts: list[PathStr] = []


class Environment(Frozen):
    """What every job does before it launches: modules, setup lines (site shell code), container."""

    modules: list[Line] = []
    setup: list[Line] = []
    container: Container | None = None
    sbatch: list[Token] = []
    python: list[Line] | None = pydantic.Field(default=None, min_length=1)
    """The interpreter command inside the job, as words (`[python]`, `[conda, run, -n, ml, python]`).
    Each word is quoted like every other value: it is not shell code (that is `setup`). A plain
    string is still accepted and split into words the way a shell would split it."""

    @pydantic.field_validator("python", mode="before")
    @classmethod
    def _words(cls, value: tp.Any) -> tp.Any:
        if isinstance(value, str):
            if "\n" in value or "\r" in value or "\0" in value:
                raise ValueError(f"must be a single line (got {value!r})")
            try:
                return shlex.split(value)
            except ValueError as exc:
                raise ValueError(
                    f"cannot be split into words ({exc}); write it as a list of words (got {value!r})"
                ) from None
        return value

    @pydantic.field_validator("sbatch")
    @classmethod
    def _options(cls, value: list[str]) -> list[str]:
        for option in value:
            if not option.startswith("--"):
                raise ValueError(f"each entry must be a long sbatch option such as '--exclusive' (got {option!r})")
        return value


class Site(Frozen):
    """A validated site profile. Build it with `load_site`."""

    name: Name
    scheduler: tp.Literal["slurm", "local"]
    cluster: Name | None = None
    account: Token | None = None
    qos: Token | None = None
    default_partition: Token
    partitions: dict[Token, Partition] = pydantic.Field(min_length=1)
    network: Network
    storage: Storage
    environment: Environment = Environment()
    signal_lead_s: int = pydantic.Field(default=120, ge=10)
    template: PathStr | None = None
    source: str = pydantic.Field(default="", exclude=True)

    @pydantic.model_validator(mode="after")
    def _cross_field(self) -> Site:
        if self.default_partition not in self.partitions:
            raise ValueError(
                f"default_partition {self.default_partition!r} is not among partitions ({', '.join(self.partitions)})"
            )
        if self.scheduler == "slurm" and not TOKEN_RE.match(self.storage.runs_dir):
            raise ValueError(
                "storage.runs_dir: on a SLURM site it appears in #SBATCH --output, "
                f"so it may not hold spaces or quotes (got {self.storage.runs_dir!r})"
            )
        if self.environment.container and not self.environment.python:
            raise ValueError(
                "environment.python: required with a container (the login node's interpreter is not inside it)"
            )
        if self.scheduler == "local":
            for name, part in self.partitions.items():
                if part.max_nodes != 1:
                    raise ValueError(
                        f"partitions.{name}.max_nodes: a local site has exactly one node (got {part.max_nodes})"
                    )
        return self

    def partition(self, name: str | None) -> Partition:
        return self.partitions[name or self.default_partition]

    @property
    def results_dir(self) -> Path:
        return (
            Path(self.storage.results_dir)
            if self.storage.results_dir
            else Path(self.storage.runs_dir).parent / "results"
        )

    def interconnect_env(self) -> dict[str, str]:
        """The fabric preset for this site's interconnect, then the site's own `network.env`
        on top (a `null` value there removes a preset variable)."""
        net = self.network
        env: dict[str, str | None] = {"NCCL_SOCKET_IFNAME": net.interface, "GLOO_SOCKET_IFNAME": net.interface}
        env.update(PRESETS[net.interconnect])
        if net.hca:
            env["NCCL_IB_HCA"] = ",".join(net.hca)
        if net.gid_index is not None:
            env["NCCL_IB_GID_INDEX"] = str(net.gid_index)
        env.update(net.env)
        return {k: v for k, v in env.items() if v is not None}


# Why each variable: IB/RoCE keep NCCL on verbs; RoCE needs a GID index (3 = RoCEv2 on most
# NICs); EFA and Slingshot go through libfabric (aws-ofi-nccl plugin) with the provider
# named; plain Ethernet must not probe for IB and gains from more sockets per thread.
PRESETS: dict[str, dict[str, str | None]] = {
    "infiniband": {"NCCL_IB_DISABLE": "0"},
    "roce": {"NCCL_IB_DISABLE": "0", "NCCL_IB_GID_INDEX": "3"},
    "efa": {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "NCCL_PROTO": "simple"},
    "slingshot": {
        "FI_PROVIDER": "cxi",
        "NCCL_NET": "AWS Libfabric",
        "FI_CXI_DISABLE_HOST_REGISTER": "1",
        "FI_MR_CACHE_MONITOR": "userfaultfd",
        "NCCL_CROSS_NIC": "1",
    },
    "ethernet": {"NCCL_IB_DISABLE": "1", "NCCL_NSOCKS_PERTHREAD": "4", "NCCL_SOCKET_NTHREADS": "2"},
}


def search_path() -> list[Path]:
    """Where site profiles are looked up, first match wins: $HPCRUN_SITES (colon-separated),
    ~/.config/hpcrun/sites, ./sites, then the profiles shipped with hpcrun."""
    dirs = [Path(p) for p in os.environ.get("HPCRUN_SITES", "").split(os.pathsep) if p]
    dirs.append(Path(os.path.expanduser("~/.config/hpcrun/sites")))
    dirs.append(Path.cwd() / "sites")
    dirs.extend(shipped_dirs("sites"))
    return dirs


def shipped_dirs(kind: str) -> list[Path]:
    """The `sites/` or `templates/` that came with hpcrun: beside the package in a checkout,
    or under `<prefix>/share/hpcrun` after a wheel install."""
    here = Path(__file__).resolve().parent.parent / kind
    shared = Path(sys.prefix) / "share" / "hpcrun" / kind
    return [d for d in (here, shared) if d.is_dir()]


def known_sites() -> dict[str, Path]:
    """Every site name on the search path, mapped to the file that wins."""
    found: dict[str, Path] = {}
    for directory in search_path():
        if directory.is_dir():
            for file in sorted(directory.glob("*.yaml")):
                found.setdefault(file.stem, file)
    return found


def find_site(name_or_path: str) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        if not candidate.is_file():
            raise HpcrunError("no such site file", candidate)
        return candidate
    sites = known_sites()
    if name_or_path not in sites:
        raise HpcrunError(
            f"unknown site {name_or_path!r}; known sites: {', '.join(sorted(sites)) or 'none'}", field="--site"
        )
    return sites[name_or_path]


def load_site(name_or_path: str) -> Site:
    """The validated site for a name on the search path or a path to a YAML file."""
    path = find_site(name_or_path)
    data = read_yaml(path)
    data = _expand_paths(data, path.parent)
    site = validate(Site, data, path)
    return site.model_copy(update={"source": str(path)})


def _expand_paths(data: dict[str, tp.Any], base: Path) -> dict[str, tp.Any]:
    """`~` and `$VARS` in storage paths are the submitting user's, so expand them here, once. A
    relative path is relative to the site file's directory, like `template:`: the directory
    hpcrun happens to be started from must not decide where runs and results go."""
    storage = data.get("storage")
    if not isinstance(storage, dict):
        return data
    variables = {"USER": getpass.getuser(), **os.environ}

    def expand(value: str) -> str:
        # absolute, because submitit and sbatch resolve relative paths against other directories
        return os.path.abspath(base / string.Template(os.path.expanduser(value)).safe_substitute(variables))

    storage = dict(storage)
    for key in ("runs_dir", "results_dir"):
        if isinstance(storage.get(key), str):
            storage[key] = expand(storage[key])
    nvme = storage.get("nvme")
    if isinstance(nvme, dict) and isinstance(nvme.get("path"), str):
        storage["nvme"] = {**nvme, "path": expand(nvme["path"])}
    return {**data, "storage": storage}
