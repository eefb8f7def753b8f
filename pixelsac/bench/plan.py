"""The benchmark's plan: precision modes, ``bench.*`` options, and the checked list of cells
(mode x batch size x speed option), each a training configuration composed and validated
before anything runs."""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import math
from pathlib import Path
from typing import Any

from pixelsac import cli
from pixelsac.config import (
    COMPILE_MODES,
    SIX,
    ConfigError,
    check_each_key_once,
    load_config,
    load_options,
    option_lines,
)


class BenchError(ConfigError):
    """A bad benchmark option (exit code 2, nothing written)."""


# --- modes -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Mode:
    """One precision mode: the config overrides that make it, and where it can run."""

    name: str
    overrides: tuple[str, ...]
    what: str
    tf32: bool = False  # TF32 tensor-core matmuls and convolutions (GPU)
    only_on: str | None = None  # "cuda" or "cpu": skipped elsewhere, with a note


def _modes() -> dict[str, Mode]:
    modes = [
        Mode("fp32", ("precision=fp32", "lowp.all=false"), "fp32, DrQ as published (on a GPU: IEEE fp32, TF32 off)"),
        Mode(
            "tf32",
            ("precision=fp32", "lowp.all=false", "perf.tf32=true"),
            "fp32 parameters, TF32 tensor-core matmuls and convolutions",
            tf32=True,
            only_on="cuda",
        ),
        Mode("amp", ("precision=amp",), "fp32 parameters, autocast fp16, one GradScaler per optimizer"),
        Mode("bf16", ("precision=bf16",), "pure bf16 (five modifications; bf16 needs no loss scaling)"),
        Mode("fp16-naive", ("precision=fp16", "lowp.all=false"), "pure fp16 without the six (naive fp16)"),
        Mode(
            "fp16",
            ("precision=fp16", "lowp.all=true"),
            "pure fp16 with the six modifications, unbiased moments and the lean state (the default)",
        ),
        Mode(
            "fp16-six",
            (
                "precision=fp16",
                "lowp.all=true",
                "lowp.unbiased_moments=false",
                "lowp.derived_target=false",
                "lowp.adaptive_target_scale=false",
                "lowp.fp32_q_output=false",
                "lowp.headroom_growth=false",
            ),
            "pure fp16, the six as published (no unbiased moments, stored target, one K, fp16 Q, the paper's growth)",
        ),
        Mode(
            "bf16-six",
            (
                "precision=bf16",
                "lowp.unbiased_moments=false",
                "lowp.derived_target=false",
                "lowp.adaptive_target_scale=false",
                "lowp.fp32_q_output=false",
                "lowp.fp32_actor_loss=false",
                "lowp.fp32_actor_features=false",
            ),
            "pure bf16, the five as published",
        ),
        Mode(
            "bf16-no-fp32_actor_loss",
            ("precision=bf16", "lowp.fp32_actor_loss=false"),
            "pure bf16 with the actor's loss in bf16 arithmetic (bf16's default before lowp.fp32_actor_loss)",
        ),
        Mode(
            "bf16-no-fp32_actor_features",
            ("precision=bf16", "lowp.fp32_actor_features=false"),
            "pure bf16, the actor reading the bf16 trunk's features (the default before lowp.fp32_actor_features)",
        ),
        Mode(
            "fp16-compiled",
            ("precision=fp16", "lowp.all=true", "perf.compile_optimizer=true"),
            "fp16 with hAdam's step compiled into a few kernels (perf.compile_optimizer; slower on a CPU)",
        ),
        Mode(
            "bf16-compiled",
            ("precision=bf16", "perf.compile_optimizer=true"),
            "bf16 with hAdam's step compiled into a few kernels (perf.compile_optimizer; slower on a CPU)",
        ),
        Mode(
            "fp16-native",
            ("precision=fp16", "lowp.all=true", "lowp.fp32_accumulate=false"),
            "fp16 + six on the CPU's native fp16 kernels (fp32-accumulate emulation off)",
            only_on="cpu",
        ),
        Mode(
            "bf16-native",
            ("precision=bf16", "lowp.fp32_accumulate=false"),
            "pure bf16 on the CPU's own bf16 kernels, whatever the CPU has (emulation forced off)",
            only_on="cpu",
        ),
        Mode(
            "bf16-emulated",
            ("precision=bf16", "lowp.fp32_accumulate=true"),
            "pure bf16 with the fp32-accumulated emulation forced on (the bf16 row picks for the CPU)",
            only_on="cpu",
        ),
    ]
    modes += [
        Mode(
            f"fp16-no-{switch}",
            ("precision=fp16", "lowp.all=true", f"lowp.{switch}=false"),
            f"fp16 + six without {switch} (ablation)",
        )
        for switch in SIX
    ]
    return {mode.name: mode for mode in modes}


MODES = _modes()
#: the modes run when bench.modes is not given: conf/bench.yaml's default
DEFAULT_MODES = tuple(str(load_options("bench", [])["modes"]).split(","))
ABLATIONS = (
    "fp16-six",
    "bf16-six",
    "bf16-no-fp32_actor_loss",
    "bf16-no-fp32_actor_features",
    *(f"fp16-no-{switch}" for switch in SIX),
)


# --- options ---------------------------------------------------------------------------------
_ON_OFF = ("off", "on", "both")
_AUTO_ON_OFF = ("auto", "off", "on", "both")
_BATCH_SOURCES = ("host", "pinned", "device")


OPTIONS = option_lines("bench", prefix="bench.")
OPTIONS_USAGE = "\nbench.* options (conf/bench.yaml: name, default, meaning):\n" + "\n".join(
    f"  {line}" for line in OPTIONS.values()
)


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


def parse_options(argv: list[str]) -> BenchOptions:
    """Check and convert the ``bench.*`` arguments (``conf/bench.yaml`` holds their defaults;
    :func:`pixelsac.config.load_options` checks names, types and bounds); raise ConfigError."""
    value = load_options(
        "bench",
        argv,
        prefix="bench.",
        nullable={"batch_sizes": str, "updates": int, "warmup": int, "out": str},
        lower_bounds={"updates": 1, "warmup": 0},
        choices={
            "compile_mode": COMPILE_MODES,
            "emulation_saves": ("low", "fp32", "both"),
            "device": ("auto", "cpu", "cuda"),
        },
        verbatim=("out",),
        untyped=("modes", "batch_sizes", "channels_last", "compile", "sync_free", "cuda_graphs", "batch", "isolate"),
    )
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
    if value["ablations"]:
        modes += [name for name in ABLATIONS if name not in modes]
    if not modes:
        raise BenchError("bench.modes is empty; modes: " + ", ".join(MODES))

    batch_sizes = None
    if value["batch_sizes"] is not None:
        batch_sizes = [_positive_int("batch_sizes", b) for b in _as_list("batch_sizes", value["batch_sizes"])]
        if not batch_sizes:
            raise BenchError("bench.batch_sizes is empty")
    isolate = None if value["isolate"] in ("auto", None) else _bool("isolate", value["isolate"])
    out = value["out"]
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
        updates=value["updates"],
        warmup=value["warmup"],
        channels_last=_choice("channels_last", value["channels_last"], _AUTO_ON_OFF),
        compile=_choice("compile", value["compile"], _ON_OFF),
        compile_mode=value["compile_mode"],
        compile_backend=backend,
        sync_free=_choice("sync_free", value["sync_free"], _AUTO_ON_OFF),
        cuda_graphs=_choice("cuda_graphs", value["cuda_graphs"], _ON_OFF),
        batch=batch,
        isolate=isolate,
        emulation_saves=value["emulation_saves"],
        device=value["device"],
        out=out,
        overwrite=value["overwrite"],
    )


def split_arguments(argv: list[str]) -> tuple[list[str], list[str]]:
    """The ``bench.*`` arguments and the training-config overrides."""
    bench = [item for item in argv if item.strip().startswith("bench.")]
    return bench, [item for item in argv if not item.strip().startswith("bench.")]


# --- one cell's spec --------------------------------------------------------------------------------
@dataclasses.dataclass
class CellSpec:
    """Everything one measurement needs, as plain data (it crosses a process boundary)."""

    mode: str
    overrides: list[str]  # the user's overrides, then the mode's, then the batch size
    batch_size: int
    channels_last: bool | None  # None: the training default (perf.channels_last=null), unlabelled
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
    label_batch: bool = False  # name the batch source in the variant (it was asked for)
    cuda_graphs: bool = False
    emulation: str | None = None  # perf.time_updates(emulation=...): saves_low | saves_fp32 | interleaved
    label_emulation: bool = False  # name the emulation's form in the variant (it was asked for)
    reference_fp16: bool = False  # its fp16 arithmetic runs torch's reference CPU kernels (runs_reference_fp16)

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


def _emulates(cell_cfg: Any, device: str) -> bool:
    """Whether this cell's policy runs the CPU emulation of fp16/bf16 tensor cores."""
    from pixelsac.precision import PrecisionPolicy

    policy = PrecisionPolicy.from_config(cell_cfg, device)
    return policy.mode != "amp" and policy.fp32_accumulate


#: A CPU thread's rate on the DrQ update in fp32 or emulated fp16/bf16, in GFLOP/s: the 123-GFLOP
#: update at batch 128 took ~0.95 s on the project's 2-core CPU (2 threads). For an estimate only.
CPU_GFLOPS_PER_THREAD = 65.0
#: torch's reference fp16 CPU kernels (a CPU without native fp16 ones) take about this many times
#: fp32's time: amp at batch 512 took 84.7 s an update on an AMD EPYC (Zen 4).
REFERENCE_FP16_SLOWDOWN = 80.0
#: A cell's fixed cost on a CPU, in seconds: a fresh process, the agent built, its ops counted.
CELL_START_SECONDS = 10.0


def runs_reference_fp16(cell_cfg: Any, device: str) -> bool:
    """Whether a cell's half-precision arithmetic runs torch's reference fp16 CPU kernels: autocast
    fp16 (``amp``) or fp16 parameters without the fp32-accumulate emulation, on a CPU that has no
    native fp16 kernels (:func:`pixelsac.precision.native_half_kernels`)."""
    if device != "cpu":
        return False
    import torch

    from pixelsac.precision import PrecisionPolicy, native_half_kernels

    policy = PrecisionPolicy.from_config(cell_cfg, device)
    half = policy.mode == "amp" or (policy.param_dtype == torch.float16 and not policy.fp32_accumulate)
    return half and native_half_kernels(torch.float16) is None


def expected_seconds(spec: CellSpec, gflop_per_update: float, threads: int) -> float:
    """About how long a CPU cell takes: its start, then warm-up, timed and counted updates at
    :data:`CPU_GFLOPS_PER_THREAD` a thread (x :data:`REFERENCE_FP16_SLOWDOWN` on reference fp16
    kernels). A rough figure, printed before the cells run; the measured times are the result."""
    update = gflop_per_update / (CPU_GFLOPS_PER_THREAD * max(threads, 1))
    if spec.reference_fp16:
        update *= REFERENCE_FP16_SLOWDOWN
    return CELL_START_SECONDS + (spec.warmup + spec.updates + 1) * update


def make_plan(argv: list[str]) -> Plan:
    """Check every argument and compose every cell's configuration; writes nothing.

    Raises ConfigError, EnvError or BenchError with a one-line message."""
    check_each_key_once(argv)  # what the user typed; the cells then layer their own keys on it
    given, overrides = split_arguments(argv)
    options = parse_options(given)
    modes_named = any(item.partition("=")[0].strip() == "bench.modes" for item in given)
    left_out: list[str] = []  # default modes on reference fp16 kernels (not named in bench.modes)
    from pixelsac.envs import available_tasks

    cfg = load_config(overrides, valid_tasks=available_tasks())
    import torch

    device = options.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise BenchError("bench.device=cuda but torch sees no CUDA device")
    out = (
        Path(options.out) if options.out else Path("runs") / "bench" / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    )
    cli.check_out_dir(out, options.overwrite, "bench.out", overwrite_key="bench.overwrite")
    on_gpu = device == "cuda"
    updates = options.updates or (500 if on_gpu else 3)
    warmup = options.warmup if options.warmup is not None else (20 if on_gpu else 1)
    batch_sizes = options.batch_sizes or [int(cfg.agent.batch_size)]
    obs_shape, action_dim, frame_shape, frame_dtype = cli.task_shapes(cfg)

    notes: list[str] = []
    modes = []
    for name in options.modes:
        mode = MODES[name]
        if mode.only_on is not None and mode.only_on != device:
            notes.append(
                f"{name}: skipped on a {device.upper() if on_gpu else 'CPU'} -- "
                + (
                    "TF32 is a GPU tensor-core format"
                    if name == "tf32"
                    else "fp32-accumulate emulation exists only on a CPU, so it would repeat fp16"
                )
            )
            continue
        modes.append(mode)
    layouts = {"off": [False], "on": [True], "both": [False, True], "auto": [None]}
    sources = options.batch or ["pinned" if on_gpu else "host"]
    if not on_gpu and sources != ["host"]:
        notes.append(
            "batch sources pinned and device: skipped on a CPU -- page-locked memory and a separate "
            "device exist only with CUDA (a CPU batch is already where the update runs)"
        )
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
                                # perf.sync_free alone: the random shift and the optimizers stay the
                                # configuration's, so the rows differ by host reads only
                                speed = [] if sync is None else [f"perf.sync_free={str(sync).lower()}"]
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
                                spec = CellSpec(
                                    mode.name,
                                    cell_overrides,
                                    batch_size,
                                    channels_last,
                                    compile,
                                    options.compile_mode,
                                    options.compile_backend,
                                    updates,
                                    warmup,
                                    device,
                                    list(obs_shape),
                                    action_dim,
                                    sync_free,
                                    source,
                                    label_batch=options.batch is not None and on_gpu,
                                    cuda_graphs=graphs,
                                    reference_fp16=runs_reference_fp16(cell_cfg, device),
                                )
                                if spec.reference_fp16 and not modes_named:
                                    if mode.name not in left_out:
                                        left_out.append(mode.name)
                                    continue
                                if options.emulation_saves == "low" or not _emulates(cell_cfg, device):
                                    cells.append(spec)
                                    continue
                                forms = (
                                    ["saves_fp32", "saves_low"] if options.emulation_saves == "both" else ["saves_fp32"]
                                )  # the earlier form first: the base of 'vs switches off'
                                cells += [
                                    dataclasses.replace(spec, emulation=form, label_emulation=True) for form in forms
                                ]
                                if options.emulation_saves == "both":
                                    interleaved.append(
                                        dataclasses.replace(
                                            spec,
                                            emulation="interleaved",
                                            updates=4 * math.ceil(max(updates, 4) / 4),
                                            warmup=max(warmup, 2),
                                        )
                                    )
    if left_out:
        notes.append(
            f"{', '.join(left_out)}: left out on this CPU (name them in bench.modes to run them) -- without native "
            f"fp16 kernels they run torch's reference ones, ~{REFERENCE_FP16_SLOWDOWN:.0f}x fp32's time (amp at "
            "batch 512: 85 s an update); amp stays fp16 autocast with GradScaler, the paper's mixed-precision "
            "baseline, rather than torch's CPU default bf16 (the bf16 rows are this CPU's bf16)"
        )
    if not cells:
        raise BenchError(f"nothing to run on a {device}: " + "; ".join(notes))
    if options.emulation_saves != "low" and not any(cell.emulation for cell in cells):
        notes.append(
            f"emulation_saves={options.emulation_saves}: no cell emulates fp16/bf16 tensor cores "
            "(that is fp16/bf16 on a CPU with lowp.fp32_accumulate on)"
        )
    from pixelsac.replay import ReplayBuffer

    # bytes per transition do not depend on capacity; a tiny buffer allocates almost nothing
    replay = ReplayBuffer(
        cfg.env.frame_stack + 8,
        frame_shape,
        frame_dtype,
        cfg.env.frame_stack if cfg.env.obs == "pixels" else 1,
        action_dim,
    )
    replay_info = {
        "bytes_per_transition": replay.bytes_per_transition,
        "capacity": int(cfg.replay.capacity),
        "frame_shape": list(frame_shape),
        "frame_dtype": str(frame_dtype),
        "action_dim": action_dim,
    }
    isolate = options.isolate if options.isolate is not None else not on_gpu
    return Plan(options, overrides, cfg, device, out, cells, notes, replay_info, isolate, interleaved)
