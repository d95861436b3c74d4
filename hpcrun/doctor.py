"""`hpcrun doctor`: check a site for real. Login-node checks first (one scheduler query each),
then a short probe job on N nodes. Every finding is one line with a status and what to change."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import tempfile
import typing as tp
from pathlib import Path

from hpcrun import jobstate, slurm, torchrange
from hpcrun.errors import HpcrunError
from hpcrun.rundir import RunDir
from hpcrun.site import Site


@dataclasses.dataclass(frozen=True)
class Finding:
    status: str  # ok | warn | fail
    check: str
    message: str
    fix: str = ""

    def line(self) -> str:
        return f"{self.status:4}  {self.check}: {self.message}" + (f" -> {self.fix}" if self.fix else "")


TIMEOUT_S = 30.0  # a login-node query that takes longer means the controller is not answering


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    """A SLURM tool that is missing or hangs is one line naming it (exit code 2), not a traceback."""
    return slurm.run(cmd, timeout=TIMEOUT_S)


def login_checks(site: Site, script: str) -> list[Finding]:
    """Tools reachable, partitions and GRES as sinfo sees them, account/QoS, `sbatch --test-only`."""
    where = site.source or site.name
    found = [Finding("ok", "site", f"{where} validates")]
    if site.scheduler == "local":
        return found + [Finding("ok", "scheduler", "local site: no scheduler to ask")]
    for tool in ("sbatch", "sacct", "sinfo", "scontrol"):
        if shutil.which(tool) is None:
            found.append(Finding("fail", tool, "not on PATH", "run on a login node, or load the site's slurm module"))
    if any(f.status == "fail" for f in found):
        return found
    info = _run(slurm.partitions_summary())
    if info.returncode != 0:
        return found + [
            Finding(
                "fail",
                "sinfo",
                info.stderr.strip() or f"exit status {info.returncode}",
                "check that slurmctld answers from this node",
            )
        ]
    seen: dict[str, dict[str, str]] = {}
    for line in info.stdout.splitlines():
        fields = line.split("|")
        if len(fields) == 6:
            part, nodes, cpus, mem, gres, limit = fields
            seen.setdefault(part, {"nodes": nodes, "cpus": cpus, "mem": mem, "gres": gres, "limit": limit})
    for name, p in site.partitions.items():
        check = f"partition {name}"
        if name not in seen:
            found.append(
                Finding(
                    "fail",
                    check,
                    f"sinfo knows no such partition (it has {', '.join(seen)})",
                    f"fix partitions.{name} in {where}",
                )
            )
            continue
        s = seen[name]
        problems = []
        if int(s["nodes"]) < p.max_nodes:
            problems.append(
                (
                    f"max_nodes {p.max_nodes} but sinfo has {s['nodes']} nodes",
                    f"partitions.{name}.max_nodes: {s['nodes']}",
                )
            )
        node_cpus = int(re.sub(r"\D.*", "", s["cpus"]) or 0)
        if node_cpus and node_cpus < p.cpus_per_node:
            problems.append(
                (
                    f"cpus_per_node {p.cpus_per_node} but nodes have {node_cpus}",
                    f"partitions.{name}.cpus_per_node: {node_cpus}",
                )
            )
        mem_gb = int(re.sub(r"\D.*", "", s["mem"]) or 0) / 1000
        if mem_gb and mem_gb + 0.05 < p.memory_gb:
            problems.append(
                (f"memory_gb {p.memory_gb} but nodes have {mem_gb:.1f}", f"partitions.{name}.memory_gb: {mem_gb:.1f}")
            )
        gpus = re.search(r"gpu(?::[^:,()]+)?:(\d+)", s["gres"])
        if p.gpus_per_node and not gpus:
            problems.append(
                (
                    f"gpus_per_node {p.gpus_per_node} but sinfo shows no gpu GRES ({s['gres']})",
                    f"check partitions.{name}.gpu_request",
                )
            )
        elif gpus and int(gpus.group(1)) != p.gpus_per_node:
            problems.append(
                (
                    f"gpus_per_node {p.gpus_per_node} but GRES says {gpus.group(1)}",
                    f"partitions.{name}.gpus_per_node: {gpus.group(1)}",
                )
            )
        for message, fix in problems:
            found.append(Finding("fail", check, message, f"set {fix} in {where}"))
        if not problems:
            found.append(
                Finding(
                    "ok",
                    check,
                    f"{s['nodes']} nodes, {node_cpus} CPUs, {mem_gb:.1f} GB, GRES {s['gres']}, limit {s['limit']}",
                )
            )
    if site.account or site.qos:
        answer = _run(slurm.associations([f"user={slurm.user()}"], "account,qos"))
        if answer.returncode != 0:
            said = answer.stderr.strip() or f"exit status {answer.returncode}"
            raise HpcrunError(f"sacctmgr failed, so account and qos cannot be checked: {said}")
        assoc = answer.stdout
        accounts = {ln.split("|")[0] for ln in assoc.splitlines() if "|" in ln}
        qos = {q for ln in assoc.splitlines() if "|" in ln for q in ln.split("|")[1].split(",")}
        if site.account and site.account not in accounts:
            found.append(
                Finding(
                    "fail",
                    "account",
                    f"{site.account!r} is not one of your accounts ({', '.join(sorted(accounts)) or 'none'})",
                    f"set account in {where}",
                )
            )
        if site.qos and site.qos not in qos:
            found.append(
                Finding(
                    "fail",
                    "qos",
                    f"{site.qos!r} is not among your QoS ({', '.join(sorted(qos)) or 'none'})",
                    f"set qos in {where}",
                )
            )
    with tempfile.NamedTemporaryFile("w", suffix=".sh", delete=False) as f:
        f.write(script)
    test = _run(slurm.test_only(f.name))
    Path(f.name).unlink()
    if test.returncode == 0:
        found.append(
            Finding(
                "ok", "sbatch --test-only", test.stderr.strip().splitlines()[-1] if test.stderr.strip() else "accepted"
            )
        )
    else:
        found.append(
            Finding(
                "fail",
                "sbatch --test-only",
                slurm.said(test),
                f"check the partition, account and limits in {where}",
            )
        )
    return found


def torch_findings(run_dir: Path, reports: list[dict[str, tp.Any]], where: str) -> list[Finding]:
    """The ranks' torch and where it stands against hpcrun's supported range, one finding per
    version: from the probe's reports, and from the line a rank with a torch too old for hpcrun
    writes to its log instead of running the probe (hpcrun.launch)."""
    ranks: dict[str, set[int]] = {}
    for r in reports:
        if r.get("torch"):
            ranks.setdefault(str(r["torch"]), set()).add(int(r["rank"]))
    for log in sorted(RunDir(run_dir).logs.glob("*_log.*")):  # <job>_<rank>_log.{out,err}
        for line in log.read_text(errors="replace").splitlines():
            version = torchrange.refused_version(line.strip())
            if version is not None:
                ranks.setdefault(version, set()).add(int(log.name.split("_")[-2]))
    found = []
    for version, on in sorted(ranks.items()):
        who = f"rank {min(on)}" if len(on) == 1 else f"{len(on)} ranks"
        status = torchrange.verdict(version).status
        if status == torchrange.OK:
            found.append(Finding("ok", "torch", f"{version} on {who}: supported ({torchrange.SUPPORTED})"))
        elif status == torchrange.NEWER:
            found.append(
                Finding(
                    "warn", "torch", f"{version} on {who}: newer than hpcrun was tested on ({torchrange.SUPPORTED})",
                    "runs, but checkpoints and snapshots are untested there",
                )
            )
        else:
            found.append(
                Finding(
                    "fail", "torch",
                    f"{version} on {who}: not supported ({torchrange.SUPPORTED}), so ranks refuse to start",
                    f"install {torchrange.REQUIREMENT} where the job runs (environment.setup or python in {where})",
                )
            )
    return found


def probe_findings(site: Site, run_dir: Path, job_state: str) -> list[Finding]:
    """Findings from the ranks' reports: interface, torch, per-node compute time, bus bandwidth."""
    reports = RunDir(run_dir).probe_reports()
    where = site.source or site.name
    found = torch_findings(run_dir, reports, where)
    iface = site.network.interface
    missing = [r for r in reports if r.get("address") is None]
    for r in missing:
        found.append(
            Finding(
                "fail",
                f"rank {r['rank']} on {r['node']}",
                f"interface {iface!r} has no address there (it has {', '.join(r['interfaces'])})",
                f"set network.interface in {where} to the node's high-speed interface",
            )
        )
    if missing or job_state != jobstate.COMPLETED or not all("allreduce" in r for r in reports):
        if not missing:
            found.append(
                Finding(
                    "fail",
                    "probe job",
                    f"ended {job_state} with {len(reports)} rank report(s)",
                    "see hpcrun logs for the run",
                )
            )
        return found
    nodes = sorted({r["node"] for r in reports})
    found.append(
        Finding(
            "ok",
            "ranks",
            f"{len(reports)} ranks on {', '.join(nodes)} over {iface} "
            f"({', '.join(sorted({r['address'] for r in reports}))})",
        )
    )
    for r in reports:
        gpus = r["visible_gpus"] or "none"
        found.append(
            Finding(
                "ok",
                f"rank {r['rank']}",
                f"{r['node']} {iface}={r['address']} master {r['master']} GPUs {gpus} torch {r['torch']} {r['backend']}"
                + (f" NCCL {r['nccl']}" if r.get("nccl") else ""),
            )
        )
    compute = sorted(r["compute_s"] for r in reports)
    median = compute[len(compute) // 2]
    for r in reports:
        if r["compute_s"] > 1.5 * median:
            found.append(
                Finding(
                    "warn",
                    f"node {r['node']}",
                    f"rank {r['rank']} computed {r['compute_s'] / median:.1f}x slower than the median",
                    "drain or check the node",
                )
            )
    table = reports[0]["allreduce"]
    peak = max(row["busbw_gbs"] for row in table)
    sizes = ", ".join(f"{row['bytes'] // 1024} KiB {row['busbw_gbs']:.2f}" for row in table[::2])
    found.append(Finding("ok", "all-reduce", f"{reports[0]['backend']} bus bandwidth GB/s: {sizes}; peak {peak:.2f}"))
    nominal = site.network.nominal_busbw_gbps
    if nominal is None:
        found.append(
            Finding(
                "warn", "bandwidth", "no nominal figure to compare with", f"set network.nominal_busbw_gbps in {where}"
            )
        )
    else:
        ratio = peak * 8 / nominal  # GB/s against the nominal Gb/s
        status = "ok" if ratio >= 0.5 else "warn"
        found.append(
            Finding(
                status,
                "bandwidth",
                f"peak bus bandwidth {peak * 8:.1f} Gb/s is {ratio:.0%} of nominal {nominal} Gb/s",
                "" if status == "ok" else f"check network.interconnect and network.env in {where}",
            )
        )
    return found


def record(site: Site, run_dir: Path, spec_nodes: int) -> None:
    """The probe's all-reduce table as one results row (job_kind "doctor"), bus bandwidth per
    message size in `extra`, so links can be compared over time in pandas like any run."""
    import datetime as dt

    from hpcrun.results import write_attempt

    reports = RunDir(run_dir).probe_reports()
    if not reports or "allreduce" not in reports[0]:
        return
    table = reports[0]["allreduce"]
    write_attempt(
        site.results_dir,
        {
            "run_id": run_dir.name,
            "site": site.name,
            "cluster": site.cluster or site.name,
            "job_kind": "doctor",
            "interconnect": site.network.interconnect,
            "nodes": spec_nodes,
            "world_size": reports[0]["world"],
            "node_list": ",".join(sorted({r["node"] for r in reports})),
            "status": "completed",
            "end_time": dt.datetime.now(dt.UTC),
            "torch_version": reports[0].get("torch"),
            "nccl_version": reports[0].get("nccl"),
            "extra": {f"busbw_gbs_{row['bytes']}": row["busbw_gbs"] for row in table}
            | {"busbw_gbs_peak": max(r["busbw_gbs"] for r in table)},
        },
    )
