"""Measuring the benchmark's cells: one cell in this process or in a fresh one (whose peak
resident set is the cell's own), and the whole plan, writing results as they come."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from pixelsac import lifeline
from pixelsac.bench.plan import (
    CELL_START_SECONDS,
    CPU_GFLOPS_PER_THREAD,
    MODES,
    REFERENCE_FP16_SLOWDOWN,
    CellSpec,
    Mode,
    Plan,
    expected_seconds,
)
from pixelsac.bench.report import _cpu_statement, _fmt, _header, _mib, add_ratios, markdown, write_outputs
from pixelsac.config import load_config, to_plain

_CELL_MARK = "PIXELSAC_BENCH_ROW "


def _compute(cfg: Any, mode: Mode, device_type: str) -> tuple[str, bool]:
    """What the arithmetic really ran in, and whether half precision was emulated on a CPU."""
    from pixelsac.precision import PrecisionPolicy, native_half_kernels

    policy = PrecisionPolicy.from_config(cfg, device_type)
    if mode.tf32:
        return "fp32 storage, TF32 tensor cores", False
    if policy.mode == "fp32":
        return ("fp32 (IEEE, TF32 off)" if device_type == "cuda" else "fp32"), False
    if policy.mode == "amp":
        return ("autocast fp16" + (" (native CPU fp16 kernels)" if device_type == "cpu" else "")), False
    low = str(policy.param_dtype).removeprefix("torch.")
    if policy.fp32_accumulate:
        return f"{low} storage, fp32-accumulated conv/matmul (emulated tensor cores)", True
    if device_type != "cpu":
        return f"{low} tensor cores", False
    isa = native_half_kernels(policy.param_dtype)
    return (f"native CPU {low} kernels ({isa})" if isa else f"CPU {low} reference kernels (no native ones)"), False


def _peak_kind(timed: Any) -> str:
    """What the cell's peak counts; only peaks of one kind are divided by each other."""
    if timed.peak_bytes is None:
        return "not measured (CPU, in-process)"
    if timed.graph_setup_updates:  # read from before capture: the graphs' pool is in it
        return "cuda_max_allocated (from before CUDA graph capture)"
    return "cuda_max_allocated"


def run_cell(spec: CellSpec) -> dict[str, Any]:
    """Measure one cell in this process; returns its row (no ratios yet)."""
    import torch

    from pixelsac.nets import apply_speed_options
    from pixelsac.perf import place_batch, synthetic_batch, time_updates

    cfg = load_config(spec.overrides)
    mode = MODES[spec.mode]
    device = torch.device(spec.device)  # the module's precision policy sets TF32 (perf.tf32) in its setup
    batch = synthetic_batch(spec.batch_size, tuple(spec.obs_shape), spec.action_dim, seed=int(cfg.seed))
    batch = place_batch(batch, spec.batch_source, device)

    from pixelsac.lowp import describe_split_k, reset_split_k_paths

    reset_split_k_paths()  # this cell's long-K products alone (cells may share a process)

    def prepare(module: Any) -> None:
        # the layout is the module's own (perf.channels_last in the cell's overrides)
        apply_speed_options(module, False, spec.compile, spec.compile_mode, spec.compile_backend)

    timed = time_updates(
        to_plain(cfg),
        tuple(spec.obs_shape),
        spec.action_dim,
        batch,
        device,
        spec.updates,
        spec.warmup,
        prepare=prepare,
        emulation=spec.emulation,
        tensor_peak=device.type != "cuda" and not spec.compile,
        meter_saved=not spec.compile,  # the meter's hook breaks the first compile (perf.calibration)
    )
    compute, emulated = _compute(cfg, mode, device.type)
    saved = timed.saved
    row: dict[str, Any] = {
        "mode": spec.mode,
        "variant": spec.variant,
        "speed_variant": spec.speed_variant,
        "emulation": spec.emulation or ("saves_low" if emulated else None),
        "batch_size": spec.batch_size,
        "device": spec.device,
        "compute": compute,
        "emulated": emulated,
        "updates": len(timed.ms),
        "warmup": timed.warmup,  # rounded up to whole update cycles
        "graph_setup_updates": timed.graph_setup_updates,  # CUDA graphs' eager warm-ups + captures, untimed
        "graph_pool_bytes": timed.graph_pool_bytes,
        "ms_mean": timed.mean_ms,
        "ms_std": timed.std_ms,
        "ms_median": statistics.median(timed.ms) if timed.ms else math.nan,
        "ms_min": min(timed.ms) if timed.ms else math.nan,
        "peak_mem_bytes": timed.peak_bytes,
        "peak_mem_kind": _peak_kind(timed),
        "rss_peak_bytes": None,
        "state_bytes": timed.state["total"],
        "state_parameters": timed.state["parameters"],
        "state_optimizer": timed.state["optimizer"],
        "state_target": timed.state["target"],
        "state_groups": timed.state_groups,
        "saved_bytes": saved.activations if saved else None,
        "saved_state_bytes": saved.state if saved else None,
        "saved_peak_live_bytes": saved.peak_live_activations if saved else None,
        "saved_by_dtype": saved.by_dtype if saved else None,
        "tensor_peak_bytes": timed.tensor_peak_bytes,
        "ms_by_form": timed.ms_by_form,
        "finite_after_first_update": timed.finite_after_first,
        "finite_at_end": timed.finite_at_end,
        **{f"skipped_{k}": v for k, v in timed.skipped.items()},
        **{f"loss_scale_{k}": v for k, v in timed.loss_scales.items()},
        "split_k": describe_split_k(),  # the path the long-K products took: mixed_gemm, fp32_copies (why), off
        **_dispatch_counts(cfg, spec),
        "status": "ok",
    }
    return row


def _dispatch_counts(cfg: Any, spec: CellSpec) -> dict[str, Any]:
    """The cell's update counted in the GPU's form (:mod:`pixelsac.perf.opcount`): aten ops, the
    kernel estimate, dtype casts and host reads per full and per critic-only update (None where a
    kind never ran)."""
    from pixelsac.perf.opcount import count_update_ops

    counts = count_update_ops(to_plain(cfg), tuple(spec.obs_shape), spec.action_dim, device=spec.device)
    row: dict[str, Any] = {}
    for kind, suffix in (("full", "full"), ("critic-only", "critic")):
        each = counts.get(kind)
        row[f"ops_{suffix}"] = each.ops if each else None
        row[f"kernels_{suffix}"] = each.kernels if each else None
        row[f"casts_{suffix}"] = each.casts if each else None
        row[f"host_reads_{suffix}"] = each.host_reads if each else None
        row[f"casts_by_dtypes_{suffix}"] = each.casts_by_dtypes if each else None
    return row


def _plan_flops(spec: CellSpec, counted: dict[str, Any]) -> Any:
    """The update's FLOPs at ``spec``'s batch size, counted once for the whole plan in ``counted``."""
    from pixelsac.perf.flops import count_update_flops

    if "flops" not in counted:
        config = to_plain(load_config(spec.overrides))
        counted["flops"] = count_update_flops(config, tuple(spec.obs_shape), spec.action_dim)
    return counted["flops"].at_batch(spec.batch_size)


def _label(spec: CellSpec) -> str:
    return f"{spec.mode}{' ' + spec.variant if spec.variant else ''} batch {spec.batch_size}"


def expected_lines(plan: Plan, counted: dict[str, Any]) -> list[str]:
    """On a CPU, each cell's expected time (:func:`pixelsac.bench.plan.expected_seconds`) and
    the total, before any cell runs; nothing on a GPU."""
    if plan.device != "cpu" or not plan.cells:
        return []
    import torch

    threads = torch.get_num_threads()
    try:
        flops = [_plan_flops(spec, counted).gflop_per_update for spec in plan.cells]
    except Exception as exc:  # a figure missing, not the benchmark
        return [f"expected times: not estimated ({type(exc).__name__}: {exc})"]
    seconds = [expected_seconds(spec, gflop, threads) for spec, gflop in zip(plan.cells, flops)]
    lines = [
        f"expected times on this CPU (rough: {CPU_GFLOPS_PER_THREAD:.0f} GFLOP/s a thread x {threads} threads, "
        f"{CELL_START_SECONDS:.0f} s a cell's start; reference fp16 kernels x{REFERENCE_FP16_SLOWDOWN:.0f}):"
    ]
    lines += [f"  {_label(spec)}: about {_duration(s)}" for spec, s in zip(plan.cells, seconds)]
    lines.append(f"  in all: about {_duration(sum(seconds))}")
    return lines


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _arithmetic(spec: CellSpec, ms_per_update: float, counted: dict[str, Any]) -> dict[str, Any]:
    """The cell's FLOPs per update (:mod:`pixelsac.perf.flops`: counted on the CPU in about two
    seconds at DrQ's sizes, once for the whole plan in ``counted``: every mode, speed switch and
    batch size runs the same products, scaled with the batch) and the rate its measured time
    sustains."""
    flops = _plan_flops(spec, counted)
    return {
        "gflop_full": flops.full / 1e9,
        "gflop_critic": flops.critic_only / 1e9,
        "gflop_per_update": flops.gflop_per_update,
        "tflops_achieved": flops.achieved_tflops(ms_per_update) if ms_per_update > 0 else None,
    }


def cell_main(spec_json: str) -> int:
    """Child-process entry: measure one cell and print its row; the peak RSS is this process's."""
    from pixelsac.perf import rss_bytes, rss_peak_bytes

    spec = CellSpec(**json.loads(spec_json))
    apply_threads(spec.overrides)
    baseline = rss_bytes()  # libraries imported, nothing of the agent built yet
    row = run_cell(spec)
    peak = rss_peak_bytes()
    if spec.device == "cpu" and baseline is not None:
        row["peak_mem_bytes"] = max(peak - baseline, 0)
        row["peak_mem_kind"] = "rss_peak_above_baseline (fresh process)"
        row["rss_peak_bytes"] = peak
    print(_CELL_MARK + json.dumps(row), flush=True)
    return 0


def _count(row: dict[str, Any], key: str) -> str:
    full, critic = row.get(f"{key}_full"), row.get(f"{key}_critic")
    return f"{'n/a' if full is None else format(full, ',d')} / {'n/a' if critic is None else format(critic, ',d')}"


def apply_threads(overrides: list[str]) -> None:
    import torch

    threads = load_config(overrides).train.num_threads
    if threads:
        torch.set_num_threads(threads)


def run_cell_isolated(spec: CellSpec) -> dict[str, Any]:
    """Measure one cell in a fresh Python process (its peak RSS is the cell's own)."""
    package_root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [sys.executable, "-m", "pixelsac.bench", "--cell", json.dumps(dataclasses.asdict(spec))],
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=lifeline.tie_before_exec(),  # killed with the benchmark, however it ends
    )
    for line in result.stdout.splitlines():
        if line.startswith(_CELL_MARK):
            return json.loads(line[len(_CELL_MARK) :])
    tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
    raise RuntimeError(f"cell process exited {result.returncode}: {tail}")


def _measure(plan: Plan, spec: CellSpec) -> dict[str, Any]:
    try:
        return run_cell_isolated(spec) if plan.isolate else run_cell(spec)
    except Exception as exc:  # one broken cell (a compile failure, out of memory) must not lose the rest
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return {
            "mode": spec.mode,
            "variant": spec.variant,
            "speed_variant": spec.speed_variant,
            "batch_size": spec.batch_size,
            "device": spec.device,
            "status": f"failed: {type(exc).__name__}: {message}"[:300],
        }


def run_plan(plan: Plan) -> list[dict[str, Any]]:
    """Measure every cell (a failing cell is recorded, not fatal), writing results as they come;
    then the interleaved timings of the emulation's two forms (``bench.emulation_saves=both``)."""
    rows: list[dict[str, Any]] = []
    interleaved: list[dict[str, Any]] = []
    counted: dict[str, Any] = {}  # the plan's FLOPs per update, counted at the first cell that ran
    header = _header(plan)
    print("\n".join(header))
    for line in _cpu_statement([], plan.device):
        print(line)
    for note in plan.notes:
        print(f"note: {note}")
    for line in expected_lines(plan, counted):
        print(line, flush=True)
    for spec in plan.cells:
        label = _label(spec)
        row = _measure(plan, spec)
        if row["status"] == "ok":
            try:
                row.update(_arithmetic(spec, row["ms_mean"], counted))
            except Exception as exc:  # a figure missing, not the cell's time lost
                print(f"{label}: FLOPs not counted: {type(exc).__name__}: {exc}", flush=True)
        rows.append(row)
        add_ratios(rows)
        if row["status"] == "ok":
            flag = "" if row["finite_at_end"] else "  [non-finite parameters: timed anyway]"
            print(
                f"{label}: {row['ms_mean']:,.2f} ± {row['ms_std']:,.2f} ms/update ({row['compute']}), "
                f"peak {_mib(row['peak_mem_bytes'])} MiB, saved for backward {_mib(row.get('saved_bytes'))} MiB, "
                f"state {_mib(row['state_bytes'])} MiB, {_count(row, 'ops')} aten ops "
                f"({_count(row, 'casts')} casts, {_count(row, 'host_reads')} host reads) per full / critic-only "
                f"update, {_fmt(row.get('gflop_per_update'), ',.4g')} GFLOP/update "
                f"({_fmt(row.get('tflops_achieved'), ',.3g')} TFLOP/s){flag}",
                flush=True,
            )
        else:
            print(f"{label}: {row['status']}", flush=True)
        write_outputs(plan, rows, header, with_chart=False, interleaved=interleaved)
    for spec in plan.interleaved:
        row = _measure(plan, spec)
        interleaved.append(row)
        if row["status"] == "ok":
            forms = row["ms_by_form"]
            print(
                f"{spec.mode} batch {spec.batch_size}, the emulation's forms interleaved: saves fp32 "
                f"{statistics.fmean(forms['saves_fp32']):,.1f} ms, saves fp16/bf16 "
                f"{statistics.fmean(forms['saves_low']):,.1f} ms per update",
                flush=True,
            )
        else:
            print(f"{spec.mode} batch {spec.batch_size} interleaved: {row['status']}", flush=True)
        write_outputs(plan, rows, header, with_chart=False, interleaved=interleaved)
    write_outputs(plan, rows, header, with_chart=True, interleaved=interleaved)
    print()
    print(markdown(plan, rows, header, interleaved))
    print(f"wrote {plan.out / 'bench.csv'}, bench.md, bench.json, bench.png")
    return rows
