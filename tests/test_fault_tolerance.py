"""Fault tolerance on this machine: a save killed at any point never yields a checkpoint that
resume picks; checkpoints load at another world size (and 2 ranks follow 1 rank's curve).
(Interrupted runs ending with the weights of uninterrupted ones, USR2 then SIGKILL, are
tests/test_exact_resume.py, at 4 ranks.)"""

from __future__ import annotations

import builtins
import io
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.runs import STRATEGIES, hpcrun, losses, recipe, run_dir_of, site_copy

pytestmark = pytest.mark.slow



def controller(run_dir: Path) -> int:
    return int(json.loads((run_dir / "jobs.json").read_text())[-1]["job_id"])


def ranks(run_dir: Path) -> list[int]:
    """The rank processes of a local job: the children of submitit's controller."""
    out = subprocess.run(["pgrep", "-P", str(controller(run_dir))], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def checkpoint_after(run_dir: Path, step: int) -> bool:
    return any(int(p.name.split("-")[1]) > step for p in (run_dir / "checkpoints").glob("step-*"))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def weights(run_dir: Path) -> str:
    return (run_dir / "weights.sha256").read_text().strip()


class Killed(Exception):
    pass


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the kills, in writer threads
def test_save_killed_at_every_write(asynchronous: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kill a DCP save at each file operation in turn (in DCP's writer threads too, and in the
    background of an asynchronous save): resume never picks the partial checkpoint, the failure
    is raised, and the next save of the same step succeeds."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    from hpcrun.recipe import Recipe
    from hpcrun.rundir import step_dir
    from hpcrun.runtime import checkpoint as ckpt
    from hpcrun.runtime.env import DistEnv

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29000 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        env = DistEnv(0, 0, 1, torch.device("cpu"), "gloo", 0, "t", "localhost", "t")
        recipe_ = Recipe.model_validate({"name": "k", "strategy": {"name": "ddp"}})
        engine = recipe_.strategy.build(torch.nn.Linear(8, 8), lambda p: torch.optim.AdamW(p), recipe_, env, None, None)
        cps = ckpt.Checkpoints(tmp_path / "checkpoints", env, keep=2, strategy="ddp", asynchronous=asynchronous)

        def save(step: int) -> None:
            cps.save(engine, step, {"step": step})
            if asynchronous:  # still in the background: published only by poll() or wait()
                assert ckpt.latest(cps.root) is None or ckpt.latest(cps.root)[0] < step
            cps.wait()

        save(1)
        real_open, real_rename, real_replace = builtins.open, os.rename, os.replace
        ops = {"n": 0, "kill_at": -1}

        def counted(fn):  # type: ignore[no-untyped-def]
            def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
                writing = (
                    fn is not real_open
                    or (len(args) > 1 and any(c in str(args[1]) for c in "wax"))
                    or any(c in str(kwargs.get("mode", "")) for c in "wax")
                )
                if writing:
                    ops["n"] += 1
                    if ops["n"] == ops["kill_at"]:
                        raise Killed(f"killed at file operation {ops['n']}")
                return fn(*args, **kwargs)
            return wrapper

        monkeypatch.setattr(builtins, "open", counted(real_open))
        monkeypatch.setattr(io, "open", counted(real_open))  # pathlib's Path.open, which DCP uses
        monkeypatch.setattr(os, "rename", counted(real_rename))
        monkeypatch.setattr(os, "replace", counted(real_replace))
        kills = 0
        for kill_at in range(1, 500):  # DCP's writer threads vary the count: kill until a save survives
            shutil.rmtree(step_dir(cps.root, 2), ignore_errors=True)
            ops.update(n=0, kill_at=kill_at)
            try:
                save(2)
                break
            except (Killed, CheckpointException):  # DCP wraps what its writers raise
                kills += 1
            finally:
                ops["kill_at"] = -1
            latest = ckpt.latest(cps.root)
            assert latest is not None and latest[0] in (1, 2)
            state_ = cps.load(engine, latest[1])  # whatever is visible is whole: it loads
            assert state_["step"] == latest[0]
            save(3)  # the next save succeeds over the leftovers
            assert ckpt.latest(cps.root)[0] == 3
            assert not list(cps.root.glob(".tmp-*"))
            shutil.rmtree(step_dir(cps.root, 3))
        assert kills >= 4, kills  # the save really was cut at several points
        assert ckpt.latest(cps.root)[0] == 2
        before = ckpt.state_digest(engine.model.module.state_dict())
        torch.nn.init.zeros_(engine.model.module.weight)
        cps.load(engine, ckpt.latest(cps.root)[1])  # the surviving save is whole
        assert ckpt.state_digest(engine.model.module.state_dict()) == before
        for step in (4, 5, 6):  # keep=2: older complete checkpoints go once a newer one is visible
            save(step)
        assert [s for s, _ in ckpt.complete(cps.root)] == [5, 6]
    finally:
        dist.destroy_process_group()


@pytest.mark.oldest_torch
def test_asynchronous_save_holds_its_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Training goes on (weights and Adam moments change in place) while a save is written in
    the background: the checkpoint still holds the state of the step it was taken at, and it
    becomes visible only when `poll` finds the write done."""
    import torch
    import torch.distributed as dist

    from hpcrun.recipe import Recipe
    from hpcrun.runtime import checkpoint as ckpt
    from hpcrun.runtime.env import DistEnv

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29000 + (os.getpid() + 7) % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        env = DistEnv(0, 0, 1, torch.device("cpu"), "gloo", 0, "t", "localhost", "t")
        recipe_ = Recipe.model_validate({"name": "a", "strategy": {"name": "ddp"}})
        torch.manual_seed(0)

        def engine():  # type: ignore[no-untyped-def]
            model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
            return recipe_.strategy.build(model, lambda p: torch.optim.AdamW(p, lr=0.1), recipe_, env, None, None)

        def step(e) -> None:  # type: ignore[no-untyped-def]
            e.model(torch.randn(4, 256)).pow(2).mean().backward()
            e.optimizer_step()

        def digest(e) -> str:  # type: ignore[no-untyped-def]
            optim = {f"{i}.{k}": v for i, s in e.optimizer.state_dict()["state"].items() for k, v in s.items()}
            return ckpt.state_digest({**e.model.module.state_dict(), **optim})

        gate = threading.Event()  # holds the background write until training has moved on
        write_data = ckpt.DcpWriter.write_data

        def held(self, plan, planner):  # type: ignore[no-untyped-def]
            assert gate.wait(60)
            return write_data(self, plan, planner)

        monkeypatch.setattr(ckpt.DcpWriter, "write_data", held)
        live = engine()
        step(live)
        at_save = digest(live)
        cps = ckpt.Checkpoints(tmp_path / "checkpoints", env, keep=2, strategy="ddp", asynchronous=True)
        cps.save(live, 1, {"step": 1})
        for _ in range(3):
            step(live)
            cps.poll()
        assert digest(live) != at_save
        assert ckpt.latest(cps.root) is None  # not visible while it is being written
        gate.set()
        deadline = time.time() + 60
        while ckpt.latest(cps.root) is None and time.time() < deadline:
            cps.poll()
            time.sleep(0.01)
        assert ckpt.latest(cps.root) is not None and cps.write_times
        restored = engine()
        state_ = cps.load(restored, ckpt.latest(cps.root)[1])
        assert state_["step"] == 1 and digest(restored) == at_save
        # the second save reuses the first one's host buffers: tensors and numbers are its own
        for group in live.optimizer.param_groups:
            group["lr"] = 0.05
        step(live)
        at_second = digest(live)
        cps.save(live, 2, {"step": 2})
        step(live)
        cps.wait()
        again = engine()
        assert cps.load(again, ckpt.latest(cps.root)[1])["step"] == 2
        assert digest(again) == at_second and again.optimizer.param_groups[0]["lr"] == 0.05
    finally:
        dist.destroy_process_group()


def test_asynchronous_saves_keep_the_crc32_and_the_process_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every tensor record an asynchronous save writes carries torch.save's CRC32 (a load can
    tell a damaged record; the records lost it when the writer switched the option off around its
    write), and a torch.save on the main thread while a writer thread is in the middle of its
    files keeps its CRC too (torch 2.13 keeps such a switch to the thread that set it; the
    option is left on for the whole process either way)."""
    import zipfile

    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from hpcrun.recipe import Recipe
    from hpcrun.runtime import checkpoint as ckpt
    from hpcrun.runtime.env import DistEnv

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29000 + (os.getpid() + 13) % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        env = DistEnv(0, 0, 1, torch.device("cpu"), "gloo", 0, "t", "localhost", "t")
        recipe_ = Recipe.model_validate({"name": "c", "strategy": {"name": "ddp"}})
        engine = recipe_.strategy.build(
            torch.nn.Linear(64, 64), lambda p: torch.optim.AdamW(p), recipe_, env, None, None
        )
        engine.model(torch.randn(2, 64)).sum().backward()
        engine.optimizer_step()
        started, resume = threading.Event(), threading.Event()
        real_open = builtins.open

        def paused_open(file, mode="r", *args, **kwargs):  # type: ignore[no-untyped-def]
            # the first data file a writer thread opens: hold that thread there, mid-write
            if (
                str(file).endswith(".distcp")
                and "w" in mode
                and threading.current_thread() is not threading.main_thread()
                and not started.is_set()
            ):
                started.set()
                assert resume.wait(60)
            return real_open(file, mode, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", paused_open)
        monkeypatch.setattr(io, "open", paused_open)  # pathlib's Path.open, which DCP uses
        cps = ckpt.Checkpoints(tmp_path / "checkpoints", env, keep=2, strategy="ddp", asynchronous=True)
        cps.save(engine, 1, {"step": 1})
        assert started.wait(60)
        main_saved = io.BytesIO()
        torch.save(torch.arange(1000.0), main_saved)  # the main thread, while a writer is mid-write
        resume.set()
        cps.wait()
        monkeypatch.setattr(builtins, "open", real_open)
        monkeypatch.setattr(io, "open", real_open)
        assert torch.serialization.get_crc32_options()
        assert zipfile.ZipFile(main_saved).testzip() is None
        state_dir = ckpt.latest(cps.root)[1] / "state"
        metadata = FileSystemReader(str(state_dir)).read_metadata()
        tensors = {
            name for name, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)
        }
        records = [(index, info) for index, info in metadata.storage_data.items() if index.fqn in tensors]
        assert len(records) >= 4  # weight, bias and their Adam moments
        for index, info in records:
            raw = (state_dir / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
            archive = zipfile.ZipFile(io.BytesIO(raw))
            assert all(member.CRC for member in archive.infolist()), index.fqn
            assert archive.testzip() is None, index.fqn
    finally:
        dist.destroy_process_group()


@pytest.mark.oldest_torch
@pytest.mark.parametrize("stager_of", ["host_stager", "ReusingStager"])
def test_host_stager_reuses_its_buffers(stager_of: str) -> None:
    """The stager of this torch (torch's DefaultStager from 2.13, hpcrun's ReusingStager before)
    copies a save's tensors into the host buffers of the previous save (what keeps the stall short
    and host memory flat), and the copy is apart from training's tensors: if a torch release stops
    caching by storage, or cannot stage twice (2.11), this fails rather than a run at its second
    save. ReusingStager is tested on every torch, the one it serves included."""
    import torch

    from hpcrun.runtime import checkpoint as ckpt

    model = torch.nn.Linear(32, 32)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 32)).sum().backward()
    optimizer.step()
    stager = getattr(ckpt, stager_of)()
    first = stager.stage({"model": model.state_dict(), "optim": optimizer.state_dict()})
    staged = first["model"]["weight"].clone()
    buffers = (first["model"]["weight"].data_ptr(), first["optim"]["state"][0]["exp_avg"].data_ptr())
    with torch.no_grad():
        model.weight.add_(1.0)
    assert torch.equal(first["model"]["weight"], staged)  # a copy, not a view of training's tensor
    optimizer.param_groups[0]["lr"] = 0.5
    second = stager.stage({"model": model.state_dict(), "optim": optimizer.state_dict()})
    assert (second["model"]["weight"].data_ptr(), second["optim"]["state"][0]["exp_avg"].data_ptr()) == buffers
    assert torch.equal(second["model"]["weight"], model.weight) and second["optim"]["param_groups"][0]["lr"] == 0.5
    stager.close()


@pytest.mark.parametrize("name", ["ddp", pytest.param("fsdp", marks=pytest.mark.oldest_torch)])
def test_one_rank_follows_two_and_loads_their_checkpoint(name: str, tmp_path: Path) -> None:
    """2 ranks x micro batch 4 follow the loss curve of 1 rank x micro batch 8 (the strategy is
    correct, not just running), and the 2-rank checkpoint resumed by 1 rank (same global batch)
    continues the same curve; with DDP, 2 ranks x micro batch 2 x 2 accumulated micro batches
    follow it too. One 2-rank run serves all three (they were three tests, each starting it)."""
    site = site_copy(tmp_path)
    training = {"steps": 6, "lr": 0.003, "micro_batch": 4}
    two = run_dir_of(
        hpcrun(
            "submit",
            "--site",
            str(site),
            "--wait",
            str(
                recipe(tmp_path, f"{name}-2", strategy=STRATEGIES[name], training=training, checkpoint={"interval": 3})
            ),
        )
    )
    one_rec = recipe(
        tmp_path,
        f"{name}-1",
        strategy=STRATEGIES[name],
        training={**training, "micro_batch": 8},
        checkpoint={"interval": 3},
        resources={"nodes": 1, "gpus_per_node": 1, "time": "00:10:00"},
    )
    curve_one = losses(run_dir_of(hpcrun("submit", "--site", str(site), "--wait", str(one_rec))))
    original = losses(two)
    assert len(curve_one) == len(original) == 6
    assert curve_one[-1] < curve_one[0] - 0.05
    for a, b in zip(curve_one, original):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    if name == "ddp":  # gradient accumulation matches the larger batch (the recipe's default strategy)
        accum = recipe(tmp_path, "accum", training={**training, "micro_batch": 2, "grad_accum": 2})
        for a, b in zip(losses(run_dir_of(hpcrun("submit", "--site", str(site), "--wait", str(accum)))), original):
            assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    hpcrun("submit", "--site", str(site), "--dry-run", "--run-id", "resharded", str(one_rec))
    one = tmp_path / "runs" / "resharded"
    shutil.copytree(two / "checkpoints" / "step-00000003", one / "checkpoints" / "step-00000003")
    hpcrun("resume", "--site", str(site), "--wait", one.name)
    resumed = losses(one)
    assert len(resumed) == 6
    assert resumed[:3] == original[:3]  # carried over in the checkpoint
    for a, b in zip(resumed[3:], original[3:]):
        assert a == pytest.approx(b, rel=1e-5)


# `hpcrun checkpoint consolidate` (FSDP, ZeRO-3): tests/test_exact_resume.py, on its uninterrupted runs
