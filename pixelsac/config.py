"""Configuration: YAML defaults in ``conf/``, command-line overrides, validation with clear errors.

A run's configuration is composed in a fixed order, later sources winning::

    conf/config.yaml  <  conf/task/<task>.yaml  <  conf/preset/<preset>.yaml  <  key=value overrides

``conf/config.yaml`` is the schema: every key a run understands is there, and its default's type
is the type an override must have (ints are accepted where floats are expected). Keys whose
default is ``null`` have their type declared in :data:`NULLABLE`. Numbers are read as people
write them, in ``conf/`` files and on the command line alike: ``1e-3``, ``1E6`` and ``inf`` where
a number is asked for (YAML 1.1 alone reads the first two as strings), any whole number --
``1e6``, ``2000.0`` -- where an integer is, up to :data:`MAX_INTEGER`. A key is given once: on
the command line (:func:`check_each_key_once`) and in a YAML file. ``trainer.*`` keys are passed
to ``lightning.Trainer`` and are checked against its signature. Every mistake raises
:class:`ConfigError` carrying one line that says what is wrong and what would be valid; the entry
points turn it into exit code 2 before anything is written.
"""

from __future__ import annotations

import decimal
import difflib
import inspect
import math
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

PRECISION_MODES = ("fp32", "fp16", "bf16", "amp")
#: The six modifications of Bjorck et al. (2021), by their ``lowp.*`` switch names.
SIX = ("hadam", "loss_scaling", "kahan_gradients", "kahan_momentum", "softplus_fix", "normal_fix")

# Seeds derived from ``seed``, so that no two streams of one run coincide: data-parallel rank r
# collects with seed + RANK_SEED_STRIDE * r; the evaluation episodes that choose best.ckpt use
# seed + EVAL_SEED_OFFSET; ``python -m pixelsac.evaluate`` reports on seed + REPORT_SEED_OFFSET,
# episodes unseen in training and in choosing best.ckpt.
RANK_SEED_STRIDE = 1000
EVAL_SEED_OFFSET = 100_000
REPORT_SEED_OFFSET = 200_000
OBS_KINDS = ("pixels", "state")
AUG_BACKENDS = ("kornia", "index")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: Signals ``stop.signals`` may name: the ones schedulers and terminals send to ask a job to end
#: (SIGKILL and SIGSTOP cannot be caught; the others would stop on faults or job control).
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")

#: Types of keys whose default is null (anything else takes its type from conf/config.yaml).
NULLABLE: dict[str, type] = {
    "preset": str,
    "run_dir": str,
    "resume": str,
    "stop.signals": str,
    "lowp.all": bool,
    **{f"lowp.{name}": bool for name in SIX},
    "lowp.fp32_accumulate": bool,
    "lowp.emulate_batch_chunk": int,
    "lowp.unbiased_moments": bool,
    "lowp.stochastic_weights": bool,
    "lowp.stochastic_first_moment": bool,
    "lowp.derived_target": bool,
    "lowp.fp32_q_output": bool,
    "lowp.adaptive_target_scale": bool,
    "lowp.headroom_growth": bool,
    "lowp.growth_interval": int,
    "lowp.fp32_actor_loss": bool,
    "lowp.fp32_actor_features": bool,
    "env.action_repeat": int,
    "env.camera_id": int,
    "env.shadow_size": int,
    "train.num_threads": int,
    "replay.device": str,
    "replay.pin_memory": bool,
    "perf.sync_free": bool,
    "perf.channels_last": bool,
    "perf.split_k": int,
    "perf.aug_backend": str,
}

#: Nullable keys whose null means "decide for this machine", also spelled ``auto``.
AUTO_MEANS_NULL = ("lowp.fp32_accumulate",)

# (key, smallest allowed value): sizes and counts that must be positive (or non-negative).
_LOWER_BOUNDS: dict[str, float] = {
    "env.image_size": 1,
    "env.frame_stack": 1,
    "env.episode_frames": 1,
    "env.action_repeat": 1,
    "env.camera_id": 0,
    "env.shadow_size": 0,
    "env.num_envs": 1,
    "replay.capacity": 1,
    "agent.batch_size": 1,
    "agent.num_filters": 1,
    "agent.num_conv_layers": 1,
    "agent.feature_dim": 1,
    "agent.hidden_dim": 1,
    "agent.hidden_depth": 1,
    "agent.aug_pad": 0,
    "agent.aug_target_copies": 1,
    "agent.aug_q_copies": 1,
    "agent.critic_target_update_every": 1,
    "agent.actor_update_every": 1,
    "train.env_frames": 1,
    "train.seed_steps": 0,
    "train.updates_per_step": 0,
    "train.eval_every_frames": 1,
    "train.eval_episodes": 1,
    "train.log_every_updates": 1,
    "train.num_threads": 1,
    "train.video_every_evals": 0,
    "train.video_size": 16,
    "perf.calibrate_updates": 0,
    "perf.warmup_updates": 0,
    "perf.graph_warmup_updates": 1,
    "perf.split_k": 0,
    "lowp.init_scale": 1e-30,
    "lowp.growth_interval": 1,
    "lowp.emulate_batch_chunk": 1,
    "lowp.adam_eps_scaled": 1e-30,
    "safety.min_loss_scale": 0.0,
    "lowp.target_scale": 1e-30,
    "agent.lr": 1e-30,
    "agent.adam_eps": 1e-30,
    "agent.init_temperature": 1e-30,
    "agent.critic_tau": 1e-30,
    "agent.reward_scale": 1e-30,
    "stop.max_wait_steps": 0,
    "stop.max_wait_seconds": 0.0,
    "train.progress_every_seconds": 0.0,
}
#: The most gradient updates one agent step may hold: DrQ takes 1, the high update-to-data
#: methods (REDQ, DroQ, replay-ratio scaling) up to a few hundred; far more is a typo.
MAX_UPDATES_PER_STEP = 1024
_UNIT_INTERVAL = ("agent.discount", "agent.critic_tau", "agent.beta1", "agent.beta2")
#: Float keys where infinity means something ("never", "however long"); NaN is refused everywhere.
_INFINITY_ALLOWED = ("stop.max_wait_seconds", "train.progress_every_seconds")
#: numpy's (and dm_control's) seeds are 0..2**32-1; a run derives seeds above ``seed`` (see above).
MAX_NUMPY_SEED = 2**32 - 1
#: Lightning limits that would end ``fit`` before ``train.env_frames`` (the budget) is collected,
#: with the value that leaves the budget alone.
_EARLY_ENDING_TRAINER_KEYS = {"max_steps": -1, "max_time": None, "limit_train_batches": None}
#: Keys that hold for one invocation only: never stored in a run's config.yaml or checkpoints.
INVOCATION_ONLY_KEYS = ("trust_checkpoint",)
#: The largest integer any setting takes: numpy and torch count and index in int64.
MAX_INTEGER = 2**63 - 1
#: Numbers as people write them (1e-3, 1E6, .5, 2.5e+4, 1_000), which YAML 1.1 reads as strings
#: unless they have a dot and a signed exponent.
_NUMBER = re.compile(r"[-+]?(?:\d(?:_?\d)*(?:\.(?:\d(?:_?\d)*)?)?|\.\d(?:_?\d)*)(?:[eE][-+]?\d+)?")
#: Infinity and NaN as words (YAML 1.1 only knows .inf and .nan); NaN is refused by validation.
_NON_FINITE_WORDS = re.compile(r"[-+]?(?:inf|infinity|nan)", re.IGNORECASE)
#: Longer texts are shown shortened in an error line.
_SHOWN_CHARS = 40


class ConfigError(ValueError):
    """A configuration mistake, described in one line (exit code 2 at the command line)."""


def conf_dir() -> Path:
    """The ``conf/`` folder: ``$PIXELSAC_CONF`` if set (a copy of that folder, edited), else the
    one beside the package. A ``$PIXELSAC_CONF`` without a ``config.yaml`` is a ConfigError."""
    env = os.environ.get("PIXELSAC_CONF")
    if not env:
        return Path(__file__).resolve().parent.parent / "conf"
    if not (Path(env) / "config.yaml").is_file():
        raise ConfigError(
            f"PIXELSAC_CONF={_shown(env)} holds no config.yaml: point it at a copy of pixelsac's conf/ folder, "
            "or unset it to use the one beside the package"
        )
    return Path(env)


def _names(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.yaml"))


#: Task and preset names: file names under conf/ (a longer or odder one names no file there).
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")
#: Characters no ``key=value`` may hold: they would be echoed raw to a terminal (ESC) or folded
#: away by YAML (a newline in a run_dir becomes a space).
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _is_name(text: str) -> bool:
    return _NAME.fullmatch(text) is not None and not text.startswith(".")


def _suggest(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""


def _load_yaml(path: Path) -> DictConfig:
    try:
        cfg = OmegaConf.load(path)
    except Exception as exc:  # yaml errors carry multi-line context; keep the first line
        twice = _repeated_yaml_key(path)
        if twice:
            raise ConfigError(f"{path}: {twice}; keep one") from None
        if isinstance(exc, ValueError) and "digits" in str(exc):  # Python's int-from-text limit
            raise ConfigError(
                f"cannot read {path}: a number there has more than {_max_int_digits():,} digits, "
                "more than any setting takes"
            ) from None
        raise ConfigError(f"cannot read {path}: {str(exc).splitlines()[0]}") from exc
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path} must hold a mapping of keys to values")
    return cfg


def _repeated_yaml_key(path: Path) -> str | None:
    """What a YAML file repeats -- ``"agent.lr is given twice (lines 2 and 4)"`` -- or None.
    PyYAML (and so OmegaConf) reports only the second occurrence; this names both."""
    try:
        root = yaml.compose(path.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None

    def walk(node: Any, prefix: str) -> str | None:
        if not isinstance(node, yaml.MappingNode):
            return None
        first_line: dict[str, int] = {}
        for key_node, value_node in node.value:
            name = f"{prefix}{key_node.value}"
            line = key_node.start_mark.line + 1
            if name in first_line:
                return f"{name} is given twice (lines {first_line[name]} and {line})"
            first_line[name] = line
            found = walk(value_node, f"{name}.")
            if found:
                return found
        return None

    return walk(root, "")


def _max_int_digits() -> int:
    """Python's limit on the digits of an integer read from text (4300 unless changed)."""
    import sys

    return sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 4300


def _shown(text: str) -> str:
    """``text`` for an error line: a very long one (a number of 100,000 digits) is cut short."""
    if len(text) <= _SHOWN_CHARS:
        return text
    return f"{text[:10]}... ({len(text):,} {'digits' if text.isdigit() else 'characters'})"


def check_each_key_once(overrides: Sequence[str]) -> None:
    """A ConfigError naming both when a ``key=value`` list gives a key twice. What a user types
    is checked with it (the command line of each entry point): a repeated key is a typo or a
    pasted command, and the earlier value would be dropped unseen. Code that layers its own
    overrides on a user's (the benchmark's cells, tests) composes with :func:`load_config`,
    where the later of two wins."""
    seen: dict[str, str] = {}
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key in seen:
            raise ConfigError(f"{key} is given twice: {_shown(seen[key])!r} and {_shown(item)!r}; give each key once")
        seen[key] = item


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """``["a.b=3", "task=walker_walk"]`` -> ``{"a.b": 3, "task": "walker_walk"}`` (YAML-typed values;
    a key given twice: the later value)."""
    parsed: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"expected key=value, got {_shown(item)!r} (example: agent.batch_size=256)")
        control = _CONTROL.search(raw)
        if control is not None or _CONTROL.search(key):
            found = control or _CONTROL.search(key)
            raise ConfigError(
                f"{_shown(repr(key)[1:-1])}=... holds the control character {found.group(0)!r} at position "
                f"{found.start()} of its {'value' if control is not None else 'key'}; type it without"
            )
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw  # an unquoted string YAML cannot parse is still a string
        except ValueError:  # an integer longer than Python reads from text (4300 digits)
            raise ConfigError(f"{key}={_shown(raw.strip())} is too long to be a number any setting takes") from None
        parsed[key] = value
    return parsed


def _type_name(t: type) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[t]


def _number_from_text(key: str, text: str, expected: type) -> Any:
    """``text`` as the number it spells (``1e-3``, ``1E6``, ``inf``) for a key that takes
    ``expected`` (int or float), or ``text`` unchanged when it spells none. An integer key takes
    a whole number in any notation (``1e6``); read exactly, never through a float."""
    stripped = text.strip()
    if _NON_FINITE_WORDS.fullmatch(stripped):
        if expected is int:
            raise ConfigError(f"{key}={text!r} is not a whole number; it takes an integer")
        return float(stripped)
    if not _NUMBER.fullmatch(stripped):
        return text
    if expected is float:
        number = float(stripped)
        if math.isinf(number):
            raise ConfigError(f"{key}={_shown(stripped)} is too large for a number (the largest is about 1.8e308)")
        return number
    exact = decimal.Decimal(stripped.replace("_", ""))
    if exact.adjusted() > 18:  # more than 19 digits: beyond MAX_INTEGER (and too many to build)
        raise ConfigError(f"{key}={_shown(stripped)} is too large: integers stop at 2^63 - 1 = {MAX_INTEGER}")
    if exact != exact.to_integral_value():
        raise ConfigError(f"{key}={text!r} is not a whole number; it takes an integer")
    return int(exact)


def _check_type(key: str, value: Any, expected: type, nullable: Iterable[str] = NULLABLE) -> Any:
    if value is None:
        if key in nullable:
            return None
        raise ConfigError(f"{key} cannot be null; it takes {_type_name(expected)}")
    if expected in (int, float) and isinstance(value, str):
        value = _number_from_text(key, value, expected)
    if expected is int and isinstance(value, float) and value.is_integer():
        value = int(value)  # 2000.0, 1.0e+6: YAML's floats that are whole numbers
    ok = (
        isinstance(value, bool)
        if expected is bool
        else isinstance(value, (int, float)) and not isinstance(value, bool)
        if expected is float
        else isinstance(value, int) and not isinstance(value, bool)
        if expected is int
        else isinstance(value, str)
    )
    if not ok:
        raise ConfigError(f"{key}={_shown(repr(value))} has the wrong type; it takes {_type_name(expected)}")
    if expected is int and abs(value) > MAX_INTEGER:
        raise ConfigError(f"{key}={_shown(str(value))} is too large: integers stop at 2^63 - 1 = {MAX_INTEGER}")
    if expected is float:
        try:
            return float(value)
        except OverflowError:  # an integer of more than 308 digits
            raise ConfigError(
                f"{key}={_shown(str(value))} is too large for a number (the largest is about 1.8e308)"
            ) from None
    return value


def _trainer_keys() -> list[str]:
    import lightning  # deferred: importing lightning costs seconds

    return [p for p in inspect.signature(lightning.Trainer.__init__).parameters if p != "self"]


def _apply(cfg: DictConfig, key: str, value: Any, defaults: DictConfig) -> None:
    """Set one dotted key after checking that it exists and the value has its type."""
    head, _, rest = key.partition(".")
    if head == "trainer" and rest:
        if "." in rest or rest not in _trainer_keys():
            raise ConfigError(
                f"unknown Lightning Trainer argument {rest!r}{_suggest(rest, _trainer_keys())}; "
                "trainer.* takes the arguments of lightning.Trainer (e.g. trainer.devices=2)"
            )
        if rest in ("logger", "callbacks", "enable_checkpointing", "default_root_dir", "precision", "max_epochs"):
            raise ConfigError(
                f"trainer.{rest} is set by pixelsac itself (use run_dir=..., precision=..., train.env_frames=...)"
            )
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            value = float(value)  # 1e-3 as YAML 1.1 leaves it (a plain integer is already one)
        OmegaConf.update(cfg, key, value, force_add=True)
        return
    default = OmegaConf.select(defaults, key, default="__missing__")
    if isinstance(default, str) and default == "__missing__":
        parent, _, leaf = key.rpartition(".")
        scope = OmegaConf.select(defaults, parent) if parent else defaults
        if not isinstance(scope, DictConfig):  # e.g. "nope.x": report against the top level
            parent, leaf, scope = "", head, defaults
        valid = [f"{parent}.{k}" if parent else str(k) for k in scope.keys()]
        where = f"keys under '{parent}'" if parent else "top-level keys"
        guess = _suggest(f"{parent}.{leaf}" if parent else leaf, valid)
        raise ConfigError(f"unknown key {key!r}{guess}; {where}: {', '.join(valid)}")
    if isinstance(default, DictConfig):
        raise ConfigError(f"{key} is a group of keys; set one of them, e.g. {key}.{next(iter(default))}=...")
    expected = NULLABLE.get(key) or type(default)
    if key in AUTO_MEANS_NULL and value == "auto":
        value = None
    OmegaConf.update(cfg, key, _check_type(key, value, expected))


#: What may change when a run is resumed: budgets, logging, hardware, safety -- not the agent,
#: its environment or its precision, which the checkpoint's weights and replay are tied to.
RESUMABLE = (
    "train.",
    "trainer.",
    "perf.",
    "safety.",
    "checkpoint.",
    "stop.",
    "trust_checkpoint",
    "resume",
    "overwrite",
    "replay.device",
    "replay.pin_memory",
)  # where the replay lives; its saved state is the same anywhere


def load_config(
    overrides: Sequence[str] = (),
    valid_tasks: Iterable[str] | None = None,
    conf: Path | None = None,
    base: dict[str, Any] | None = None,
) -> DictConfig:
    """Compose and validate a run configuration.

    ``valid_tasks`` (the dm_control suite task names) lets an unknown task be refused here, with
    suggestions, instead of later when the environment is built. ``base`` is a stored run's
    configuration to continue from (resume): overrides then apply to it, and only the keys in
    :data:`RESUMABLE` may change; any other key may be repeated with the value the run already has,
    so that a requeued job can run its first command again with ``resume=auto``.
    """
    conf = conf or conf_dir()
    defaults = _load_yaml(conf / "config.yaml")
    given = parse_overrides(overrides)
    if base is not None:
        cfg = OmegaConf.merge(defaults, OmegaConf.create(base))  # keys added since it was saved
        for key, value in given.items():
            if not key.startswith(RESUMABLE) and not _same_as_stored(cfg, key, value, defaults):
                raise ConfigError(
                    f"{key} cannot change when resuming (the checkpoint was trained with "
                    f"{key}={OmegaConf.select(cfg, key)!r}); start a new run instead"
                )
            _apply(cfg, key, value, defaults)
        validate(cfg)
        OmegaConf.set_readonly(cfg, True)
        return cfg

    preset = given.get("preset", defaults.get("preset"))
    preset_cfg = None
    if preset is not None:
        if not isinstance(preset, str) or not _is_name(preset) or not (conf / "preset" / f"{preset}.yaml").is_file():
            presets = _names(conf / "preset")
            raise ConfigError(
                f"unknown preset {_shown(repr(preset))}{_suggest(str(preset), presets)}; presets: {', '.join(presets)}"
            )
        preset_cfg = _load_yaml(conf / "preset" / f"{preset}.yaml")

    task = given.get(
        "task", preset_cfg.get("task") if preset_cfg is not None and "task" in preset_cfg else defaults.task
    )
    if not isinstance(task, str) or not _is_name(task):
        raise ConfigError(f"task={_shown(repr(task))} must be a task name such as cheetah_run")
    if valid_tasks is not None:
        tasks = sorted(valid_tasks)
        if task not in tasks:
            raise ConfigError(
                f"unknown task {task!r}{_suggest(task, tasks)}; dm_control suite tasks: {', '.join(tasks)}"
            )

    cfg = defaults.copy()
    layers: list[tuple[str, DictConfig]] = []
    task_file = conf / "task" / f"{task}.yaml"
    if task_file.is_file():
        layers.append((str(task_file), _load_yaml(task_file)))
    if preset_cfg is not None:
        layers.append((f"preset {preset}", preset_cfg))
    for source, layer in layers:
        for key, value in _flatten(OmegaConf.to_container(layer)).items():
            try:
                _apply(cfg, key, value, defaults)
            except ConfigError as exc:
                raise ConfigError(f"in {source}: {exc}") from None
    for key, value in given.items():
        _apply(cfg, key, value, defaults)
    cfg.task = task
    validate(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _same_as_stored(cfg: DictConfig, key: str, value: Any, defaults: DictConfig) -> bool:
    """Whether ``key=value`` only repeats what the stored run already has (checked for type first)."""
    probe = cfg.copy()
    _apply(probe, key, value, defaults)  # an unknown key or a wrong type is reported as such
    return OmegaConf.select(probe, key) == OmegaConf.select(cfg, key)


def stop_signal_names(value: str | None) -> list[str]:
    """``stop.signals`` as canonical names (``"term, SIGUSR1"`` -> ``["SIGTERM", "SIGUSR1"]``)."""
    if value is None:
        return []
    names = []
    for item in str(value).split(","):
        name = item.strip().upper()
        if not name:
            continue
        name = name if name.startswith("SIG") else f"SIG{name}"
        if name not in STOP_SIGNALS:
            what = (
                "cannot be caught"
                if name in ("SIGKILL", "SIGSTOP")
                else f"is not a stop signal{_suggest(name, STOP_SIGNALS)}"
            )
            raise ConfigError(
                f"stop.signals: {item.strip()!r} {what}; choose from {', '.join(STOP_SIGNALS)} "
                "(comma-separated), or null for the operating system's defaults"
            )
        if name not in names:
            names.append(name)
    return names


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _is_replay_device(value: str) -> bool:
    """A ``replay.device`` value: auto, cpu, cuda or cuda:N (whether it exists is checked when the run is built)."""
    return value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit())


def validate(cfg: DictConfig) -> None:
    """Check values that have the right type but make no sense (negative sizes, unknown modes)."""
    if cfg.precision not in PRECISION_MODES:
        raise ConfigError(
            f"unknown precision {cfg.precision!r}{_suggest(cfg.precision, PRECISION_MODES)}; "
            f"choose one of {', '.join(PRECISION_MODES)}"
        )
    if cfg.env.obs not in OBS_KINDS:
        raise ConfigError(f"env.obs={cfg.env.obs!r}; choose one of {', '.join(OBS_KINDS)}")
    replay_device = OmegaConf.select(cfg, "replay.device")
    if replay_device is not None and not _is_replay_device(replay_device):
        raise ConfigError(
            f"replay.device={replay_device!r}; choose null (host memory), auto (the training device), "
            "cpu, cuda or cuda:N"
        )
    if cfg.perf.aug_backend is not None and cfg.perf.aug_backend not in AUG_BACKENDS:
        raise ConfigError(
            f"perf.aug_backend={cfg.perf.aug_backend!r}; choose one of {', '.join(AUG_BACKENDS)} "
            "(or null: index on CUDA, kornia elsewhere)"
        )
    if cfg.perf.compile_mode not in COMPILE_MODES:
        raise ConfigError(f"perf.compile_mode={cfg.perf.compile_mode!r}; choose one of {', '.join(COMPILE_MODES)}")
    stop_signal_names(cfg.stop.signals)
    _check_finite(cfg)
    if cfg.resume == "auto" and not cfg.run_dir:
        raise ConfigError(
            "resume=auto needs run_dir=DIR: the directory the job writes to and, when it already "
            "holds a checkpoint, resumes from"
        )
    for key, low in _LOWER_BOUNDS.items():
        value = OmegaConf.select(cfg, key)
        if value is not None and value < low:
            what = "positive" if low > 0 else "zero or more"
            raise ConfigError(f"{key}={value} must be {what}")
    if cfg.train.updates_per_step > MAX_UPDATES_PER_STEP:
        raise ConfigError(
            f"train.updates_per_step={cfg.train.updates_per_step} is more than {MAX_UPDATES_PER_STEP} updates per "
            f"agent step (DrQ takes 1); choose 0 to {MAX_UPDATES_PER_STEP}"
        )
    for key in _UNIT_INTERVAL:
        value = OmegaConf.select(cfg, key)
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{key}={value} must lie in [0, 1]")
    # each 3x3 conv trims 2 pixels and the first also halves: L layers leave 1 from 4L - 1
    smallest_image = 4 * cfg.agent.num_conv_layers - 1
    if cfg.env.obs == "pixels" and cfg.env.image_size < smallest_image:
        raise ConfigError(
            f"env.image_size={cfg.env.image_size} is too small for {cfg.agent.num_conv_layers} conv layers: "
            f"they need at least {smallest_image} pixels"
        )
    if not cfg.agent.log_std_min < cfg.agent.log_std_max:
        raise ConfigError(
            f"agent.log_std_min={cfg.agent.log_std_min} must be below agent.log_std_max={cfg.agent.log_std_max}"
        )
    _check_seed(cfg)
    _check_trainer_limits(cfg)


def _check_finite(cfg: DictConfig) -> None:
    """NaN nowhere, infinity only where it means "never" (:data:`_INFINITY_ALLOWED`): a NaN
    passes every ``<``/``>`` check (they are all False), so it is caught here, first."""
    for key, value in _flatten(OmegaConf.to_container(cfg, resolve=True)).items():
        if not isinstance(value, float) or math.isfinite(value):
            continue
        if math.isnan(value) or key not in _INFINITY_ALLOWED:
            raise ConfigError(f"{key}={value} must be a finite number")


def derived_seed_span(cfg: DictConfig) -> int:
    """How far above ``seed`` the run's derived seeds reach: the report episodes of
    ``pixelsac.evaluate`` (+REPORT_SEED_OFFSET), or the last env of the last data-parallel rank."""
    devices, nodes = cfg.trainer.get("devices", 1), cfg.trainer.get("num_nodes", 1)
    ranks = devices * nodes if isinstance(devices, int) and isinstance(nodes, int) and devices > 0 else 1
    return max(REPORT_SEED_OFFSET, EVAL_SEED_OFFSET, RANK_SEED_STRIDE * (ranks - 1) + cfg.env.num_envs - 1)


def _check_seed(cfg: DictConfig) -> None:
    highest = MAX_NUMPY_SEED - derived_seed_span(cfg)
    if not 0 <= cfg.seed <= highest:
        raise ConfigError(
            f"seed={cfg.seed} is out of range: choose 0..{highest} (numpy takes seeds 0..{MAX_NUMPY_SEED}, "
            f"and this run also uses seeds up to seed + {derived_seed_span(cfg)})"
        )


def _check_trainer_limits(cfg: DictConfig) -> None:
    """``train.env_frames`` is the budget: a Lightning limit that would end the run sooner (and
    let it print "done" short of its budget) is refused."""
    for key, neutral in _EARLY_ENDING_TRAINER_KEYS.items():
        value = cfg.trainer.get(key, neutral)
        if value != neutral and not (key == "limit_train_batches" and value in (1.0, 1)):
            raise ConfigError(
                f"trainer.{key}={value} would end the run before train.env_frames={cfg.train.env_frames}; "
                f"train.env_frames is the budget: set it instead (and leave trainer.{key} "
                f"{'unset' if neutral is None else f'at {neutral}'})"
            )


def stored_config(cfg: DictConfig | dict[str, Any]) -> dict[str, Any]:
    """What a run stores of its configuration (config.yaml, checkpoints): everything but the
    :data:`INVOCATION_ONLY_KEYS`, which an invocation grants itself on its own command line."""
    plain = to_plain(cfg) if isinstance(cfg, DictConfig) else dict(cfg)
    for key in INVOCATION_ONLY_KEYS:
        plain.pop(key, None)
    return plain


def load_options(
    name: str,
    argv: Sequence[str],
    *,
    nullable: dict[str, type] | None = None,
    lower_bounds: dict[str, float] | None = None,
    choices: dict[str, Sequence[str]] | None = None,
    verbatim: Iterable[str] = (),
    untyped: Iterable[str] = (),
    prefix: str = "",
    conf: Path | None = None,
) -> dict[str, Any]:
    """The options of an entry point other than training, as one validated config group.

    ``conf/<name>.yaml`` holds every option with its default (and, in its comments, what it
    means); ``argv`` are ``key=value`` overrides (keys written with ``prefix``, e.g. ``bench.``).
    Checked the way training keys are, each refusal a one-line :class:`ConfigError`: a key given
    twice, an unknown key (with a suggestion), a value of the wrong type (the default's, or
    ``nullable``'s for a key whose default is null), a value below its ``lower_bounds`` or
    outside its ``choices``.
    ``verbatim`` keys keep the text as typed (paths: YAML would read ``out_dir=2024`` as a
    number); ``untyped`` keys are returned YAML-typed for the caller to interpret.
    """
    check_each_key_once(argv)
    defaults = _load_yaml((conf or conf_dir()) / f"{name}.yaml")
    options: dict[str, Any] = OmegaConf.to_container(defaults)
    nullable, lower_bounds, choices = nullable or {}, lower_bounds or {}, choices or {}
    verbatim, untyped = set(verbatim), set(untyped)
    raw = {item.partition("=")[0].strip(): item.partition("=")[2] for item in argv}
    for written, value in parse_overrides(argv).items():
        key = written.removeprefix(prefix) if prefix else written
        if key not in options or (prefix and not written.startswith(prefix)):
            valid = [prefix + k for k in options]
            raise ConfigError(f"unknown option {written!r}{_suggest(written, valid)}; options: {', '.join(valid)}")
        shown = prefix + key
        if key in verbatim:
            text = raw[written].strip()
            if not text:
                raise ConfigError(f"{shown}= needs a value")
            value = None if text in ("null", "~") and key in nullable else text
        elif key not in untyped:
            expected = nullable.get(key) or type(options[key])
            if options[key] is None and key not in nullable:
                raise ConfigError(f"option {shown} has no declared type")  # a mistake in the caller, not the user
            value = _check_type(shown, value, expected, nullable={prefix + k for k in nullable})
        low = lower_bounds.get(key)
        if low is not None and value is not None and value < low:
            raise ConfigError(f"{shown}={value} must be {'positive' if low > 0 else 'zero or more'}")
        if key in choices and value not in choices[key]:
            raise ConfigError(f"{shown}={value!r}; choose one of {', '.join(map(str, choices[key]))}")
        options[key] = value
    return options


def option_lines(name: str, prefix: str = "", conf: Path | None = None) -> dict[str, str]:
    """Option -> its line of ``conf/<name>.yaml`` (name, default, meaning), as ``--help`` prints it."""
    lines = ((conf or conf_dir()) / f"{name}.yaml").read_text().splitlines()
    return {line.partition(":")[0]: prefix + line for line in lines if line and not line.startswith("#")}


def to_plain(cfg: DictConfig) -> dict[str, Any]:
    """The configuration as plain Python containers (what checkpoints and run directories hold)."""
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def from_plain(data: dict[str, Any]) -> DictConfig:
    """Rebuild a read-only config from :func:`to_plain`'s output (e.g. from a checkpoint)."""
    cfg = OmegaConf.create(data)
    OmegaConf.set_readonly(cfg, True)
    return cfg
