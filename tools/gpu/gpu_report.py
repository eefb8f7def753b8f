"""The GPU run's report and archive (``tools/gpu/gpu_run.sh`` calls it after every part).

    python tools/gpu/gpu_report.py report WORK OUT [--final] [--archive-mb 20]
                                                           # OUT/report.md from what WORK holds now
                                                           # (and OUT/results.tar.gz)
    python tools/gpu/gpu_report.py gate WORK                   # the CUDA-graph gate's verdict: on,
                                                           # on-uncompiled or off
    python tools/gpu/gpu_report.py brief WORK [--out OUT]      # at most 15 lines: every goal figure, the
                                                           # GPU, torch, what was cut (OUT/brief.txt)
    python tools/gpu/gpu_report.py archive WORK OUT [--max-mb 20]

``WORK`` is the script's scratch tree: ``status.tsv`` (one line per part: name, state, exit code,
seconds, limit, note), ``plan.txt`` (the time budget), ``device.txt``, ``triton.txt`` (whether
one kernel compiled), one folder per benchmark part (``bench.md``, ``bench.json``, ``bench.png``),
``graphs.xml`` and ``graphs_compiled.xml`` (the CUDA-graph gate's JUnit XML), ``gpu_tests.xml``
(the other GPU tests') and the training run (``fast_fp16``) with its exit code in ``<run>.rc``.

A training run's figures are reported only when it exited 0; otherwise the report says how it
ended -- cut by its part's time limit (the part timed out: the run was told to stop, exit 75, or
killed), stopped early, killed, or CRASHED -- and its ``summary.json`` is not read as a result.
``report.md`` is written to a temporary name and renamed, so a run cut at any moment leaves the
previous complete report. The archive holds only text, tables and charts (no checkpoints, replay
files or ``*.tmp``), each file at most 5 MB, and stops adding files before ``--max-mb`` of raw
bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tarfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

GOAL_PARTS = ("goals512", "goals128", "goals_eager")
BENCH_PARTS = (*GOAL_PARTS, "bench512", "bench128", "syncfree", "ablations", "layout", "batchsrc", "compile", "optstep")
#: the speed goals the goals parts and the fast run measure (on an H200-class GPU, CUDA graphs):
#: an fp16 update's ms at most, and fp16's speed-up over IEEE fp32 (TF32 off) at least, per batch
GOAL_MS = {512: 6.0, 128: 3.0}
GOAL_SPEEDUP = {512: 2.5, 128: 2.0}
GOAL_FRAMES_PER_S = 800.0
#: what the goals parts time, in order (tools/gpu/gpu_run.sh's GOAL_MODES): the compiled one last, so a
#: cold compile that overruns its part's limit cuts only itself
GOAL_MODES = ("fp32", "fp16", "tf32", "bf16", "fp16-compiled")
FP16_MODES = ("fp16", "fp16-compiled")
#: how a mode is named in the goal lines: fp32 runs with TF32 off (pixelsac.precision), IEEE
#: arithmetic; tf32 is PyTorch's default for cuDNN convolutions
LABELS = {"fp32": "IEEE fp32", "tf32": "TF32"}
COMPILED_CASE = "fp16-compiled"  # the gate's case for the compiled optimizer
#: training run -> (the part it runs in, what it is)
RUNS = {
    "fast_fp16": ("fast", "fp16 + six, CUDA graphs, GPU-resident replay, overlapped collection, alone on the device"),
}
GRAPH_TEST = "test_real_cuda_graphs_equal_eager_updates_on_a_gpu"
BRIEF_LINES = 15
ARCHIVED_SUFFIXES = (".md", ".csv", ".json", ".log", ".txt", ".tsv", ".png", ".yaml", ".xml")
LARGEST_ARCHIVED = 5 * 10**6


def read_status(work: Path) -> list[dict[str, str]]:
    path = work / "status.tsv"
    if not path.is_file():
        return []
    fields = ("part", "state", "rc", "seconds", "limit", "note")
    return [dict(zip(fields, line.split("\t"))) for line in path.read_text().splitlines() if line.strip()]


def _junit_cases(path: Path) -> list[tuple[str, str]] | str:
    """``(name, outcome)`` of every test case in a JUnit XML file, or why there are none."""
    if not path.is_file():
        return "no result (the part did not run or was cut before pytest wrote its report)"
    try:
        root = ElementTree.parse(path).getroot()
    except ElementTree.ParseError as exc:
        return f"unreadable JUnit XML ({exc})"
    cases = []
    for case in root.iter("testcase"):
        outcome = "passed"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        cases.append((case.get("name", "?"), outcome))
    return cases


def gpu_tests(work: Path, name: str = "gpu_tests.xml") -> str:
    """A line on a pytest part: how many tests passed, failed, were skipped, and which failed."""
    cases = _junit_cases(work / name)
    if isinstance(cases, str):
        return cases
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for _, outcome in cases:
        counts[outcome] += 1
    line = ", ".join(f"{n} {k}" for k, n in counts.items())
    failed = [case for case, outcome in cases if outcome == "failed"]
    return line + (f" (failed: {', '.join(failed)})" if failed else "")


def gate(work: Path) -> tuple[str, str]:
    """The CUDA-graph gate's verdict from ``graphs.xml`` (every mode but the compiled optimizer's)
    and ``graphs_compiled.xml`` (that one, run second, so that a cold compile cut by the part's
    limit cannot take the other verdicts with it), and a line saying why: ``on`` when every mode's
    graphs equalled eager updates, ``on-uncompiled`` when every mode but the compiled optimizer's
    did (compiled cells are then timed eagerly only), else ``off``."""
    cases = _junit_cases(work / "graphs.xml")
    if isinstance(cases, str):
        return "off", cases
    compiled_cases = _junit_cases(work / "graphs_compiled.xml")  # its own run: a slow compile loses itself only
    graph_cases = {
        name: outcome
        for name, outcome in [*cases, *([] if isinstance(compiled_cases, str) else compiled_cases)]
        if name.startswith(GRAPH_TEST)
    }
    compiled = f"{GRAPH_TEST}[{COMPILED_CASE}]"
    others = {name: outcome for name, outcome in graph_cases.items() if name != compiled}
    passed = sum(outcome == "passed" for outcome in graph_cases.values())
    said = f"{passed} of {len(graph_cases)} modes' CUDA graphs equal eager updates"
    not_passed = [name.removeprefix(GRAPH_TEST) for name, outcome in graph_cases.items() if outcome != "passed"]
    if not_passed:
        said += f" (not: {', '.join(not_passed)})"
    if not others or any(outcome != "passed" for outcome in others.values()):
        return "off", said
    if graph_cases.get(compiled) != "passed":
        return "on-uncompiled", said + "; compiled cells timed without graphs"
    return "on", said


def _run_rc(work: Path, run: str) -> int | None:
    path = work / f"{run}.rc"
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def ended(rc: int, part_state: str | None) -> str:
    """How a training run that did not exit 0 ended, told apart: its part's time limit (the part
    timed out; the script passed the part's SIGTERM on, so the run saved and exited 75, or died of
    it, 143, or was killed, 137), a stop (75) or a signal from elsewhere, or a crash."""
    if part_state == "timed out":
        return "cut by its part's time limit"
    if rc == 75:
        return "stopped early"
    if rc > 128:
        return f"killed (signal {rc - 128})"
    return "CRASHED"


def _run_settings(run_dir: Path) -> str:
    """The settings a goals run adds, read from its stored config.yaml (plain text: ``num_envs: 8``,
    ``compile_optimizer: true``), as words to append to its description."""
    try:
        text = (run_dir / "config.yaml").read_text()
    except OSError:
        return ""
    envs = re.search(r"^\s*num_envs:\s*(\d+)", text, flags=re.M)
    compiled = re.search(r"^\s*compile_optimizer:\s*true", text, flags=re.M)
    said = [f"{envs.group(1)} environments"] if envs and envs.group(1) != "1" else []
    said += ["compiled optimizer"] if compiled else []
    return f" ({', '.join(said)})" if said else ""


def run_line(work: Path, run: str, what: str, part_state: str | None = None) -> str | None:
    """One line on a training run: its figures when it finished (exit 0), else how it ended
    (``part_state``: how the part that ran it ended, from ``status.tsv``)."""
    directory = work / run
    rc = _run_rc(work, run)
    if rc is None and not directory.exists():
        return None
    if rc is None:
        return f"- {what}: did not finish (its part ran out of time): no result"
    if rc != 0:
        return f"- {what}: {ended(rc, part_state)} (exit {rc}; see {run}.log): its summary is not a result"
    summary_path = directory / "summary.json"
    if not summary_path.is_file():
        return f"- {what}: exit 0 but no summary.json"
    s = json.loads(summary_path.read_text())
    what += _run_settings(directory)
    fmt = lambda x, f: "n/a" if x is None else format(x, f)  # noqa: E731
    speed = (
        f"{fmt(s.get('speedup_vs_fp32'), '.2f')}x vs fp32 ({s.get('speedup_basis')})"
        if s.get("speedup_vs_fp32") is not None
        else f"no speed-up figure ({(s.get('speedup_basis') or 'not calibrated').removeprefix('none: ')})"
    )
    return (
        f"- {what}: {fmt(s.get('ms_per_update'), '.2f')} ms/update over {s.get('timed_updates')} timed updates, "
        f"{fmt(s.get('env_frames_per_s'), ',.0f')} env frames/s, {speed}; state vs fp32 "
        f"{fmt(s.get('memory_vs_fp32'), '.2f')}, skipped {s.get('skipped')}, best eval return "
        f"{fmt(s.get('best_eval_return'), '.1f')}"
    )


def _bench_json(work: Path, part: str) -> dict:
    try:
        return json.loads((work / part / "bench.json").read_text())
    except (OSError, ValueError):
        return {}


def goal_rows(work: Path) -> dict[tuple[str, int, bool], dict]:
    """``(mode, batch, graphed) -> bench row`` of every goals cell that ran and was timed."""
    found = {}
    for part in GOAL_PARTS:
        for r in _bench_json(work, part).get("rows", []):
            if r.get("status") == "ok" and r.get("ms_mean"):
                graphed = "cuda_graphs" in (r.get("variant") or "")
                found[(r["mode"], int(r["batch_size"]), graphed)] = r
    return found


def cut_cells(work: Path) -> list[str]:
    """The goals cells that did not give a time: each part's planned cells without a row, and
    rows that failed, as ``part: mode batch (why)``; a goals part that never wrote its table
    (cut before its first cell, or not started) as ``part: nothing measured (state)``."""
    states = {s["part"]: s["state"] for s in read_status(work)}
    said = []
    for part in GOAL_PARTS:
        if part not in states:
            continue
        meta = _bench_json(work, part)
        if not meta:
            if states[part] != "ok":
                said.append(f"{part}: nothing measured ({states[part]})")
            continue
        rows = {(r["mode"], int(r["batch_size"]), r.get("variant", "")): r for r in meta.get("rows", [])}
        for cell in meta.get("planned", []):
            key = (cell["mode"], int(cell["batch_size"]), cell.get("variant", ""))
            row = rows.get(key)
            if row is None:
                said.append(f"{part}: {cell['mode']} {cell['batch_size']} (not reached: part {states[part]})")
            elif row.get("status") != "ok":
                said.append(f"{part}: {cell['mode']} {cell['batch_size']} ({row.get('status', '')[:80]})")
    return said


def _label(mode: str) -> str:
    return LABELS.get(mode, mode)


def batch_source(row: dict) -> str:
    """Where the timed update found its batch: the goal lines state it (a copy from the host is
    part of the time, 1-3 ms of a 6-ms goal at batch 512)."""
    variant = row.get("variant") or ""
    if "device_batch" in variant:
        return "batch on the GPU"
    if "pinned_batch" in variant or (row.get("device") == "cuda" and "host_batch" not in variant):
        return "batch copied from pinned host memory"
    return "batch in host memory"


def arithmetic_line(batch: int, row: dict) -> str | None:
    """What the ms goal asks of the GPU: the update's FLOPs (the benchmark's ``gflop_per_update``)
    over the goal's time, beside the rate ``row``'s time sustained; None for a row without them."""
    gflop = row.get("gflop_per_update")
    if not gflop:
        return None
    achieved = float(gflop) / float(row["ms_mean"])
    return (
        f"- batch {batch}: {float(gflop):,.1f} GFLOP per update; {GOAL_MS[batch]:g} ms asks "
        f"{float(gflop) / GOAL_MS[batch]:,.1f} TFLOP/s sustained, {row['mode']} sustained {achieved:,.1f}"
    )


def steady_frames_per_s(run_dir: Path) -> float | None:
    """The median of the run's logged ``perf/env_frames_per_s`` over the later half of its log
    intervals: the loop's rate once compilation and graph capture are behind it (the summary's
    figure divides by the whole run, start-up included)."""
    import csv
    import statistics

    try:
        with (run_dir / "metrics.csv").open() as f:
            rows = list(csv.DictReader(f))
        values = [float(row["perf/env_frames_per_s"]) for row in rows if row.get("perf/env_frames_per_s")]
    except (OSError, ValueError, KeyError):
        return None
    later = values[len(values) // 2 :]
    return statistics.median(later) if later else None


def _goal_basis(rows: dict[tuple[str, int, bool], dict], batch: int) -> tuple[bool, str] | None:
    """Which rows a batch's goals are judged on: the CUDA-graph rows where an fp16 one ran, else
    the eager ones (named so); None when no fp16 row ran."""
    for graphed, kind in ((True, "CUDA graphs"), (False, "eager (no CUDA-graph fp16 row)")):
        if any((mode, batch, graphed) in rows for mode in FP16_MODES):
            return graphed, kind
    return None


def end_to_end(work: Path) -> tuple[float | None, str]:
    """The fast run's steady env frames/s (None if it did not finish) and its description."""
    rate = steady_frames_per_s(work / "fast_fp16") if _run_rc(work, "fast_fp16") == 0 else None
    return rate, "fast_fp16" + _run_settings(work / "fast_fp16")


def goals_lines(work: Path) -> list[str]:
    """Each speed goal, the figure measured for it and whether it is met ("not measured" when
    the part or run did not produce it). The fp16 figure is the faster of eager-step fp16 and
    fp16-compiled, named; fp32 is IEEE fp32 (TF32 off), with TF32's ratio beside it; every line
    says where the batch was."""
    rows = goal_rows(work)
    lines = []
    for batch in GOAL_MS:
        basis = _goal_basis(rows, batch)
        if basis is None:
            goal = f"fp16 update <= {GOAL_MS[batch]:g} ms, >= {GOAL_SPEEDUP[batch]:g}x IEEE fp32"
            lines.append(f"- batch {batch}: {goal}: not measured")
            continue
        graphed, kind = basis
        ms = {mode: float(r["ms_mean"]) for (mode, b, g), r in rows.items() if b == batch and g == graphed}
        fp16 = [(ms[mode], mode) for mode in FP16_MODES if mode in ms]
        best = min(fp16)
        source = batch_source(rows[(best[1], batch, graphed)])
        each = ", ".join(f"{mode} {value:.2f} ms" for value, mode in fp16)
        met = "met" if best[0] <= GOAL_MS[batch] else "not met"
        lines.append(f"- batch {batch}, {kind}, {source}: fp16 update <= {GOAL_MS[batch]:g} ms: {met} ({each})")
        fp32 = ms.get("fp32")
        if fp32 is None:
            lines.append(
                f"- batch {batch}: fp16 >= {GOAL_SPEEDUP[batch]:g}x IEEE fp32: not measured (no IEEE fp32 row)"
            )
        else:
            speedups = ", ".join(f"{mode} {fp32 / value:.2f}x" for value, mode in fp16)
            met = "met" if fp32 / best[0] >= GOAL_SPEEDUP[batch] else "not met"
            goal = f"fp16 >= {GOAL_SPEEDUP[batch]:g}x IEEE fp32 ({fp32:.2f} ms)"
            tf32 = f"; TF32 {ms['tf32']:.2f} ms, fp16 {ms['tf32'] / best[0]:.2f}x it" if "tf32" in ms else ""
            lines.append(f"- batch {batch}, {kind}: {goal}: {met} ({speedups}){tf32}")
        arithmetic = arithmetic_line(batch, rows[(best[1], batch, graphed)])
        if arithmetic:
            lines.append(arithmetic)
    rate, what = end_to_end(work)
    if rate is None:
        goal = f">= {GOAL_FRAMES_PER_S:,.0f} env frames/s"
        lines.append(f"- end to end: {goal}: not measured (the fast run did not finish)")
    else:
        met = "met" if rate >= GOAL_FRAMES_PER_S else "not met"
        lines.append(
            f"- end to end ({what}, later half of its log intervals, GPU-resident replay): "
            f">= {GOAL_FRAMES_PER_S:,.0f} env frames/s: {met} ({rate:,.0f})"
        )
    lines.append(
        "- amp is not among the goal rows: it is PyTorch's autocast as shipped, whose K = 39,200 projection "
        "GEMM is not split (split-K with fp32 sums is this project's change to pure fp16/bf16)"
    )
    return lines


def _mib(value: object) -> str:
    return "n/a" if not value else f"{float(value) / 2**20:,.0f} MiB"


def _brief_batch(rows: dict[tuple[str, int, bool], dict], batch: int, graphed: bool) -> list[str]:
    """A batch size's figures for one kind of update: every mode's ms, and for graphs (or eager
    where there were no graphs) the goal verdicts and the peak memory."""
    ms = {mode: float(r["ms_mean"]) for (mode, b, g), r in rows.items() if b == batch and g == graphed}
    kind = "graphs" if graphed else "eager"
    if not ms:
        return [f"batch {batch} {kind}: not measured"]
    any_row = next(r for (_, b, g), r in rows.items() if b == batch and g == graphed)
    figures = " | ".join(f"{_label(mode)} {ms[mode]:.2f}" for mode in GOAL_MODES if mode in ms)
    lines = [f"batch {batch} {kind} ({batch_source(any_row)}), ms/update: {figures}"]
    fp16 = [(ms[mode], mode) for mode in FP16_MODES if mode in ms]
    if not fp16:
        return lines
    best, name = min(fp16)
    said = [f"{name} <= {GOAL_MS[batch]:g} ms: {'met' if best <= GOAL_MS[batch] else 'not met'}"]
    if "fp32" in ms:
        ratio = ms["fp32"] / best
        verdict = "met" if ratio >= GOAL_SPEEDUP[batch] else "not met"
        said.append(f"{ratio:.2f}x IEEE fp32 (>= {GOAL_SPEEDUP[batch]:g}x: {verdict})")
    if "tf32" in ms:
        said.append(f"{ms['tf32'] / best:.2f}x TF32")
    if "bf16" in ms:
        said.append(f"bf16 {ms['fp32'] / ms['bf16']:.2f}x IEEE fp32" if "fp32" in ms else "")
    peak16 = rows[(name, batch, graphed)].get("peak_mem_bytes")
    peak32 = rows.get(("fp32", batch, graphed), {}).get("peak_mem_bytes")
    if peak16:
        share = f" ({float(peak16) / float(peak32):.2f}x)" if peak32 else ""
        said.append(f"peak {name} {_mib(peak16)}, IEEE fp32 {_mib(peak32)}{share}")
    lines.append("  " + "; ".join(item for item in said if item))
    return lines


def brief(work: Path) -> list[str]:
    """At most :data:`BRIEF_LINES` lines: the GPU, torch and Python; every goal figure (ms per
    update of each goal mode at batches 512 and 128, graphs and eager, the ratios, peak memory,
    end-to-end env frames/s); the checks (gate, triton, split-K's path); what was cut."""
    device = (work / "device.txt").read_text().strip().splitlines() if (work / "device.txt").is_file() else []
    lines = [f"pixelsac on a GPU: {device[0].removeprefix('- ') if device else 'no device line (set-up failed)'}"]
    rows = goal_rows(work)
    for batch in GOAL_MS:
        basis = _goal_basis(rows, batch)
        graphed_first = basis is None or basis[0]
        lines += _brief_batch(rows, batch, True) if graphed_first else []
        eager = _brief_batch(rows, batch, False)
        lines += eager if not graphed_first else eager[:1]
    rate, what = end_to_end(work)
    lines.append(
        f"end to end: not measured ({what} did not finish)"
        if rate is None
        else f"end to end: {rate:,.0f} env frames/s (>= {GOAL_FRAMES_PER_S:,.0f}: "
        f"{'met' if rate >= GOAL_FRAMES_PER_S else 'not met'}; {what})"
    )
    triton = (work / "triton.txt").read_text().strip() if (work / "triton.txt").is_file() else "not checked"
    verdict, said = gate(work)
    split = sorted({r.get("split_k", "n/a") for (mode, _, _), r in rows.items() if mode in FP16_MODES})
    lines.append(
        f"checks: CUDA graphs {verdict} ({said}); triton {triton[:90]}; fp16 split-K: {', '.join(split) or 'n/a'}"
    )
    if not triton.startswith("ok"):
        lines.append("dropped: fp16-compiled cells and the fast run's compiled optimizer (triton cannot compile)")
    status = read_status(work)
    cut = [f"{s['part']} {s['state']}" for s in status if s["state"] != "ok"] + cut_cells(work)
    lines.append("cut: " + ("; ".join(cut) if cut else "nothing"))
    lines.append(f"other GPU tests: {gpu_tests(work)}")
    if len(lines) > BRIEF_LINES:  # the cut list is what grows: keep the figures, shorten the rest
        lines = lines[: BRIEF_LINES - 1] + [" / ".join(lines[BRIEF_LINES - 1 :])[:400]]
    return lines


def report(work: Path, out: Path, final: bool = False) -> str:
    lines = ["# pixelsac on a GPU: what half precision buys", ""]
    status = read_status(work)
    goals = any(s["part"] in GOAL_PARTS for s in status)
    if goals:
        lines += ["## In brief", "", "```", *brief(work), "```", ""]
    for name in ("device.txt", "plan.txt"):
        if (work / name).is_file():
            lines += [(work / name).read_text().strip(), ""]
    if (work / "triton.txt").is_file():
        triton = (work / "triton.txt").read_text().strip()
        drop = "" if triton.startswith("ok") else " -- compiled cells and the compiled optimizer dropped"
        lines += [f"- triton: {triton}{drop}", ""]
    if goals:
        lines += ["## Goals", "", *goals_lines(work), ""]
    lines += ["## Parts", "", "| part | state | exit | seconds | limit | note |", "|---|---|---|---|---|---|"]
    lines += [
        f"| {s['part']} | {s['state']} | {s.get('rc', '')} | {s.get('seconds', '')} | {s.get('limit', '')} "
        f"| {s.get('note', '')} |"
        for s in status
    ]
    if not final:
        lines += ["", "(the run is still going: this report is rewritten after every part)"]
    verdict, said = gate(work)
    lines += ["", "## GPU tests (pytest -m gpu)", "", f"- CUDA-graph gate (graphs.xml): {verdict}: {said}"]
    lines += [f"- every other GPU test (gpu_tests.xml): {gpu_tests(work)}"]
    states = {s["part"]: s for s in status}
    for name in BENCH_PARTS:
        md = work / name / "bench.md"
        if not md.is_file():
            continue
        state = states.get(name, {}).get("state", "running")
        note = "" if state == "ok" else f" -- part {state}: the rows measured before it stopped"
        body = md.read_text().replace("# pixelsac update-step benchmark", "").strip()
        lines += ["", f"## {name}{note}", "", body]
        if final and (work / name / "bench.png").is_file():
            (out / f"{name}.png").write_bytes((work / name / "bench.png").read_bytes())
    run_lines = [
        line
        for run, (part, what) in RUNS.items()
        if (line := run_line(work, run, what, states.get(part, {}).get("state")))
    ]
    if run_lines:
        lines += ["", "## Training runs", "", *run_lines]
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "report.md.tmp"
    partial.write_text(text)
    os.replace(partial, out / "report.md")
    return text


def archive(work: Path, out: Path, max_mb: float) -> tuple[int, int]:
    """``out/results.tar.gz``: text, tables and charts of ``work``, at most ``max_mb`` raw MB."""
    budget = int(max_mb * 10**6)
    files = sorted(
        (p for p in work.rglob("*") if p.is_file() and p.suffix in ARCHIVED_SUFFIXES and not p.name.endswith(".tmp")),
        key=lambda p: (p.suffix == ".png", p.stat().st_size),  # tables first, then the smallest
    )
    total, count = 0, 0
    partial = out / "results.tar.gz.tmp"
    with tarfile.open(partial, "w:gz") as tar:
        for path in files:
            size = path.stat().st_size
            if size > LARGEST_ARCHIVED or total + size > budget:
                continue
            tar.add(path, arcname=str(path.relative_to(work)))
            total, count = total + size, count + 1
    os.replace(partial, out / "results.tar.gz")
    return count, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report")
    rep.add_argument("work", type=Path)
    rep.add_argument("out", type=Path)
    rep.add_argument("--final", action="store_true")
    rep.add_argument("--archive-mb", type=float, default=None, help="also write results.tar.gz, at most this size")
    verdict = sub.add_parser("gate")
    verdict.add_argument("work", type=Path)
    short = sub.add_parser("brief")
    short.add_argument("work", type=Path)
    short.add_argument("--out", type=Path, default=None, help="also write OUT/brief.txt")
    arc = sub.add_parser("archive")
    arc.add_argument("work", type=Path)
    arc.add_argument("out", type=Path)
    arc.add_argument("--max-mb", type=float, default=20.0)
    args = parser.parse_args(argv)
    if not args.work.is_dir():
        print(f"error: {args.work}: no such folder", file=sys.stderr)
        return 2
    if args.command == "report":
        # the archive first: report.md is the mark that a step is complete, so a run cut just after
        # a part's table appears already has that part in results.tar.gz
        if args.archive_mb is not None:
            archive(args.work, args.out, args.archive_mb)
        report(args.work, args.out, args.final)
    elif args.command == "gate":
        print(gate(args.work)[0])
    elif args.command == "brief":
        text = "\n".join(brief(args.work)) + "\n"
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "brief.txt").write_text(text)
        print(text, end="")
    else:
        count, total = archive(args.work, args.out, args.max_mb)
        print(f"gpu_report: archived {count} files, {total / 1e6:.1f} MB raw")
    return 0


if __name__ == "__main__":
    sys.exit(main())
