"""The benchmark's results: ratios to fp32, and the reports (bench.csv, bench.md, bench.json,
bench.png) with what each memory figure counts."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import statistics
from pathlib import Path
from typing import Any

from pixelsac import files
from pixelsac.allocator import describe as malloc_settings
from pixelsac.bench.plan import Plan


# --- ratios and reports ----------------------------------------------------------------------
def add_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's ratios to the fp32 row of the same batch size and speed variant:
    ``speedup_vs_fp32`` = fp32 ms ÷ mode ms, ``state_vs_fp32``, ``saved_vs_fp32`` and
    ``peak_vs_fp32`` = mode bytes ÷ fp32 bytes (peak only when both were measured the same way),
    ``state_groups_vs_fp32`` group by group of the same name. None where there is no fp32."""
    from pixelsac.perf import group_ratios, ratio, speedup

    def speed_variant(row: dict[str, Any]) -> str:
        return row.get("speed_variant", row["variant"])

    reference = {(r["batch_size"], speed_variant(r)): r for r in rows if r["mode"] == "fp32" and r["status"] == "ok"}
    # The first variant measured for a mode and batch size has every speed switch off (cells are
    # ordered off before on), so it is the baseline that shows what each switch buys.
    base: dict[tuple[str, int], dict[str, Any]] = {}
    for row in rows:
        if row["status"] == "ok":
            base.setdefault((row["mode"], row["batch_size"]), row)
    for row in rows:
        first = base.get((row["mode"], row["batch_size"]))
        row["speedup_vs_base"] = (
            speedup(first["ms_mean"], row["ms_mean"]) if first is not None and row["status"] == "ok" else None
        )
        row["base_variant"] = first["variant"] if first is not None else None
        fp32 = reference.get((row["batch_size"], speed_variant(row)))
        ok = fp32 is not None and row["status"] == "ok"
        row["speedup_vs_fp32"] = speedup(fp32["ms_mean"], row["ms_mean"]) if ok else None
        row["state_vs_fp32"] = ratio(row["state_bytes"], fp32["state_bytes"]) if ok else None
        row["saved_vs_fp32"] = ratio(row.get("saved_bytes"), fp32.get("saved_bytes")) if ok else None
        row["tensor_peak_vs_fp32"] = ratio(row.get("tensor_peak_bytes"), fp32.get("tensor_peak_bytes")) if ok else None
        row["state_groups_vs_fp32"] = group_ratios(row.get("state_groups"), fp32.get("state_groups")) if ok else None
        same_kind = ok and fp32["peak_mem_kind"] == row["peak_mem_kind"]
        row["peak_vs_fp32"] = ratio(row["peak_mem_bytes"], fp32["peak_mem_bytes"]) if same_kind else None
        row["ops_vs_fp32"] = ratio(row.get("ops_full"), fp32.get("ops_full")) if ok else None
        row["kernels_vs_fp32"] = ratio(row.get("kernels_full"), fp32.get("kernels_full")) if ok else None
    return rows


CSV_COLUMNS = (
    "mode",
    "variant",
    "batch_size",
    "device",
    "compute",
    "split_k",
    "emulated",
    "emulation",
    "updates",
    "warmup",
    "graph_setup_updates",
    "ms_mean",
    "ms_std",
    "ms_median",
    "ms_min",
    "speedup_vs_fp32",
    "speedup_vs_base",
    "base_variant",
    "peak_mem_bytes",
    "peak_mem_kind",
    "rss_peak_bytes",
    "peak_vs_fp32",
    "tensor_peak_bytes",
    "tensor_peak_vs_fp32",
    "saved_bytes",
    "saved_vs_fp32",
    "saved_peak_live_bytes",
    "saved_state_bytes",
    "state_bytes",
    "state_parameters",
    "state_optimizer",
    "state_target",
    "state_vs_fp32",
    "finite_after_first_update",
    "finite_at_end",
    "skipped_critic",
    "skipped_actor",
    "skipped_alpha",
    "loss_scale_critic",
    "loss_scale_actor",
    "loss_scale_alpha",
    "ops_full",
    "ops_critic",
    "ops_vs_fp32",
    "kernels_full",
    "kernels_critic",
    "kernels_vs_fp32",
    "casts_full",
    "casts_critic",
    "host_reads_full",
    "host_reads_critic",
    "gflop_full",
    "gflop_critic",
    "gflop_per_update",
    "tflops_achieved",
    "status",
)


def _cpu_statement(rows: list[dict[str, Any]], device: str) -> list[str]:
    if device != "cpu":
        return []
    lines = [
        "**This ran on a CPU.** These are not the speed-ups a GPU gives. fp16/bf16 rows marked *emulated* "
        "keep fp16/bf16 storage and elementwise math but run convolutions and matmuls with fp32 "
        "accumulation (`lowp.fp32_accumulate`, what GPU tensor cores do); rows whose compute column says "
        "*native* ran the CPU's own oneDNN kernels (bf16: AMX or AVX512-BF16, chosen automatically where "
        "present; fp16: AMX-FP16 or AVX512-FP16, only as `fp16-native`, since their convolution weight "
        "gradients are reference loops), which accumulate in fp32 themselves; "
        "*reference kernels* are torch's slow fallback on a CPU without them; `amp` on a CPU autocasts "
        "to the CPU's fp16 kernels."
    ]
    by_batch: dict[tuple[int, str], dict[str, dict[str, Any]]] = {}
    for row in rows:
        if row["status"] == "ok":
            by_batch.setdefault((row["batch_size"], row["variant"]), {})[row["mode"]] = row
    for (batch_size, variant), modes in sorted(by_batch.items()):
        if "fp16" in modes and "fp16-native" in modes:
            emulated, native = modes["fp16"]["ms_mean"], modes["fp16-native"]["ms_mean"]
            lines.append(
                f"fp32-accumulate on vs off (fp16 + six, batch {batch_size}{' ' + variant if variant else ''}): "
                f"{emulated:,.1f} vs {native:,.1f} ms/update -- emulation is {native / emulated:.2f}x "
                "faster than this CPU's native fp16 kernels (this machine's speed-up)"
            )
    return lines


def _fmt(value: Any, spec: str, missing: str = "n/a") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return missing
    return format(value, spec)


def _mib(value: Any) -> str:
    return _fmt(None if value is None else value / 2**20, ",.1f")


def _row_label(r: dict[str, Any]) -> str:
    return f"{r['mode']}{' ' + r['variant'] if r['variant'] else ''} b{r['batch_size']}"


def _group_table(rows: list[dict[str, Any]]) -> list[str]:
    """State by kind and group, one column per measured row, with each group's ratio to fp32."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("state_groups")]
    if not ok:
        return []
    names: dict[str, list[str]] = {}
    for r in ok:
        for kind, members in r["state_groups"].items():
            names.setdefault(kind, [])
            names[kind] += [name for name in members if name not in names[kind]]
    lines = [
        "State by group, MiB (× fp32's group of the same name, same batch):",
        "",
        "| kind | group | " + " | ".join(_row_label(r) for r in ok) + " |",
        "|---|---|" + "---|" * len(ok),
    ]
    for kind, groups in names.items():
        total = [_mib(r.get(f"state_{kind}")) for r in ok]
        lines.append(f"| **{kind}** | all | " + " | ".join(f"**{t}**" for t in total) + " |")
        for name in groups:
            cells = []
            for r in ok:
                nbytes = r["state_groups"].get(kind, {}).get(name)
                x = ((r.get("state_groups_vs_fp32") or {}).get(kind) or {}).get(name)
                cells.append("-" if nbytes is None else _mib(nbytes) + ("" if x is None else f" ({x:.2f}×)"))
            lines.append(f"| {kind} | {name} | " + " | ".join(cells) + " |")
    return lines


def _dispatch_table(rows: list[dict[str, Any]]) -> list[str]:
    """Aten ops, dtype casts and host reads per update, each row's update in the GPU's form."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("ops_full") is not None]
    if not ok:
        return []

    def pair(r: dict[str, Any], key: str) -> str:
        return f"{_fmt(r.get(key + '_full'), ',d')} / {_fmt(r.get(key + '_critic'), ',d')}"

    lines = [
        "What one update dispatches, in the form a GPU runs it (counted on the cell's device, eager, at small "
        "sizes, which change no count; sync-free unless the cell says host_sync, no CPU emulation, CUDA's "
        "default shift; pixelsac/perf/opcount.py): aten ops (views included), kernels (an estimate of the "
        "GPU's launches: views, allocations and profiler markers left out, a foreach op that CUDA runs "
        "tensor by tensor counted per tensor), dtype casts (ops that only convert), "
        "host reads (device-to-host synchronisations); full update (critic, actor, temperature, target) / critic-only:",
        "",
        "| mode | variant | batch | aten ops | ops × fp32 (full) | kernels | kernels × fp32 (full) | casts "
        "| host reads |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ok:
        lines.append(
            f"| {r['mode']} | {r['variant'] or '-'} | {r['batch_size']} | {pair(r, 'ops')} | "
            f"{_fmt(r.get('ops_vs_fp32'), '.2f')} | {pair(r, 'kernels')} | {_fmt(r.get('kernels_vs_fp32'), '.2f')} | "
            f"{pair(r, 'casts')} | {pair(r, 'host_reads')} |"
        )
    return lines


def _arithmetic_table(rows: list[dict[str, Any]]) -> list[str]:
    """FLOPs per update and the rate each cell's time sustains (pixelsac/perf/flops.py)."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("gflop_per_update") is not None]
    if not ok:
        return []
    lines = [
        "The arithmetic of an update (convolutions and matmuls at 2 FLOPs per multiply-add, forward and "
        "backward, at the cell's batch; the same in every precision; pixelsac/perf/flops.py) and the rate "
        "the cell's time sustains (GFLOP per update, mean over an update cycle, ÷ ms/update). "
        "An update cannot beat GFLOP ÷ the rate the hardware sustains:",
        "",
        "| mode | variant | batch | GFLOP full / critic-only | GFLOP per update | achieved TFLOP/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in ok:
        lines.append(
            f"| {r['mode']} | {r['variant'] or '-'} | {r['batch_size']} | {_fmt(r['gflop_full'], ',.4g')} / "
            f"{_fmt(r['gflop_critic'], ',.4g')} | {_fmt(r['gflop_per_update'], ',.4g')} | "
            f"{_fmt(r.get('tflops_achieved'), ',.3g')} |"
        )
    return lines


def _interleaved_table(interleaved: list[dict[str, Any]]) -> list[str]:
    if not interleaved:
        return []
    lines = [
        "Cost of the emulation's two forms, interleaved update by update in one process (A B B A, so "
        "each form gets as many critic-only as full updates; the machine's load is shared by both):",
        "",
        "| mode | variant | batch | saves fp32 copies, ms | saves fp16/bf16, ms | fp16-saving ÷ fp32-saving |",
        "|---|---|---|---|---|---|",
    ]
    for r in interleaved:
        if r["status"] != "ok":
            lines.append(f"| {r['mode']} | {r.get('speed_variant') or '-'} | {r['batch_size']} | {r['status']} | | |")
            continue
        forms = r["ms_by_form"]
        old, new = forms["saves_fp32"], forms["saves_low"]
        mean = lambda xs: statistics.fmean(xs) if xs else math.nan  # noqa: E731
        std = lambda xs: statistics.pstdev(xs) if len(xs) > 1 else 0.0  # noqa: E731
        lines.append(
            f"| {r['mode']} | {r.get('speed_variant') or '-'} | {r['batch_size']} | "
            f"{mean(old):,.1f} ± {std(old):,.1f} (n={len(old)}) | {mean(new):,.1f} ± {std(new):,.1f} "
            f"(n={len(new)}) | {_fmt(mean(new) / mean(old) if old and new else None, '.3f')} |"
        )
    return lines


def markdown(
    plan: Plan, rows: list[dict[str, Any]], header: list[str], interleaved: list[dict[str, Any]] | None = None
) -> str:
    from pixelsac.perf import MEMORY_FIGURES

    lines = ["# pixelsac update-step benchmark", "", *header, ""]
    lines += [*(f"- {line}" for line in _cpu_statement(rows, plan.device)), ""]
    lines += [
        "| mode | variant | batch | compute | ms/update (mean ± std) | min | speed-up vs fp32 | "
        "vs switches off | peak MiB (× fp32) | tensor peak MiB (× fp32) | saved for backward MiB (× fp32) | "
        "state MiB (× fp32) | finite | skipped c/a/α |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def mib_and_ratio(r: dict[str, Any], key: str, ratio_key: str) -> str:
        x = r.get(ratio_key)
        return _mib(r.get(key)) + ("" if x is None else f" ({x:.2f})")

    for r in rows:
        if r["status"] != "ok":
            lines.append(
                f"| {r['mode']} | {r['variant'] or '-'} | {r['batch_size']} | | {r['status']} | | | | | | | | | |"
            )
            continue
        finite = (
            "yes"
            if r["finite_at_end"]
            else ("**non-finite after update 1**" if not r["finite_after_first_update"] else "**non-finite**")
        )
        lines.append(
            f"| {r['mode']} | {r['variant'] or '-'} | {r['batch_size']} | {r['compute']} | "
            f"{_fmt(r['ms_mean'], ',.2f')} ± {_fmt(r['ms_std'], ',.2f')} | {_fmt(r['ms_min'], ',.2f')} | "
            f"{_fmt(r['speedup_vs_fp32'], '.2f')} | "
            f"{_fmt(r.get('speedup_vs_base'), '.2f') if r.get('base_variant') != r['variant'] else '-'} | "
            f"{mib_and_ratio(r, 'peak_mem_bytes', 'peak_vs_fp32')} | "
            f"{mib_and_ratio(r, 'tensor_peak_bytes', 'tensor_peak_vs_fp32')} | "
            f"{mib_and_ratio(r, 'saved_bytes', 'saved_vs_fp32')} | "
            f"{mib_and_ratio(r, 'state_bytes', 'state_vs_fp32')} | "
            f"{finite} | "
            f"{r.get('skipped_critic', 0)}/{r.get('skipped_actor', 0)}/{r.get('skipped_alpha', 0)} |"
        )
    kinds = sorted({r["peak_mem_kind"] for r in rows if r["status"] == "ok"})
    lines += [
        "",
        "Peak memory here: " + "; ".join(kinds) + ". Ratios are to fp32 at the same batch size and speed "
        "variant; "
        "'vs switches off' is the same mode and batch size with every speed switch off (its first row) "
        "divided by this row. Variants: channels_last / nchw (perf.channels_last on / off; neither named: "
        "the default layout), compile (perf.compile), "
        "sync_free / host_sync (perf.sync_free on / off, all else the same: random shift, optimizers), "
        "cuda_graphs (perf.cuda_graphs: each update replayed as a CUDA graph), "
        "<source>_batch (where the batch is when the update starts: pageable host, pinned host, device), "
        "saves_low / saves_fp32 (bench.emulation_saves: the CPU emulation saves fp16/bf16 inputs or their "
        "fp32 copies for backward; same values).",
    ]
    lines += ["", "Which memory figure is which:", *(f"- **{name}**: {text}" for name, text in MEMORY_FIGURES.items())]
    for extra in (
        _dispatch_table(rows),
        _arithmetic_table(rows),
        _group_table(rows),
        _interleaved_table(interleaved or []),
    ):
        if extra:
            lines += ["", *extra]
    replay = plan.replay
    lines += [
        "",
        f"Replay: {replay['bytes_per_transition']:,.0f} bytes per transition ({replay['frame_dtype']} frames "
        f"{'x'.join(map(str, replay['frame_shape']))} stored once, action dim {replay['action_dim']}); "
        f"{replay['capacity']:,} transitions = "
        f"{replay['bytes_per_transition'] * replay['capacity'] / 1e9:.2f} GB "
        "whatever the precision (fp16 does not shrink uint8 frames).",
    ]
    notes = list(plan.notes)
    for r in rows:
        if r["status"] == "ok" and not r["finite_at_end"]:
            notes.append(
                f"{r['mode']} (batch {r['batch_size']}{', ' + r['variant'] if r['variant'] else ''}): "
                "parameters non-finite "
                f"{'after the first update' if not r['finite_after_first_update'] else 'by the end'}"
                "; timed anyway, but a time spent computing on NaN is no guide to the mode's speed"
            )
    if notes:
        lines += ["", "Notes:", *(f"- {note}" for note in notes)]
    return "\n".join(lines) + "\n"


def chart(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Bars of ms/update and of state/peak MiB per cell; non-finite cells hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    labels = [
        f"{r['mode']}{' ' + r['variant'] if r['variant'] else ''}{' (emulated)' if r['emulated'] else ''}"
        f"\nb{r['batch_size']}"
        for r in ok
    ]
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(max(8, 0.9 * len(ok) + 4), 4.8))
    x = list(range(len(ok)))
    for i, r in enumerate(ok):
        hatch = "//" if not r["finite_at_end"] else None
        ax_time.bar(
            i,
            r["ms_mean"],
            yerr=r["ms_std"],
            color="tab:red" if r["mode"].startswith("fp16") else "tab:blue",
            hatch=hatch,
            edgecolor="black",
            linewidth=0.5,
        )
        if not r["finite_at_end"]:
            ax_time.text(i, r["ms_mean"], "NaN", ha="center", va="bottom", fontsize=7)
    ax_time.set_ylabel("ms / update")
    ax_time.set_title("update time (mean ± std)")
    width = 0.27
    for offset, key, label in (
        (-width, "state_bytes", "state"),
        (0.0, "saved_bytes", "saved for backward"),
        (width, "peak_mem_bytes", "peak"),
    ):
        bars = [(i, r[key] / 2**20) for i, r in enumerate(ok) if r.get(key) is not None]
        if bars:
            ax_mem.bar([i + offset for i, _ in bars], [b for _, b in bars], width, label=label)
    ax_mem.set_ylabel("MiB")
    ax_mem.set_title("memory: state = params + optimizer + target; saved for backward in one update", fontsize=9)
    ax_mem.legend()
    for ax in (ax_time, ax_mem):
        ax.set_xticks(x)
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    with files.replace_atomically(path) as file:  # a run cut while saving leaves the old chart, not half a new one
        fig.savefig(file, dpi=110, format="png")
    plt.close(fig)


def write_outputs(
    plan: Plan,
    rows: list[dict[str, Any]],
    header: list[str],
    with_chart: bool,
    interleaved: list[dict[str, Any]] | None = None,
) -> None:
    import csv

    plan.out.mkdir(parents=True, exist_ok=True)
    # each file whole or as it was: a benchmark rewrites them after every cell, and may be cut anywhere
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: row.get(k) for k in CSV_COLUMNS})
    files.write_atomically(plan.out / "bench.csv", table.getvalue())
    files.write_atomically(plan.out / "bench.md", markdown(plan, rows, header, interleaved))
    meta = {
        "header": header,
        "notes": plan.notes,
        "replay": plan.replay,
        "overrides": plan.overrides,
        "options": dataclasses.asdict(plan.options),
        # every cell the plan holds, so a reader of a benchmark cut short knows which never ran
        "planned": [{"mode": c.mode, "batch_size": c.batch_size, "variant": c.variant} for c in plan.cells],
        "rows": rows,
        "interleaved": interleaved or [],
    }
    files.write_atomically(plan.out / "bench.json", json.dumps(meta, indent=2, default=str) + "\n")
    if with_chart:
        chart(rows, plan.out / "bench.png", header[0].removeprefix("- "))


def _header(plan: Plan) -> list[str]:
    import torch

    if plan.device == "cuda":
        where = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    else:
        where = f"CPU, {torch.get_num_threads()} threads, torch {torch.__version__}"
    allocator = malloc_settings()
    cell = plan.cells[0]
    cfg = plan.cfg
    shape = "x".join(map(str, cell.obs_shape))
    return [
        f"- device: {where}",
        f"- agent: {cfg.task}, obs {shape}, action dim {cell.action_dim}, {cfg.agent.num_filters} filters x "
        f"{cfg.agent.num_conv_layers} convs, feature {cfg.agent.feature_dim}, hidden {cfg.agent.hidden_dim} x "
        f"{cfg.agent.hidden_depth}, K={cfg.agent.aug_target_copies} M={cfg.agent.aug_q_copies}",
        f"- {cell.updates} timed updates per cell after {cell.warmup} warm-up, both rounded up to whole update "
        "cycles (critic-only and full updates in a run's proportions); with CUDA graphs, each graph's eager "
        f"warm-ups and capture come first and are not timed; "
        f"{'one fresh process per cell' if plan.isolate else 'all cells in one process'}",
        f"- glibc allocator settings: {allocator}",
        "- GPU fp32 rows run with TF32 off, as training with precision=fp32 does (perf.tf32=true: the tf32 row)"
        if plan.device == "cuda"
        else "- fp32 rows: plain fp32",
    ]
