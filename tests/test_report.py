"""`hpcrun report` and "do the strategies agree?": the agreement check on curves made to agree
or not, the page in human units with nothing fetched, and the page opened in real headless
Chromium (no console errors, every plot decodes and is not blank, one loss line per strategy)."""

from __future__ import annotations

import base64
import datetime as dt
import html
import io
import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hpcrun.compare import agreement
from hpcrun.report import render
from hpcrun.results import load, write_attempt
from hpcrun.steps import load_steps, write_batch
from tests.helpers import cli

STRATEGIES = [("ddp", None), ("fsdp", None), ("deepspeed", 2), ("deepspeed", 3)]
LABELS = ["ddp", "fsdp", "zero2", "zero3"]


def sweep(tmp: Path, diverge: str | None = None, seed_of: dict[str, int] | None = None, steps: int = 20) -> Path:
    """Summary rows and per-step rows of a 4-strategy x {1, 2}-node sweep of one tiny model; the
    strategies' losses differ by 1e-7 (reduction order), except `diverge` at 1 node (by 2% at
    the end). `seed_of` gives a strategy another seed."""
    results = tmp / "results"
    start = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    for nodes in (1, 2):
        for i, (name, stage) in enumerate(STRATEGIES):
            label = LABELS[i]
            run_id = f"run-{label}-{nodes}n"
            write_attempt(
                results,
                {
                    "run_id": run_id,
                    "sweep_id": "sw1",
                    "site": "testcluster",
                    "cluster": "hpctest",
                    "partition": "batch",
                    "strategy": name,
                    "zero_stage": stage,
                    "offload_optimizer": "none",
                    "offload_param": "none",
                    "nodes": nodes,
                    "world_size": 2 * nodes,
                    "status": "completed",
                    "model": "tiny",
                    "seed": (seed_of or {}).get(label, 0),
                    "global_batch": 8 * nodes,
                    "seq_len": 64,
                    "tokens_per_s": 2000.0 * nodes * (1 - 0.1 * i),
                    "tokens_per_s_per_gpu": 1000.0 * (1 - 0.1 * i),
                    # saves and snapshots cost 10%; zero3's rows as files written before that was measured
                    "wall_tokens_per_s": 1800.0 * nodes * (1 - 0.1 * i) if label != "zero3" else None,
                    "recovery_overhead": 0.0042 if label != "zero3" else None,
                    "mfu": None,
                    "peak_memory_bytes": int(4e8 * (4 - i)),
                    "step_time_p50_s": 0.1 + 0.01 * i,
                    "step_time_p95_s": 0.15 + 0.02 * i,
                    "final_loss": None,
                    "node_list": "node[1-2]" if nodes == 2 else "node1",
                    "job_id": f"{nodes}{i}",
                    "attempt": 0,
                    "torch_version": "2.13.0+cpu",
                    "deepspeed_version": "0.19.8",
                    "git_sha": "0123abc",
                    "start_time": start,
                },
            )
            rows = []
            for step in range(1, steps + 1):
                loss = (
                    5 * math.exp(-step / 8)
                    + 1
                    + 1e-7 * i
                    + (0.02 * step / steps * 2 if label == diverge and nodes == 1 else 0.0)
                )
                rows.append(
                    {
                        "run_id": run_id,
                        "sweep_id": "sw1",
                        "point_id": f"p{nodes}{i}",
                        "stage": "main",
                        "strategy": name,
                        "job_id": f"{nodes}{i}",
                        "attempt": 0,
                        "step": step,
                        "time": start + dt.timedelta(seconds=step),
                        "loss": loss,
                        "lr": 1e-3,
                        "step_time_s": 0.1,
                        "step_time_min_s": 0.09,
                        "step_time_median_s": 0.1,
                        "step_time_max_s": 0.12,
                        "slowest_rank": 1,
                        "tokens_per_s": 2000.0,
                    }
                )
            write_batch(results, rows, 0)
    return results


def test_agreement_finds_the_diverging_strategy(tmp_path: Path) -> None:
    results = sweep(tmp_path, diverge="fsdp")
    agree = agreement(load(results), load_steps(results)).set_index("global_batch")
    one, two = agree.loc[8], agree.loc[16]  # one group per node count: their global batches differ
    assert one["strategies"] == "ddp, fsdp, zero2, zero3" and one["common_steps"] == 20 and one["runs"] == 4
    assert not one["agree"] and one["worst_pair"] == "ddp vs fsdp" and one["worst_step"] == 20
    assert one["max_rel_diff"] == pytest.approx(0.04 / (5 * math.exp(-20 / 8) + 1.04), rel=1e-3)
    assert two["agree"] and two["max_abs_diff"] == pytest.approx(3e-7, rel=1e-3) and two["max_rel_diff"] < 1e-6
    assert bool(agreement(load(results), load_steps(results), tolerance=0.05).set_index("global_batch").loc[8, "agree"])


def test_agreement_compares_only_the_same_seed_and_common_steps(tmp_path: Path) -> None:
    results = sweep(tmp_path, diverge="zero3", seed_of={"zero3": 7})  # zero3 trained another model: not compared
    agree = agreement(load(results), load_steps(results))
    assert set(agree["seed"]) == {0} and agree["agree"].all()
    assert set(agree["strategies"]) == {"ddp, fsdp, zero2"}
    steps = load_steps(results)
    steps = steps[~((steps["run_id"] == "run-ddp-1n") & (steps["step"] > 5))]  # ddp stopped early: 5 common steps
    assert set(agreement(load(results), steps)["common_steps"]) == {5, 20}


def data_uris(page: str) -> list[tuple[dict[str, str], Image.Image]]:
    """Each <img>: its attributes and its decoded picture."""
    found = []
    for tag in re.findall(r"<img [^>]*>", page):
        attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', tag))
        header, _, data = attrs["src"].partition(",")
        assert header == "data:image/png;base64", header[:40]
        image = Image.open(io.BytesIO(base64.b64decode(data)))
        image.load()
        found.append((attrs, image.convert("RGB")))
    return found


def test_page_in_human_units_with_nothing_fetched(tmp_path: Path) -> None:
    results = sweep(tmp_path, diverge="fsdp")
    page = render(load(results), load_steps(results))
    text = html.unescape(re.sub(r'src="data:[^"]*"', 'src=""', page))
    assert "<NA>" not in text and not re.search(r"\b(nan|NaN|None)\b", text)
    assert (
        "1.60 GB" in text and "2 k" in text and "100 %" in text and "100 ms" in text and "–" in text
    )  # MFU unmeasured: a dash
    # the wall clock beside the per-step throughput, in the table and the scaling plot
    assert "<th>tokens/s</th><th>wall-clock tokens/s</th><th>lost to saves/snapshots</th>" in page
    assert re.search(r"<td>2 k</td><td>1.8 k</td><td>0.42 %</td>", page), text
    assert re.search(r"<td>1.4 k</td><td>–</td><td>–</td>", page), text  # zero3: not measured
    assert "wall-clock tokens/s: over the training loop's wall time" in text
    assert not re.search(r'(src|href)="(?!data:)', page) and "<script" not in page and "url(" not in page
    for fact in ("testcluster", "batch", "node[1-2]", "2.13.0+cpu", "0.19.8", "0123abc"):
        assert fact in text, fact
    assert text.count("DISAGREE") == 1 and "ddp vs fsdp" in text
    figures = [attrs["data-figure"] for attrs, _ in data_uris(page)]
    assert figures == ["scaling", "per_gpu", "loss-0", "loss-1", "memory", "step_times"]
    assert "dotted, open markers: wall-clock tokens/s" in text.split('data-figure="scaling"')[1].split("</figure>")[0]


def chromium() -> str:
    """The browser, or a skip with the reason outside CI (an error in CI)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    reason = "chromium not installed (Debian: apt-get install chromium; .ci/setup installs it)"
    if os.environ.get("HPCRUN_REQUIRE_BROWSER") or os.environ.get("HPCRUN_REQUIRE_CLUSTER"):
        pytest.fail(f"HPCRUN_REQUIRE_BROWSER/CLUSTER is set but {reason}")
    pytest.skip(reason)


# Added to a copy of the page only (the report itself has no script): after the load event,
# what the browser made of every image, written where --dump-dom shows it.
PROBE = """<script>window.addEventListener("load", () => { document.body.setAttribute("data-images",
JSON.stringify([...document.images].map(i => [i.dataset.figure, i.complete, \
i.naturalWidth, i.naturalHeight]))); });</script>"""


def open_in_browser(page: Path, tmp: Path) -> tuple[list[list[object]], list[str]]:
    """(per image: figure, complete, width, height) and the console messages, from Chromium."""
    probe = tmp / f"probe-{page.parent.name}.html"
    probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    out = subprocess.run(
        [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--enable-logging=stderr",
            "--v=0",
            f"--user-data-dir={tmp / 'profile'}",
            "--dump-dom",
            probe.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    images = re.search(r'<body data-images="([^"]*)"', out.stdout)
    assert images, out.stdout[:500]
    console = [line for line in out.stderr.splitlines() if ":CONSOLE" in line]
    return json.loads(images.group(1).replace("&quot;", '"')), console


def test_the_probe_sees_console_errors_and_broken_images(tmp_path: Path) -> None:
    """The browser check below can fail: a script error and an undecodable image are seen."""
    bad = tmp_path / "bad" / "index.html"
    bad.parent.mkdir()
    bad.write_text(
        '<!doctype html><html><body><img data-figure="x" src="data:image/png;base64,AAAA">'
        "<script>undefined_function()</script></body></html>"
    )
    images, console = open_in_browser(bad, tmp_path)
    assert images == [["x", True, 0, 0]] and any("undefined_function is not defined" in line for line in console)


def test_report_in_headless_chromium(tmp_path: Path) -> None:
    results = sweep(tmp_path, diverge="fsdp")
    out = cli("report", "--dir", str(results), "--out", str(tmp_path / "report"))
    assert out.exit_code == 0, out.output
    page = Path(out.stdout.strip())
    assert page == tmp_path / "report" / "index.html" and sorted(p.name for p in page.parent.iterdir()) == [
        "index.html"
    ]
    images, console = open_in_browser(page, tmp_path)
    assert console == []
    decoded = data_uris(page.read_text())
    assert [i[0] for i in images] == [attrs["data-figure"] for attrs, _ in decoded] and len(images) == 6
    for (name, complete, width, height), (_, picture) in zip(images, decoded):
        assert complete and (width, height) == picture.size and width > 300, name
        assert len(np.unique(np.asarray(picture).reshape(-1, 3), axis=0)) > 20, f"{name} is blank"
    for attrs, picture in decoded:
        if not attrs["data-figure"].startswith("loss"):
            continue
        series = json.loads(attrs["data-series"].replace("&quot;", '"'))
        assert sorted(series) == LABELS and attrs["alt"].endswith("ddp, fsdp, zero2, zero3")
        pixels = np.asarray(picture).reshape(-1, 3).astype(int)
        for label, colour in series.items():  # a whole curve, not only its legend swatch (~200 px)
            rgb = np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)])
            assert (np.abs(pixels - rgb).sum(axis=1) < 30).sum() > 1000, f"{attrs['data-figure']}: no line for {label}"


def test_results_compare_says_whether_strategies_agree(tmp_path: Path) -> None:
    results = sweep(tmp_path, diverge="zero2")
    out = cli("results", "--dir", str(results), "--compare", "strategy,nodes")
    assert out.exit_code == 0, out.output
    lines = [line for line in out.stdout.splitlines() if line.startswith(("agree", "DISAGREE"))]
    assert len(lines) == 2
    assert lines[0].startswith("DISAGREE model=tiny seed=0 global_batch=8") and "ddp vs zero2 at step 20" in lines[0]
    assert lines[1].startswith("agree    model=tiny seed=0 global_batch=16")
    loose = cli("results", "--dir", str(results), "--compare", "strategy,nodes", "--tolerance", "0.1").stdout
    assert "DISAGREE" not in loose and loose.count("agree ") == 2
    assert "agree" not in cli("results", "--dir", str(results), "--compare", "strategy,nodes", "--format", "csv").stdout


def check_report_of_real_runs(site: str, out: Path) -> None:
    """Two strategies really trained (ddp and fsdp, the only runs of `site`): the page has one loss
    line each, and they agree; it and `results --compare` show each one's wall-clock throughput
    (its final save included). tests/test_api.py calls it on the runs of the README's example,
    which trains those two (this file once trained two more of its own for it)."""
    from tests.runs import hpcrun

    out_ = hpcrun("report", "--site", site, "--out", str(out))
    page = Path(out_.stdout.strip()).read_text()
    losses = [attrs for attrs, _ in data_uris(page) if attrs["data-figure"].startswith("loss")]
    assert len(losses) == 1 and sorted(json.loads(html.unescape(losses[0]["data-series"]))) == ["ddp", "fsdp"]
    assert re.search(
        r'<tr class="good"><td class="t">agree</td><td class="t">tiny</td><td class="t">ddp, fsdp</td>', page
    ), page[-3000:]
    measured = r"<td>[\d.]+ k</td><td>[\d.]+ k</td><td>[\d.]+ %</td>"  # tokens/s, wall-clock, lost: none a dash
    assert "<th>wall-clock tokens/s</th>" in page and len(re.findall(measured, page)) == 2, page[:3000]
    shown = hpcrun("results", "--site", site, "--compare", "strategy").stdout.splitlines()
    header, table = shown[0].split(), [line.split() for line in shown[2 : shown.index("")]]  # then: do they agree?
    assert header[1:4] == ["tokens_per_s", "wall_tokens_per_s", "recovery_overhead"], shown
    assert [r[0] for r in table] == ["ddp", "fsdp"] and all(r[2:8:2] == ["k", "k", "%"] for r in table), shown


def test_bar_labels_of_seven_strategies_do_not_overlap() -> None:
    """Seven strategies in the half-page throughput panel: no two tick labels share a pixel."""
    import pandas as pd

    from hpcrun.report.figures import _bars, _pyplot, colours

    labels = ["ddp", "fsdp", "zero1", "zero2", "zero3", "zero3+cpu", "zero3+nvme"]
    table = pd.DataFrame({"label": labels * 2, "nodes": [1] * 7 + [2] * 7, "tokens_per_s_per_gpu": [5e3] * 14})
    fig, (left, _) = _pyplot().subplots(1, 2, figsize=(9, 3.8))  # as figures.per_gpu lays it out
    assert _bars(left, table, "tokens_per_s_per_gpu", 1e-3, colours(labels), "k tokens/s per GPU")
    fig.tight_layout()
    fig.canvas.draw()
    boxes = [t.get_window_extent() for t in left.get_xticklabels()]
    assert [t.get_text().replace("\n", "") for t in left.get_xticklabels()] == labels
    overlaps = [(labels[i], labels[j]) for i in range(7) for j in range(i + 1, 7) if boxes[i].overlaps(boxes[j])]
    assert not overlaps, overlaps
