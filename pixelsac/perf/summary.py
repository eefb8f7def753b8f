"""The end-of-run summary: the run's figures as plain data, a printed table, JSON and markdown."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pixelsac import files
from pixelsac.lowp import describe_split_k
from pixelsac.perf.meters import SavedBytes, _fmt_bytes, group_ratios, ratio, speedup
from pixelsac.provenance import code_version, describe

if TYPE_CHECKING:
    from pixelsac.perf.calibration import Fp32Reference


def _fmt_ratio(x: float | None, what: str) -> str:
    return "" if x is None else f" ({x:.2f}x {what})"


def build_summary(
    *,
    precision: str,
    device: str,
    batch_size: int,
    env_frames: int,
    agent_steps: int,
    updates: int,
    wall_s: float,
    ms: list[float],
    peak_bytes: int | None,
    peak_kind: str,
    state: dict[str, int] | None,
    loss_scales: dict[str, float],
    skipped: dict[str, int],
    best_eval_return: float | None,
    fp32: Fp32Reference | None,
    replay_bytes: int | None = None,
    replay_bytes_per_transition: float | None = None,
    stopped_by: str | None = None,
    saved: SavedBytes | None = None,
    state_groups: dict[str, dict[str, int]] | None = None,
    fp32_is_self: bool = False,
    shared_device: bool = False,
    fp32_restored: bool = False,
    replay_device_bytes: int = 0,
) -> dict[str, Any]:
    """The end-of-run figures as plain data; every ratio is computed here from measured values.
    ``memory_figures`` says what each memory figure measures.

    The speed-up is the fp32 start-up estimate's ms ÷ this run's (``speedup_basis`` says over how
    many updates, and whether the host was busy then: ``speedup_reliable``). There is none for an
    fp32 run (``fp32_is_self``: it would compare the run with itself) nor for runs that shared
    their device (``shared_device``). The peak's ratio divides like by like: the run's peak less
    a replay buffer held on the GPU (``replay_device_bytes``) ÷ the fp32 copy's peak above what
    was allocated before it was built.
    """
    mean_ms = statistics.fmean(ms) if ms else None
    peak_vs_fp32 = None
    if fp32 is not None and fp32.peak_bytes is not None and peak_kind == "cuda_max_allocated" and peak_bytes:
        peak_vs_fp32 = ratio(peak_bytes - replay_device_bytes, fp32.peak_bytes)
    fp32_saved = fp32.saved if fp32 is not None else None
    speed, basis, reliable = None, None, None
    if fp32_is_self:
        basis = "none: this run is fp32, the reference itself"
    elif shared_device:
        basis = "none: the device was shared with other runs (perf.shared_device)"
    elif fp32 is not None:
        speed = speedup(fp32.ms_per_update, mean_ms)
        basis = fp32.describe() + ("; saved in the checkpoint, not timed again" if fp32_restored else "")
        reliable = not fp32.host_busy
    return {
        "precision": precision,
        "device": device,
        "batch_size": batch_size,
        "env_frames": env_frames,
        "agent_steps": agent_steps,
        "updates": updates,
        "wall_s": wall_s,
        "env_frames_per_s": env_frames / wall_s if wall_s > 0 else None,
        "updates_per_s": updates / wall_s if wall_s > 0 else None,
        "ms_per_update": mean_ms,
        "ms_per_update_std": statistics.pstdev(ms) if len(ms) > 1 else None,
        "timed_updates": len(ms),
        "peak_memory_bytes": peak_bytes,
        "peak_memory_kind": peak_kind,
        "state_bytes": state,
        "loss_scales": loss_scales,
        "skipped": skipped,
        "best_eval_return": best_eval_return,
        "replay_bytes": replay_bytes,
        "replay_bytes_per_transition": replay_bytes_per_transition,
        "fp32": dataclasses.asdict(fp32) if fp32 is not None else None,
        "speedup_vs_fp32": speed,
        "speedup_basis": basis,
        "speedup_reliable": reliable,
        "memory_vs_fp32": ratio(state["total"], fp32.state["total"]) if fp32 is not None and state else None,
        "peak_memory_vs_fp32": peak_vs_fp32,
        "replay_device_bytes": replay_device_bytes,
        "saved_for_backward": dataclasses.asdict(saved) if saved is not None else None,
        "saved_for_backward_vs_fp32": ratio(saved.activations, fp32_saved["activations"])
        if saved is not None and fp32_saved is not None
        else None,
        "state_groups": state_groups,
        "state_groups_vs_fp32": group_ratios(state_groups, fp32.state_groups if fp32 is not None else None),
        "memory_figures": MEMORY_FIGURES,
        "stopped_by": stopped_by,
        "split_k": describe_split_k(),  # the long-K products' path in this process (pixelsac.lowp.splitk)
        "code": code_version(),
    }


#: What each memory figure of the summary and the benchmark measures.
MEMORY_FIGURES = {
    "peak memory": "peak of the process: on a GPU torch.cuda.max_memory_allocated (tensors only; with CUDA "
    "graphs read from before their capture, so their memory pool counts); on a CPU the "
    "resident-set high-water mark (the whole process: libraries, allocator caches, replay buffer, "
    "envs; the benchmark reports it above the fresh process's baseline); its ratio to fp32 leaves "
    "a replay buffer held on the GPU out",
    "tensor peak": "CPU: the most bytes of tensors alive at once during one full update among those it allocates "
    "(op outputs; pixelsac.perf.TensorPeakMeter): what torch.cuda.max_memory_allocated says on a GPU, "
    "less kernels' own workspaces; benchmark only",
    "saved for backward": "bytes of the tensors autograd keeps from the forward to the backward pass in one full "
    "update (critic, actor, temperature), counted with torch.autograd.graph.saved_tensors_hooks: "
    "exact and the same on a CPU and a GPU; each storage once; parameters that autograd saves "
    "are left out (state counts them); 'at most ... at once' is the largest amount alive "
    "together",
    "state": "parameters + optimizer state + target copies (pixelsac.precision.state_bytes), and by group: "
    "parameters by network, optimizer state by state key, target copies by network and buffer owner "
    "(pixelsac.perf.meters.state_groups)",
}


def _fmt_saved(saved: dict[str, Any] | None, vs_fp32: float | None) -> str:
    if not saved:
        return "n/a"
    dtypes = ", ".join(f"{dtype} {_fmt_bytes(n)}" for dtype, n in sorted(saved["by_dtype"].items()))
    return (
        f"{_fmt_bytes(saved['activations'])} in one full update ({dtypes})"
        + _fmt_ratio(vs_fp32, "fp32's")
        + f"; at most {_fmt_bytes(saved['peak_live_activations'])} at once"
    )


def _fmt_groups(members: dict[str, int], ratios: dict[str, float | None] | None) -> str:
    parts = []
    for name, nbytes in members.items():
        r = (ratios or {}).get(name)
        parts.append(f"{name} {_fmt_bytes(nbytes)}" + ("" if r is None else f" ({r:.2f}x)"))
    return ", ".join(parts) or "none"


def _fmt_speed(summary: dict[str, Any]) -> str:
    """The speed-up with what it rests on, or why there is none."""
    basis = summary.get("speedup_basis")
    fp32, speed = summary["fp32"], summary["speedup_vs_fp32"]
    if speed is not None and fp32:
        return f" ({speed:.2f}x speed-up vs fp32 {fp32['ms_per_update']:,.2f}: {basis})"
    if basis and basis.startswith("none: "):
        return f" (no speed-up figure: {basis.removeprefix('none: ')})"
    return ""


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(what, value) pairs of the summary, in reading order, values already formatted."""
    fp32 = summary["fp32"]
    state = summary["state_bytes"]
    num = lambda x, f: "n/a" if x is None else format(x, f)  # noqa: E731
    rows = [
        ("precision", summary["precision"]),
        ("device", summary["device"]),
        ("env frames", f"{summary['env_frames']:,}"),
        ("updates", f"{summary['updates']:,} (batch {summary['batch_size']})"),
        ("wall time", f"{summary['wall_s']:,.1f} s"),
        ("env frames / s", num(summary["env_frames_per_s"], ",.1f")),
        ("updates / s", num(summary["updates_per_s"], ",.2f")),
        ("ms / update", num(summary["ms_per_update"], ",.2f") + _fmt_speed(summary)),
        (
            "peak memory",
            _fmt_bytes(summary["peak_memory_bytes"])
            + f" [{summary['peak_memory_kind']}]"
            + _fmt_ratio(summary["peak_memory_vs_fp32"], "fp32's"),
        ),
        (
            "state bytes",
            "n/a"
            if not state
            else f"{_fmt_bytes(state['total'])} = parameters {_fmt_bytes(state['parameters'])} + optimizer "
            f"{_fmt_bytes(state['optimizer'])} + target {_fmt_bytes(state['target'])}"
            + _fmt_ratio(summary["memory_vs_fp32"], "fp32's"),
        ),
        *(
            (
                f"state: {kind}",
                f"{_fmt_bytes(sum(members.values()))}"
                + _fmt_ratio(ratio(state.get(kind), fp32["state"].get(kind)) if fp32 and state else None, "fp32's")
                + ": "
                + _fmt_groups(members, (summary.get("state_groups_vs_fp32") or {}).get(kind)),
            )
            for kind, members in (summary.get("state_groups") or {}).items()
        ),
        (
            "saved for backward",
            _fmt_saved(summary.get("saved_for_backward"), summary.get("saved_for_backward_vs_fp32")),
        ),
        ("loss scales", ", ".join(f"{k} {v:g}" for k, v in summary["loss_scales"].items()) or "n/a"),
        ("skipped steps", ", ".join(f"{k} {v}" for k, v in summary["skipped"].items()) or "n/a"),
        ("best eval return", num(summary["best_eval_return"], ".1f")),
    ]
    if summary["replay_bytes"] is not None and summary["replay_bytes_per_transition"] is not None:
        rows.append(
            (
                "replay buffer",
                f"{_fmt_bytes(summary['replay_bytes'])} "
                f"({summary['replay_bytes_per_transition']:,.0f} B/transition, uint8)",
            )
        )
    if fp32 is None and not (summary.get("speedup_basis") or "").startswith("none: this run is fp32"):
        rows.append(("fp32 reference", "not calibrated (perf.calibrate_updates=0)"))
    if summary.get("stopped_by"):
        rows.append(("stopped early", summary["stopped_by"]))
    if summary.get("split_k"):  # summaries written before it have none
        rows.append(("split-K products", summary["split_k"]))
    if summary.get("code"):  # summaries written before it have none
        rows.append(("code", describe(summary["code"])))
    return rows


def format_summary(summary: dict[str, Any]) -> str:
    rows = summary_rows(summary)
    width = max(len(what) for what, _ in rows)
    return "\n".join(["perf summary:", *(f"  {what:<{width}}  {value}" for what, value in rows)])


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: such a figure was not measured, so it becomes null."""
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """``summary.json`` (raw numbers) and ``summary.md`` (the table) in ``run_dir``, each written
    whole or not at all (:func:`pixelsac.files.write_atomically`)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    files.write_atomically(run_dir / "summary.json", json.dumps(_finite(summary), indent=2, allow_nan=False) + "\n")
    lines = ["# Run summary", "", "| what | value |", "|---|---|"]
    lines += [f"| {what} | {value.replace('|', '/')} |" for what, value in summary_rows(summary)]
    lines += [
        "",
        "Memory figures (ratios: this run ÷ the fp32 copy timed at start-up, same batch):",
        *(f"- **{name}**: {text}" for name, text in summary.get("memory_figures", MEMORY_FIGURES).items()),
    ]
    files.write_atomically(run_dir / "summary.md", "\n".join(lines) + "\n")
