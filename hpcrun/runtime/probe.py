"""The rank side of `hpcrun doctor`: what this rank sees (host, interface, GPUs, versions),
then an all-reduce bandwidth sweep as nccl-tests reports it. Run once per rank with the
distributed environment set (it is a command job: the runtime names its run directory in
HPCRUN_RUN_DIR); each rank writes `probe-rank<N>.json` there, atomically."""

from __future__ import annotations

import os
import socket
import statistics
import time
from pathlib import Path

from hpcrun.rundir import RunDir, write_json

SIZES = [2**k for k in range(10, 25, 2)]  # 1 KiB .. 16 MiB


def interface_address(name: str) -> str | None:
    import fcntl
    import struct

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None
    finally:
        s.close()


def main() -> None:
    run_dir = Path(os.environ["HPCRUN_RUN_DIR"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "")
    report: dict[str, object] = {
        "rank": rank,
        "world": world,
        "host": socket.gethostname(),
        "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
        "interface": iface,
        "address": interface_address(iface) if iface else None,
        "interfaces": [n for _, n in socket.if_nameindex()],
        "master": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
        "visible_gpus": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
    }
    out = RunDir(run_dir).probe_report(rank)
    write_json(out, report)  # written before connecting: a wrong interface still reports
    if iface and report["address"] is None:
        raise SystemExit(
            f"rank {rank} on {report['node']}: interface {iface!r} has no IPv4 address here "
            f"(interfaces: {report['interfaces']})"
        )

    import torch
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    dist.init_process_group(backend)
    report.update(
        torch=torch.__version__,
        backend=backend,
        nccl=".".join(map(str, torch.cuda.nccl.version())) if backend == "nccl" else None,
    )
    # a fixed amount of local work, to spot a slow node
    a = torch.randn(512, 512, device=device)
    start = time.perf_counter()
    for _ in range(20):
        a = (a @ a).clamp_(-1, 1)
    if backend == "nccl":
        torch.cuda.synchronize()
    report["compute_s"] = time.perf_counter() - start
    rows = []
    for size in SIZES:
        x = torch.ones(size // 4, device=device)
        for _ in range(2):
            dist.all_reduce(x)
        times = []
        for _ in range(5):
            if backend == "nccl":
                torch.cuda.synchronize()
            t = time.perf_counter()
            dist.all_reduce(x)
            if backend == "nccl":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        elapsed = statistics.median(times)
        algbw = size / elapsed / 1e9
        rows.append(
            {"bytes": size, "time_us": elapsed * 1e6, "algbw_gbs": algbw, "busbw_gbs": algbw * 2 * (world - 1) / world}
        )
    report["allreduce"] = rows
    write_json(out, report)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
