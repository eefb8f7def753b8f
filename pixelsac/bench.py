"""Benchmark the update step under each precision mode::

    python -m pixelsac.bench                                     # the configured agent, default modes
    python -m pixelsac.bench agent.batch_size=128 bench.modes=fp32,fp16
    python -m pixelsac.bench bench.batch_sizes=128,512 bench.ablations=true bench.updates=500
    python -m pixelsac.bench bench.channels_last=both bench.compile=both bench.modes=fp32,fp16
    python -m pixelsac.bench bench.sync_free=both bench.batch=all bench.modes=fp32,fp16
    python -m pixelsac.bench agent.batch_size=128 bench.modes=fp32,fp16 bench.emulation_saves=both

Every cell (mode x batch size x speed option) builds the configured agent afresh and times its
real training step (``SACModule.training_step`` under a Lightning Trainer, no environment) on one
synthetic batch of the run's shapes: ``bench.warmup`` untimed updates, then the mean and standard
deviation over ``bench.updates`` timed ones. Reported per cell: ms/update, and memory where it
is spent -- the peak (GPU: ``torch.cuda.max_memory_allocated``; CPU: the fresh process's
resident-set peak above its baseline), on a CPU also the most tensor bytes alive at once in the
first (full) update, the bytes autograd saves for backward in that update (counted with
``saved_tensors_hooks``: exact, the same on any device), and the state (parameters + optimizer
state + target copies, in total and by group) -- each with its ratio to fp32 at the same batch
size; also the replay buffer's bytes per transition. Results go to ``bench.out`` as bench.csv,
bench.md (which says what each memory figure counts), bench.json and bench.png.

Time: a CPU cell starts in ~10 s and then takes (warm-up + updates) x the update time. On the
project's 2-core CPU the full DrQ agent's update takes ~0.9-1 s at batch 128 and ~3.5-4 s at
batch 512 (fp32 or emulated fp16; several times that while other jobs share the cores), so
``bench.modes=fp32,fp16`` with the defaults takes ~30-40 s at batch 128 and ~1.5 minutes at 512;
``bench.emulation_saves=both`` adds a cell and an interleaved run per emulated mode.

Arguments are ``key=value``. Keys other than ``bench.*`` are the training configuration's
(``conf/config.yaml``: ``agent.*``, ``env.*``, ``lowp.*``, ``task``, ``seed``, ...); each mode
sets ``precision`` and ``lowp.all`` (and one switch for an ablation) over them. ``trainer.*``
keys are not used: the benchmark runs one device (``bench.device``).
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from pixelsac.config import ConfigError, load_config, parse_overrides, to_plain

SIX = ("hadam", "loss_scaling", "kahan_gradients", "kahan_momentum", "softplus_fix", "normal_fix")
_CELL_MARK = "PIXELSAC_BENCH_ROW "
_ALLOCATOR_VARS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


class BenchError(ValueError):
    """A bad benchmark option (exit code 2, nothing written)."""


# --- modes -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Mode:
    """One precision mode: the config overrides that make it, and where it can run."""

    name: str
    overrides: tuple[str, ...]
    what: str
    tf32: bool = False            # TF32 tensor-core matmuls and convolutions (GPU)
    only_on: str | None = None    # "cuda" or "cpu": skipped elsewhere, with a note


def _modes() -> dict[str, Mode]:
    modes = [
        Mode("fp32", ("precision=fp32", "lowp.all=false"), "fp32, DrQ as published (on a GPU: IEEE fp32, TF32 off)"),
        Mode("tf32", ("precision=fp32", "lowp.all=false"), "fp32 parameters, TF32 tensor-core matmuls and convolutions",
             tf32=True, only_on="cuda"),
        Mode("amp", ("precision=amp",), "fp32 parameters, autocast fp16, one GradScaler per optimizer"),
        Mode("bf16", ("precision=bf16",), "pure bf16 (five modifications; bf16 needs no loss scaling)"),
        Mode("fp16-naive", ("precision=fp16", "lowp.all=false"), "pure fp16 without the six (naive fp16)"),
        Mode("fp16", ("precision=fp16", "lowp.all=true"),
             "pure fp16 with the six modifications, unbiased moments and the lean state (the default)"),
        Mode("fp16-six", ("precision=fp16", "lowp.all=true", "lowp.unbiased_moments=false", "lowp.derived_target=false"),
             "pure fp16 with the six as published (no unbiased moments, stored target)"),
        Mode("bf16-six", ("precision=bf16", "lowp.unbiased_moments=false", "lowp.derived_target=false"),
             "pure bf16, the five as published"),
        Mode("fp16-native", ("precision=fp16", "lowp.all=true", "lowp.fp32_accumulate=false"),
             "fp16 + six on the CPU's native fp16 kernels (fp32-accumulate emulation off)", only_on="cpu"),
    ]
    modes += [Mode(f"fp16-no-{switch}", ("precision=fp16", "lowp.all=true", f"lowp.{switch}=false"),
                   f"fp16 + six without {switch} (ablation)") for switch in SIX]
    return {mode.name: mode for mode in modes}


MODES = _modes()
DEFAULT_MODES = ("fp32", "tf32", "amp", "bf16", "fp16-naive", "fp16", "fp16-native")
ABLATIONS = ("fp16-six", "bf16-six", *(f"fp16-no-{switch}" for switch in SIX))


# --- options ---------------------------------------------------------------------------------
_ON_OFF = ("off", "on", "both")
_AUTO_ON_OFF = ("auto", "off", "on", "both")
_BATCH_SOURCES = ("host", "pinned", "device")
_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

#: bench.* options: name -> (default, help)
OPTIONS: dict[str, tuple[Any, str]] = {
    "modes": (",".join(DEFAULT_MODES), "comma-separated modes: " + ", ".join(MODES) + "; 'all' = defaults + ablations"),
    "ablations": (False, "also run fp16 minus each one of the six switches"),
    "batch_sizes": (None, "comma-separated batch sizes (default: agent.batch_size)"),
    "updates": (None, "timed updates per cell (default: 500 on a GPU, as the paper; 3 on a CPU)"),
    "warmup": (None, "untimed updates before timing (default: 20 on a GPU, 1 on a CPU)"),
    "channels_last": ("auto", "NHWC memory format for the conv trunk (perf.channels_last): auto (the training default: "
                              "on a CPU, on a GPU for fp16/bf16/AMP) | off | on | both"),
    "compile": ("off", "torch.compile the networks (trunk, projections, Q heads, actor): off | on | both"),
    "compile_mode": ("default", "torch.compile mode: " + " | ".join(_COMPILE_MODES) + " (inductor only)"),
    "compile_backend": ("inductor", "torch.compile backend (eager / aot_eager to check the wiring cheaply)"),
    "sync_free": ("auto", "device-side loss-scale decisions + index random shift (perf.sync_free, perf.aug_backend) "
                          "vs host decisions + kornia crop: auto (the device's default) | off | on | both"),
    "cuda_graphs": ("off", "replay each update as a CUDA graph (perf.cuda_graphs; GPU only, implies sync_free): "
                           "off | on | both"),
    "batch": ("auto", "where each update's batch comes from: host (pageable) | pinned (page-locked host) | "
                      "device (already on the GPU, as replay.device=auto gives) | all; auto = the training "
                      "default (pinned on a GPU, host on a CPU)"),
    "emulation_saves": ("low", "what the CPU emulation of fp16/bf16 tensor cores (lowp.fp32_accumulate) saves for "
                               "backward in emulated cells: low (the fp16/bf16 inputs, as a GPU; the default) | "
                               "fp32 (their fp32 copies, the earlier form) | both (each in its own cell, plus the two "
                               "interleaved update by update in one process for their cost in ms)"),
    "isolate": (None, "one fresh process per cell, so a CPU's peak RSS is the cell's own "
                      "(default: true on a CPU, false on a GPU where the CUDA allocator resets its peak)"),
    "device": ("auto", "auto | cpu | cuda"),
    "out": (None, "output folder (default: runs/bench/<date>-<time>)"),
    "overwrite": (False, "allow writing into an existing, non-empty output folder"),
}

USAGE = (__doc__ or "") + "\nbench.* options:\n" + "\n".join(
    f"  bench.{name:<16} {help_text}" + ("" if default is None else f" [default: {str(default).lower()}]")
    for name, (default, help_text) in OPTIONS.items())


@dataclasses.dataclass
class BenchOptions:
    modes: list[str]
    batch_sizes: list[int] | None
    updates: int | None
    warmup: int | None
    channels_last: str
    compile: str
    compile_mode: str
    compile_backend: str
    sync_free: str
    cuda_graphs: str
    batch: list[str] | None
    isolate: bool | None
    emulation_saves: str
    device: str
    out: str | None
    overwrite: bool


def _as_list(key: str, value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return [value]


def _positive_int(key: str, value: Any, low: int = 1) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        what = "a positive integer" if low > 0 else "an integer >= 0"
        raise BenchError(f"bench.{key}={value!r} must be {what}")
    return value


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    if value is True:
        value = "on"
    elif value is False:
        value = "off"
    if value not in choices:
        raise BenchError(f"bench.{key}={value!r}; choose one of {', '.join(choices)}")
    return value


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise BenchError(f"bench.{key}={value!r} takes true or false")
    return value


def parse_options(given: dict[str, Any]) -> BenchOptions:
    """Check and convert the ``bench.*`` options (without the prefix); raise BenchError."""
    for key in given:
        if key not in OPTIONS:
            close = difflib.get_close_matches(key, list(OPTIONS), n=1, cutoff=0.6)
            hint = f" (did you mean 'bench.{close[0]}'?)" if close else ""
            raise BenchError(f"unknown key 'bench.{key}'{hint}; bench options: "
                             + ", ".join(f"bench.{k}" for k in OPTIONS))
    value = {k: given.get(k, default) for k, (default, _) in OPTIONS.items()}

    modes: list[str] = []
    for name in _as_list("modes", value["modes"]):
        names = [*DEFAULT_MODES, *ABLATIONS] if name == "all" else [name]
        for each in names:
            if each not in MODES:
                close = difflib.get_close_matches(str(each), list(MODES), n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise BenchError(f"unknown mode {each!r}{hint}; modes: {', '.join(MODES)}")
            if each not in modes:
                modes.append(each)
    if _bool("ablations", value["ablations"]):
        modes += [name for name in ABLATIONS if name not in modes]
    if not modes:
        raise BenchError("bench.modes is empty; modes: " + ", ".join(MODES))

    batch_sizes = None
    if value["batch_sizes"] is not None:
        batch_sizes = [_positive_int("batch_sizes", b) for b in _as_list("batch_sizes", value["batch_sizes"])]
        if not batch_sizes:
            raise BenchError("bench.batch_sizes is empty")
    isolate = value["isolate"]
    if isolate is not None and isolate != "auto":
        isolate = _bool("isolate", isolate)
    elif isolate == "auto":
        isolate = None
    out = value["out"]
    if out is not None and (not isinstance(out, str) or not out.strip()):
        raise BenchError(f"bench.out={out!r} must be a folder path")
    batch = None
    if value["batch"] != "auto":
        names = _as_list("batch", value["batch"])
        batch = list(_BATCH_SOURCES) if names == ["all"] else names
        for name in batch:
            if name not in _BATCH_SOURCES:
                raise BenchError(f"bench.batch={value['batch']!r}; choose from auto, all, {', '.join(_BATCH_SOURCES)}")
    backend = value["compile_backend"]
    if not isinstance(backend, str) or not backend:
        raise BenchError(f"bench.compile_backend={backend!r} must be a backend name such as inductor")
    return BenchOptions(
        modes=modes,
        batch_sizes=batch_sizes,
        updates=None if value["updates"] is None else _positive_int("updates", value["updates"]),
        warmup=None if value["warmup"] is None else _positive_int("warmup", value["warmup"], low=0),
        channels_last=_choice("channels_last", value["channels_last"], _AUTO_ON_OFF),
        compile=_choice("compile", value["compile"], _ON_OFF),
        compile_mode=_choice("compile_mode", value["compile_mode"], _COMPILE_MODES),
        compile_backend=backend,
        sync_free=_choice("sync_free", value["sync_free"], _AUTO_ON_OFF),
        cuda_graphs=_choice("cuda_graphs", value["cuda_graphs"], _ON_OFF),
        batch=batch,
        isolate=isolate,
        emulation_saves=_choice("emulation_saves", value["emulation_saves"], ("low", "fp32", "both")),
        device=_choice("device", value["device"], ("auto", "cpu", "cuda")),
        out=out,
        overwrite=_bool("overwrite", value["overwrite"]),
    )


def split_arguments(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """``bench.*`` options (typed, prefix removed) and the training-config overrides."""
    bench: dict[str, Any] = {}
    rest: list[str] = []
    for item in argv:
        if item.strip().startswith("bench."):
            (key, value), = parse_overrides([item]).items()
            bench[key.removeprefix("bench.")] = value
        else:
            rest.append(item)
    return bench, rest


# --- one cell --------------------------------------------------------------------------------
@dataclasses.dataclass
class CellSpec:
    """Everything one measurement needs, as plain data (it crosses a process boundary)."""

    mode: str
    overrides: list[str]          # the user's overrides, then the mode's, then the batch size
    batch_size: int
    channels_last: bool | None     # None: the training default (perf.channels_last=null), unlabelled
    compile: bool
    compile_mode: str
    compile_backend: str
    updates: int
    warmup: int
    device: str
    obs_shape: list[int]
    action_dim: int
    sync_free: bool | None = None  # None: the device's default, unlabelled
    batch_source: str = "host"
    label_batch: bool = False      # name the batch source in the variant (it was asked for)
    cuda_graphs: bool = False
    emulation: str | None = None   # perf.time_updates(emulation=...): saves_low | saves_fp32 | interleaved
    label_emulation: bool = False  # name the emulation's form in the variant (it was asked for)

    @property
    def speed_variant(self) -> str:
        """The speed switches: what an fp32 row must share to be this row's reference."""
        names = [] if self.channels_last is None else ["channels_last" if self.channels_last else "nchw"]
        if self.compile:
            names.append("compile")
        if self.sync_free is not None:
            names.append("sync_free" if self.sync_free else "host_sync")
        if self.cuda_graphs:
            names.append("cuda_graphs")
        if self.label_batch:
            names.append(f"{self.batch_source}_batch")
        return "+".join(names)

    @property
    def variant(self) -> str:
        if self.label_emulation and self.emulation is not None:
            return "+".join(name for name in (self.speed_variant, self.emulation) if name)
        return self.speed_variant


def _set_tf32(enabled: bool) -> None:
    # The legacy switches, on purpose: Lightning reads torch.get_float32_matmul_precision(), which
    # raises once the new fp32_precision API and the legacy one have both been used.
    import torch

    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled


def _compute(cfg: Any, mode: Mode, device_type: str) -> tuple[str, bool]:
    """What the arithmetic really ran in, and whether half precision was emulated on a CPU."""
    from pixelsac.precision import PrecisionPolicy

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
    return (f"native CPU {low} kernels" if device_type == "cpu" else f"{low} tensor cores"), False


def run_cell(spec: CellSpec) -> dict[str, Any]:
    """Measure one cell in this process; returns its row (no ratios yet)."""
    import torch

    from pixelsac.perf import apply_speed_options, synthetic_batch, time_updates

    cfg = load_config(spec.overrides)
    mode = MODES[spec.mode]
    device = torch.device(spec.device)
    if device.type == "cuda":
        _set_tf32(mode.tf32)
    batch = synthetic_batch(spec.batch_size, tuple(spec.obs_shape), spec.action_dim, seed=int(cfg.seed))
    if spec.batch_source == "pinned":
        batch = {k: v.pin_memory() for k, v in batch.items()}
    elif spec.batch_source == "device":
        batch = {k: v.to(device) for k, v in batch.items()}

    def prepare(module: Any) -> None:
        # the layout is the module's own (perf.channels_last in the cell's overrides)
        apply_speed_options(module, False, spec.compile, spec.compile_mode, spec.compile_backend)

    timed = time_updates(to_plain(cfg), tuple(spec.obs_shape), spec.action_dim, batch, device,
                         spec.updates, spec.warmup, prepare=prepare, emulation=spec.emulation,
                         tensor_peak=device.type != "cuda" and not spec.compile)
    compute, emulated = _compute(cfg, mode, device.type)
    saved = timed.saved
    row: dict[str, Any] = {
        "mode": spec.mode, "variant": spec.variant, "speed_variant": spec.speed_variant,
        "emulation": spec.emulation or ("saves_low" if emulated else None),
        "batch_size": spec.batch_size, "device": spec.device,
        "compute": compute, "emulated": emulated, "updates": len(timed.ms), "warmup": spec.warmup,
        "ms_mean": timed.mean_ms, "ms_std": timed.std_ms,
        "ms_median": statistics.median(timed.ms) if timed.ms else math.nan,
        "ms_min": min(timed.ms) if timed.ms else math.nan,
        "peak_mem_bytes": timed.peak_bytes,
        "peak_mem_kind": "cuda_max_allocated" if timed.peak_bytes is not None else "not measured (CPU, in-process)",
        "rss_peak_bytes": None,
        "state_bytes": timed.state["total"], "state_parameters": timed.state["parameters"],
        "state_optimizer": timed.state["optimizer"], "state_target": timed.state["target"],
        "state_groups": timed.state_groups,
        "saved_bytes": saved.activations if saved else None,
        "saved_state_bytes": saved.state if saved else None,
        "saved_peak_live_bytes": saved.peak_live_activations if saved else None,
        "saved_by_dtype": saved.by_dtype if saved else None,
        "tensor_peak_bytes": timed.tensor_peak_bytes,
        "ms_by_form": timed.ms_by_form,
        "finite_after_first_update": timed.finite_after_first, "finite_at_end": timed.finite_at_end,
        **{f"skipped_{k}": v for k, v in timed.skipped.items()},
        **{f"loss_scale_{k}": v for k, v in timed.loss_scales.items()},
        "status": "ok",
    }
    return row


def _cell_main(spec_json: str) -> int:
    """Child-process entry: measure one cell and print its row; the peak RSS is this process's."""
    from pixelsac.perf import rss_bytes, rss_peak_bytes

    spec = CellSpec(**json.loads(spec_json))
    _apply_threads(spec.overrides)
    baseline = rss_bytes()  # libraries imported, nothing of the agent built yet
    row = run_cell(spec)
    peak = rss_peak_bytes()
    if spec.device == "cpu" and baseline is not None:
        row["peak_mem_bytes"] = max(peak - baseline, 0)
        row["peak_mem_kind"] = "rss_peak_above_baseline (fresh process)"
        row["rss_peak_bytes"] = peak
    print(_CELL_MARK + json.dumps(row), flush=True)
    return 0


def _apply_threads(overrides: list[str]) -> None:
    import torch

    threads = load_config(overrides).train.num_threads
    if threads:
        torch.set_num_threads(threads)


def run_cell_isolated(spec: CellSpec) -> dict[str, Any]:
    """Measure one cell in a fresh Python process (its peak RSS is the cell's own)."""
    package_root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    result = subprocess.run([sys.executable, "-m", "pixelsac.bench", "--cell", json.dumps(dataclasses.asdict(spec))],
                            capture_output=True, text=True, env=env)
    for line in result.stdout.splitlines():
        if line.startswith(_CELL_MARK):
            return json.loads(line[len(_CELL_MARK):])
    tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
    raise RuntimeError(f"cell process exited {result.returncode}: {tail}")


# --- the plan --------------------------------------------------------------------------------
@dataclasses.dataclass
class Plan:
    """A checked benchmark: every cell's configuration was composed and validated."""

    options: BenchOptions
    overrides: list[str]
    cfg: Any
    device: str
    out: Path
    cells: list[CellSpec]
    notes: list[str]
    replay: dict[str, Any]
    isolate: bool
    interleaved: list[CellSpec] = dataclasses.field(default_factory=list)  # bench.emulation_saves=both


def _shapes(cfg: Any) -> tuple[tuple[int, ...], int, tuple[int, ...], Any]:
    """Observation shape, action size, frame shape and dtype of the configured task (no rendering)."""
    from pixelsac.envs import DMCEnv

    env = DMCEnv(cfg.task, obs=cfg.env.obs, image_size=cfg.env.image_size, frame_stack=cfg.env.frame_stack,
                 action_repeat=cfg.env.action_repeat, camera_id=cfg.env.camera_id, seed=cfg.seed,
                 episode_frames=cfg.env.episode_frames)
    try:
        return tuple(env.obs_shape), env.action_dim, tuple(env.frame_shape), env.frame_dtype
    finally:
        env.close()


def _emulates(cell_cfg: Any, device: str) -> bool:
    """Whether this cell's policy runs the CPU emulation of fp16/bf16 tensor cores."""
    from pixelsac.precision import PrecisionPolicy

    policy = PrecisionPolicy.from_config(cell_cfg, device)
    return policy.mode != "amp" and policy.fp32_accumulate


def make_plan(argv: list[str]) -> Plan:
    """Check every argument and compose every cell's configuration; writes nothing.

    Raises ConfigError, EnvError or BenchError with a one-line message."""
    given, overrides = split_arguments(argv)
    options = parse_options(given)
    from pixelsac.envs import available_tasks

    cfg = load_config(overrides, valid_tasks=available_tasks())
    import torch

    device = options.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise BenchError("bench.device=cuda but torch sees no CUDA device")
    out = Path(options.out) if options.out else Path("runs") / "bench" / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not options.overwrite:
        raise BenchError(f"output folder {out} already exists and is not empty; "
                         "choose another bench.out=... or pass bench.overwrite=true")
    on_gpu = device == "cuda"
    updates = options.updates or (500 if on_gpu else 3)
    warmup = options.warmup if options.warmup is not None else (20 if on_gpu else 1)
    batch_sizes = options.batch_sizes or [int(cfg.agent.batch_size)]
    obs_shape, action_dim, frame_shape, frame_dtype = _shapes(cfg)

    notes: list[str] = []
    modes = []
    for name in options.modes:
        mode = MODES[name]
        if mode.only_on is not None and mode.only_on != device:
            notes.append(f"{name}: skipped on a {device.upper() if on_gpu else 'CPU'} -- "
                         + ("TF32 is a GPU tensor-core format" if name == "tf32"
                            else "fp32-accumulate emulation exists only on a CPU, so it would repeat fp16"))
            continue
        modes.append(mode)
    layouts = {"off": [False], "on": [True], "both": [False, True], "auto": [None]}
    sources = options.batch or ["pinned" if on_gpu else "host"]
    if not on_gpu and sources != ["host"]:
        notes.append("batch sources pinned and device: skipped on a CPU -- page-locked memory and a separate "
                     "device exist only with CUDA (a CPU batch is already where the update runs)")
        sources = ["host"]
    graph_settings = layouts[options.cuda_graphs]
    if not on_gpu and True in graph_settings:
        notes.append("cuda_graphs: skipped on a CPU -- CUDA graphs record GPU kernel launches")
        graph_settings = [False]
    cells: list[CellSpec] = []
    interleaved: list[CellSpec] = []
    for batch_size in batch_sizes:
        for channels_last in layouts[options.channels_last]:
            for compile in layouts[options.compile]:
                for sync_free in layouts[options.sync_free]:
                    for graphs in graph_settings:
                        if graphs and sync_free is False:
                            continue  # a graph cannot hold a step that reads the device
                        for source in sources:
                            for mode in modes:
                                sync = True if graphs else sync_free  # a graph needs the sync-free step
                                speed = [] if sync is None else [
                                    f"perf.sync_free={str(sync).lower()}",
                                    f"perf.aug_backend={'index' if sync else 'kornia'}"]
                                if graphs:
                                    speed.append("perf.cuda_graphs=true")
                                if channels_last is not None:
                                    speed.append(f"perf.channels_last={str(channels_last).lower()}")
                                cell_overrides = [*overrides, *mode.overrides, *speed, f"agent.batch_size={batch_size}"]
                                cell_cfg = load_config(cell_overrides)  # a mode clashing with the overrides fails now
                                if graphs:
                                    from pixelsac.graphs import graph_conflicts

                                    conflict = graph_conflicts(cell_cfg, device, 1)
                                    if conflict:
                                        notes.append(f"{mode.name} with cuda_graphs: skipped -- {conflict}")
                                        continue
                                spec = CellSpec(mode.name, cell_overrides, batch_size, channels_last, compile,
                                                options.compile_mode, options.compile_backend, updates, warmup,
                                                device, list(obs_shape), action_dim, sync_free, source,
                                                label_batch=options.batch is not None and on_gpu,
                                                cuda_graphs=graphs)
                                if options.emulation_saves == "low" or not _emulates(cell_cfg, device):
                                    cells.append(spec)
                                    continue
                                forms = ["saves_fp32", "saves_low"] if options.emulation_saves == "both" \
                                    else ["saves_fp32"]  # the earlier form first: the base of 'vs switches off'
                                cells += [dataclasses.replace(spec, emulation=form, label_emulation=True)
                                          for form in forms]
                                if options.emulation_saves == "both":
                                    interleaved.append(dataclasses.replace(
                                        spec, emulation="interleaved", updates=4 * math.ceil(max(updates, 4) / 4),
                                        warmup=max(warmup, 2)))
    if not cells:
        raise BenchError(f"nothing to run on a {device}: " + "; ".join(notes))
    if options.emulation_saves != "low" and not any(cell.emulation for cell in cells):
        notes.append(f"emulation_saves={options.emulation_saves}: no cell emulates fp16/bf16 tensor cores "
                     "(that is fp16/bf16 on a CPU with lowp.fp32_accumulate on)")
    from pixelsac.replay import ReplayBuffer

    # bytes per transition do not depend on capacity; a tiny buffer allocates almost nothing
    replay = ReplayBuffer(cfg.env.frame_stack + 8, frame_shape, frame_dtype,
                          cfg.env.frame_stack if cfg.env.obs == "pixels" else 1, action_dim)
    replay_info = {"bytes_per_transition": replay.bytes_per_transition, "capacity": int(cfg.replay.capacity),
                   "frame_shape": list(frame_shape), "frame_dtype": str(frame_dtype), "action_dim": action_dim}
    isolate = options.isolate if options.isolate is not None else not on_gpu
    return Plan(options, overrides, cfg, device, out, cells, notes, replay_info, isolate, interleaved)


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
        row["speedup_vs_base"] = speedup(first["ms_mean"], row["ms_mean"]) \
            if first is not None and row["status"] == "ok" else None
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
    return rows


CSV_COLUMNS = ("mode", "variant", "batch_size", "device", "compute", "emulated", "emulation", "updates", "warmup",
               "ms_mean", "ms_std", "ms_median", "ms_min", "speedup_vs_fp32", "speedup_vs_base", "base_variant",
               "peak_mem_bytes", "peak_mem_kind", "rss_peak_bytes", "peak_vs_fp32", "tensor_peak_bytes",
               "tensor_peak_vs_fp32", "saved_bytes", "saved_vs_fp32", "saved_peak_live_bytes",
               "saved_state_bytes", "state_bytes", "state_parameters", "state_optimizer",
               "state_target", "state_vs_fp32", "finite_after_first_update", "finite_at_end", "skipped_critic",
               "skipped_actor", "skipped_alpha", "loss_scale_critic", "loss_scale_actor", "loss_scale_alpha",
               "status")


def _cpu_statement(rows: list[dict[str, Any]], device: str) -> list[str]:
    if device != "cpu":
        return []
    lines = ["**This ran on a CPU.** Half precision here is slower than fp32: these are not the speed-ups "
             "a GPU gives. fp16/bf16 rows marked *emulated* keep fp16/bf16 storage and elementwise math but "
             "run convolutions and matmuls with fp32 accumulation (`lowp.fp32_accumulate`, what GPU tensor "
             "cores do); `fp16-native` runs the CPU's own fp16 kernels; `amp` on a CPU autocasts to native "
             "CPU fp16 kernels."]
    by_batch: dict[tuple[int, str], dict[str, dict[str, Any]]] = {}
    for row in rows:
        if row["status"] == "ok":
            by_batch.setdefault((row["batch_size"], row["variant"]), {})[row["mode"]] = row
    for (batch_size, variant), modes in sorted(by_batch.items()):
        if "fp16" in modes and "fp16-native" in modes:
            emulated, native = modes["fp16"]["ms_mean"], modes["fp16-native"]["ms_mean"]
            lines.append(f"fp32-accumulate on vs off (fp16 + six, batch {batch_size}{' ' + variant if variant else ''}): "
                         f"{emulated:,.1f} vs {native:,.1f} ms/update -- emulation is {native / emulated:.2f}x "
                         "faster than this CPU's native fp16 kernels (this machine's speed-up)")
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
    lines = ["State by group, MiB (× fp32's group of the same name, same batch):", "",
             "| kind | group | " + " | ".join(_row_label(r) for r in ok) + " |",
             "|---|---|" + "---|" * len(ok)]
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


def _interleaved_table(interleaved: list[dict[str, Any]]) -> list[str]:
    if not interleaved:
        return []
    lines = ["Cost of the emulation's two forms, interleaved update by update in one process (A B B A, so "
             "each form gets as many critic-only as full updates; the machine's load is shared by both):", "",
             "| mode | variant | batch | saves fp32 copies, ms | saves fp16/bf16, ms | fp16-saving ÷ fp32-saving |",
             "|---|---|---|---|---|---|"]
    for r in interleaved:
        if r["status"] != "ok":
            lines.append(f"| {r['mode']} | {r.get('speed_variant') or '-'} | {r['batch_size']} | {r['status']} | | |")
            continue
        forms = r["ms_by_form"]
        old, new = forms["saves_fp32"], forms["saves_low"]
        mean = lambda xs: statistics.fmean(xs) if xs else math.nan  # noqa: E731
        std = lambda xs: statistics.pstdev(xs) if len(xs) > 1 else 0.0  # noqa: E731
        lines.append(f"| {r['mode']} | {r.get('speed_variant') or '-'} | {r['batch_size']} | "
                     f"{mean(old):,.1f} ± {std(old):,.1f} (n={len(old)}) | {mean(new):,.1f} ± {std(new):,.1f} "
                     f"(n={len(new)}) | {_fmt(mean(new) / mean(old) if old and new else None, '.3f')} |")
    return lines


def markdown(plan: Plan, rows: list[dict[str, Any]], header: list[str],
             interleaved: list[dict[str, Any]] | None = None) -> str:
    from pixelsac.perf import MEMORY_FIGURES

    lines = ["# pixelsac update-step benchmark", "", *header, ""]
    lines += [*(f"- {line}" for line in _cpu_statement(rows, plan.device)), ""]
    lines += ["| mode | variant | batch | compute | ms/update (mean ± std) | min | speed-up vs fp32 | "
              "vs switches off | peak MiB (× fp32) | tensor peak MiB (× fp32) | saved for backward MiB (× fp32) | "
              "state MiB (× fp32) | finite | skipped c/a/α |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def mib_and_ratio(r: dict[str, Any], key: str, ratio_key: str) -> str:
        x = r.get(ratio_key)
        return _mib(r.get(key)) + ("" if x is None else f" ({x:.2f})")

    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['mode']} | {r['variant'] or '-'} | {r['batch_size']} | | {r['status']} "
                         "| | | | | | | | | |")
            continue
        finite = "yes" if r["finite_at_end"] else ("**non-finite after update 1**" if not r["finite_after_first_update"]
                                                   else "**non-finite**")
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
            f"{r.get('skipped_critic', 0)}/{r.get('skipped_actor', 0)}/{r.get('skipped_alpha', 0)} |")
    kinds = sorted({r["peak_mem_kind"] for r in rows if r["status"] == "ok"})
    lines += ["", "Peak memory here: " + "; ".join(kinds) + ". Ratios are to fp32 at the same batch size and speed "
              "variant; "
              "'vs switches off' is the same mode and batch size with every speed switch off (its first row) "
              "divided by this row. Variants: channels_last / nchw (perf.channels_last on / off; neither named: "
              "the default layout), compile (perf.compile), "
              "sync_free / host_sync (perf.sync_free with the index / kornia random shift), "
              "cuda_graphs (perf.cuda_graphs: each update replayed as a CUDA graph), "
              "<source>_batch (where the batch is when the update starts: pageable host, pinned host, device), "
              "saves_low / saves_fp32 (bench.emulation_saves: the CPU emulation saves fp16/bf16 inputs or their "
              "fp32 copies for backward; same values)."]
    lines += ["", "Which memory figure is which:", *(f"- **{name}**: {text}" for name, text in MEMORY_FIGURES.items())]
    for extra in (_group_table(rows), _interleaved_table(interleaved or [])):
        if extra:
            lines += ["", *extra]
    replay = plan.replay
    lines += ["", f"Replay: {replay['bytes_per_transition']:,.0f} bytes per transition ({replay['frame_dtype']} frames "
                  f"{'x'.join(map(str, replay['frame_shape']))} stored once, action dim {replay['action_dim']}); "
                  f"{replay['capacity']:,} transitions = "
                  f"{replay['bytes_per_transition'] * replay['capacity'] / 1e9:.2f} GB "
                  "whatever the precision (fp16 does not shrink uint8 frames)."]
    notes = list(plan.notes)
    for r in rows:
        if r["status"] == "ok" and not r["finite_at_end"]:
            notes.append(f"{r['mode']} (batch {r['batch_size']}{', ' + r['variant'] if r['variant'] else ''}): "
                         "parameters non-finite "
                         f"{'after the first update' if not r['finite_after_first_update'] else 'by the end'}"
                         "; timed anyway, but a time spent computing on NaN is no guide to the mode's speed")
    if notes:
        lines += ["", "Notes:", *(f"- {note}" for note in notes)]
    return "\n".join(lines) + "\n"


def chart(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Bars of ms/update and of state/peak MiB per cell; non-finite cells hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    labels = [f"{r['mode']}{' ' + r['variant'] if r['variant'] else ''}{' (emulated)' if r['emulated'] else ''}"
              f"\nb{r['batch_size']}" for r in ok]
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(max(8, 0.9 * len(ok) + 4), 4.8))
    x = list(range(len(ok)))
    for i, r in enumerate(ok):
        hatch = "//" if not r["finite_at_end"] else None
        ax_time.bar(i, r["ms_mean"], yerr=r["ms_std"], color="tab:red" if r["mode"].startswith("fp16") else "tab:blue",
                    hatch=hatch, edgecolor="black", linewidth=0.5)
        if not r["finite_at_end"]:
            ax_time.text(i, r["ms_mean"], "NaN", ha="center", va="bottom", fontsize=7)
    ax_time.set_ylabel("ms / update")
    ax_time.set_title("update time (mean ± std)")
    width = 0.27
    for offset, key, label in ((-width, "state_bytes", "state"), (0.0, "saved_bytes", "saved for backward"),
                               (width, "peak_mem_bytes", "peak")):
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
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(plan: Plan, rows: list[dict[str, Any]], header: list[str], with_chart: bool,
                  interleaved: list[dict[str, Any]] | None = None) -> None:
    import csv

    plan.out.mkdir(parents=True, exist_ok=True)
    with open(plan.out / "bench.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k) for k in CSV_COLUMNS})
    (plan.out / "bench.md").write_text(markdown(plan, rows, header, interleaved))
    meta = {"header": header, "notes": plan.notes, "replay": plan.replay, "overrides": plan.overrides,
            "options": dataclasses.asdict(plan.options), "rows": rows, "interleaved": interleaved or []}
    (plan.out / "bench.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    if with_chart:
        chart(rows, plan.out / "bench.png", header[0].removeprefix("- "))


def _header(plan: Plan) -> list[str]:
    import torch

    if plan.device == "cuda":
        where = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    else:
        where = f"CPU, {torch.get_num_threads()} threads, torch {torch.__version__}"
    allocator = ", ".join(f"{v}={os.environ[v]}" for v in _ALLOCATOR_VARS if v in os.environ) or "not set"
    cell = plan.cells[0]
    cfg = plan.cfg
    shape = "x".join(map(str, cell.obs_shape))
    return [
        f"- device: {where}",
        f"- agent: {cfg.task}, obs {shape}, action dim {cell.action_dim}, {cfg.agent.num_filters} filters x "
        f"{cfg.agent.num_conv_layers} convs, feature {cfg.agent.feature_dim}, hidden {cfg.agent.hidden_dim} x "
        f"{cfg.agent.hidden_depth}, K={cfg.agent.aug_target_copies} M={cfg.agent.aug_q_copies}",
        f"- {cell.updates} timed updates per cell after {cell.warmup} warm-up; "
        f"{'one fresh process per cell' if plan.isolate else 'all cells in one process'}",
        f"- glibc allocator settings: {allocator}",
        "- GPU fp32 rows run with TF32 off; training with precision=fp32 uses PyTorch's defaults "
        "(TF32 cuDNN convolutions, IEEE matmuls)" if plan.device == "cuda" else "- fp32 rows: plain fp32",
    ]


def _measure(plan: Plan, spec: CellSpec) -> dict[str, Any]:
    try:
        return run_cell_isolated(spec) if plan.isolate else run_cell(spec)
    except Exception as exc:  # one broken cell (a compile failure, out of memory) must not lose the rest
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return {"mode": spec.mode, "variant": spec.variant, "speed_variant": spec.speed_variant,
                "batch_size": spec.batch_size, "device": spec.device,
                "status": f"failed: {type(exc).__name__}: {message}"[:300]}


def run_plan(plan: Plan) -> list[dict[str, Any]]:
    """Measure every cell (a failing cell is recorded, not fatal), writing results as they come;
    then the interleaved timings of the emulation's two forms (``bench.emulation_saves=both``)."""
    rows: list[dict[str, Any]] = []
    interleaved: list[dict[str, Any]] = []
    header = _header(plan)
    print("\n".join(header))
    for line in _cpu_statement([], plan.device):
        print(line)
    for spec in plan.cells:
        label = f"{spec.mode}{' ' + spec.variant if spec.variant else ''} batch {spec.batch_size}"
        row = _measure(plan, spec)
        rows.append(row)
        add_ratios(rows)
        if row["status"] == "ok":
            flag = "" if row["finite_at_end"] else "  [non-finite parameters: timed anyway]"
            print(f"{label}: {row['ms_mean']:,.2f} ± {row['ms_std']:,.2f} ms/update ({row['compute']}), "
                  f"peak {_mib(row['peak_mem_bytes'])} MiB, saved for backward {_mib(row.get('saved_bytes'))} MiB, "
                  f"state {_mib(row['state_bytes'])} MiB{flag}", flush=True)
        else:
            print(f"{label}: {row['status']}", flush=True)
        write_outputs(plan, rows, header, with_chart=False, interleaved=interleaved)
    for spec in plan.interleaved:
        row = _measure(plan, spec)
        interleaved.append(row)
        if row["status"] == "ok":
            forms = row["ms_by_form"]
            print(f"{spec.mode} batch {spec.batch_size}, the emulation's forms interleaved: saves fp32 "
                  f"{statistics.fmean(forms['saves_fp32']):,.1f} ms, saves fp16/bf16 "
                  f"{statistics.fmean(forms['saves_low']):,.1f} ms per update", flush=True)
        else:
            print(f"{spec.mode} batch {spec.batch_size} interleaved: {row['status']}", flush=True)
        write_outputs(plan, rows, header, with_chart=False, interleaved=interleaved)
    write_outputs(plan, rows, header, with_chart=True, interleaved=interleaved)
    print()
    print(markdown(plan, rows, header, interleaved))
    print(f"wrote {plan.out / 'bench.csv'}, bench.md, bench.json, bench.png")
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "help") for a in argv):
        print(USAGE)
        return 0
    if argv[:1] == ["--cell"] and len(argv) == 2:
        return _cell_main(argv[1])
    from pixelsac.envs import EnvError

    try:
        plan = make_plan(argv)
    except (ConfigError, EnvError, BenchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from pixelsac.perf import quiet_lightning

    _apply_threads(plan.overrides)
    with quiet_lightning():
        run_plan(plan)
    return 0


if __name__ == "__main__":
    # The benchmark renders nothing; without this, importing dm_control (for the task's shapes)
    # loads the OpenGL library MUJOCO_GL names, which a GPU box without display libraries lacks.
    os.environ["MUJOCO_GL"] = "disable"
    sys.exit(main())
