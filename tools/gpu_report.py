"""The GPU run's report and archive (``tools/gpu_run.sh`` calls it after every part).

    python tools/gpu_report.py report WORK OUT [--final] [--archive-mb 20]
                                                           # OUT/report.md from what WORK holds now
                                                           # (and OUT/results.tar.gz)
    python tools/gpu_report.py graphs-ok WORK              # exit 0 when the GPU tests showed CUDA
                                                           # graphs equal to eager updates
    python tools/gpu_report.py archive WORK OUT [--max-mb 20]

``WORK`` is the script's scratch tree: ``status.tsv`` (one line per part: name, state, exit code,
seconds, limit, note), ``plan.txt`` (the time budget), ``device.txt``, one folder per benchmark
part (``bench.md``, ``bench.png``), ``gpu_tests.xml`` (pytest's JUnit XML) and the training run
(``fast_fp16``) with its exit code in ``<run>.rc``.

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

BENCH_PARTS = ("goals", "bench512", "bench128", "syncfree", "ablations", "layout", "batchsrc", "compile", "optstep")
#: the speed goals the ``goals`` part and its fast run measure (on an H200-class GPU, CUDA graphs):
#: an fp16 update's ms at most, and fp16's speed-up over fp32 at least, per batch size
GOAL_MS = {512: 6.0, 128: 3.0}
GOAL_SPEEDUP = {512: 2.5, 128: 2.0}
GOAL_FRAMES_PER_S = 800.0
FP16_MODES = ("fp16", "fp16-compiled")
#: training run -> (the part it runs in, what it is)
RUNS = {
    "fast_fp16": ("fast", "fp16 + six, CUDA graphs, GPU-resident replay, overlapped collection, alone on the device"),
}
GRAPH_TEST = "test_real_cuda_graphs_equal_eager_updates_on_a_gpu"
ARCHIVED_SUFFIXES = (".md", ".csv", ".json", ".log", ".txt", ".tsv", ".png", ".yaml", ".xml")
LARGEST_ARCHIVED = 5 * 10**6


def read_status(work: Path) -> list[dict[str, str]]:
    path = work / "status.tsv"
    if not path.is_file():
        return []
    fields = ("part", "state", "rc", "seconds", "limit", "note")
    return [dict(zip(fields, line.split("\t"))) for line in path.read_text().splitlines() if line.strip()]


def gpu_tests(work: Path) -> tuple[str, bool]:
    """A line on the GPU tests, and whether the CUDA-graph check ran and passed for every mode."""
    path = work / "gpu_tests.xml"
    if not path.is_file():
        return "no result (the part did not run or was cut before pytest wrote its report)", False
    try:
        root = ElementTree.parse(path).getroot()
    except ElementTree.ParseError as exc:
        return f"unreadable JUnit XML ({exc})", False
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failed, graph_cases, graph_ok = [], 0, True
    for case in root.iter("testcase"):
        outcome = "passed"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
            failed.append(case.get("name", "?"))
        elif case.find("skipped") is not None:
            outcome = "skipped"
        counts[outcome] += 1
        if case.get("name", "").startswith(GRAPH_TEST):
            graph_cases += 1
            graph_ok = graph_ok and outcome == "passed"
    line = ", ".join(f"{n} {k}" for k, n in counts.items())
    if failed:
        line += f" (failed: {', '.join(failed)})"
    graphs = graph_cases > 0 and graph_ok
    line += "; CUDA graphs equal eager updates: " + ("yes" if graphs else "not shown")
    return line, graphs


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


def _graphed_rows(work: Path) -> dict[tuple[str, int], dict]:
    """``(mode, batch) -> bench row`` of the goals part's CUDA-graph cells that ran."""
    path = work / "goals" / "bench.json"
    try:
        rows = json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return {}
    return {
        (r["mode"], int(r["batch_size"])): r
        for r in rows
        if r.get("status") == "ok" and "cuda_graphs" in (r.get("variant") or "") and r.get("ms_mean")
    }


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


def goals_lines(work: Path) -> list[str]:
    """Each speed goal, the figure measured for it and whether it is met ("not measured" when
    the part or run did not produce it). The fp16 figure is the faster of eager-step fp16 and
    fp16-compiled, named."""
    rows = _graphed_rows(work)
    ms = {key: float(row["ms_mean"]) for key, row in rows.items()}
    lines = []
    for batch in GOAL_MS:
        fp16 = [(ms[(mode, batch)], mode) for mode in FP16_MODES if (mode, batch) in ms]
        best = min(fp16) if fp16 else None
        fp32 = ms.get(("fp32", batch))
        if best is None:
            goal = f"fp16 update <= {GOAL_MS[batch]:g} ms, >= {GOAL_SPEEDUP[batch]:g}x fp32"
            lines.append(f"- batch {batch}: {goal}: not measured")
            continue
        each = ", ".join(f"{mode} {value:.2f} ms" for value, mode in fp16)
        met = "met" if best[0] <= GOAL_MS[batch] else "not met"
        lines.append(f"- batch {batch}, CUDA graphs: fp16 update <= {GOAL_MS[batch]:g} ms: {met} ({each})")
        if fp32 is None:
            lines.append(f"- batch {batch}: fp16 >= {GOAL_SPEEDUP[batch]:g}x fp32: not measured (no graphed fp32 row)")
        else:
            speedups = ", ".join(f"{mode} {fp32 / value:.2f}x" for value, mode in fp16)
            met = "met" if fp32 / best[0] >= GOAL_SPEEDUP[batch] else "not met"
            goal = f"fp16 >= {GOAL_SPEEDUP[batch]:g}x fp32 ({fp32:.2f} ms)"
            lines.append(f"- batch {batch}, CUDA graphs: {goal}: {met} ({speedups})")
        arithmetic = arithmetic_line(batch, rows[(best[1], batch)])
        if arithmetic:
            lines.append(arithmetic)
    rate = steady_frames_per_s(work / "fast_fp16") if _run_rc(work, "fast_fp16") == 0 else None
    if rate is None:
        goal = f">= {GOAL_FRAMES_PER_S:,.0f} env frames/s"
        lines.append(f"- end to end: {goal}: not measured (the fast run did not finish)")
    else:
        met = "met" if rate >= GOAL_FRAMES_PER_S else "not met"
        lines.append(
            f"- end to end (fast_fp16, later half of its log intervals): >= {GOAL_FRAMES_PER_S:,.0f} env frames/s: "
            f"{met} ({rate:,.0f})"
        )
    return lines


def report(work: Path, out: Path, final: bool = False) -> str:
    lines = ["# pixelsac on a GPU: what half precision buys", ""]
    for name in ("device.txt", "plan.txt"):
        if (work / name).is_file():
            lines += [(work / name).read_text().strip(), ""]
    status = read_status(work)
    if any(s["part"] == "goals" for s in status):
        lines += ["## Goals", "", *goals_lines(work), ""]
    lines += ["## Parts", "", "| part | state | exit | seconds | limit | note |", "|---|---|---|---|---|---|"]
    lines += [
        f"| {s['part']} | {s['state']} | {s.get('rc', '')} | {s.get('seconds', '')} | {s.get('limit', '')} "
        f"| {s.get('note', '')} |"
        for s in status
    ]
    if not final:
        lines += ["", "(the run is still going: this report is rewritten after every part)"]
    tests_line, _ = gpu_tests(work)
    lines += ["", "## GPU tests (pytest -m gpu)", "", tests_line]
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
    ok = sub.add_parser("graphs-ok")
    ok.add_argument("work", type=Path)
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
    elif args.command == "graphs-ok":
        return 0 if gpu_tests(args.work)[1] else 1
    else:
        count, total = archive(args.work, args.out, args.max_mb)
        print(f"gpu_report: archived {count} files, {total / 1e6:.1f} MB raw")
    return 0


if __name__ == "__main__":
    sys.exit(main())
