"""The command line: the console scripts, what every entry point shares, and what
``pixelsac-train`` does with its arguments before any heavy library loads.

* The console scripts :func:`train`, :func:`evaluate` and :func:`bench` (``pixelsac-train``,
  ``pixelsac-evaluate``, ``pixelsac-bench``) set up the process the way ``make`` does
  (:func:`pixelsac.allocator.configure`: glibc's malloc keeps large freed buffers) and run the
  entry point's ``main``; ``python -m pixelsac.X`` does the same. The entry points' own modules
  are imported only after the allocator is set. A Ctrl-C while they import is one line and exit
  code 130, as it is once ``main`` runs (:func:`run_command`).
* Exit codes, all defined here (:data:`EXIT_CODES` is the table the README shows): 0 done,
  :data:`EXIT_BAD_INPUT` (2) for anything the user can fix -- an unknown key, a wrong type, a
  value out of range, an unknown task, a missing file, an unusable checkpoint, no OpenGL, a run
  directory in use or not writable -- said in one ``error: ...`` line before anything is written,
  :data:`EXIT_NUMERICAL_FAILURE` (3) for a run stopped by non-finite numbers or whose every
  update was skipped, :data:`EXIT_INCOMPLETE` (4) for a run that ended short of its budget
  without a signal, :data:`EXIT_PROCESS_LOST` (5) for a run whose env worker or other rank
  died, :data:`EXIT_IO_FAULT` (74) for a write that failed while running (disk full,
  read-only filesystem), :data:`EXIT_STOPPED` (75) for a run stopped by a signal with its work
  saved. :func:`run_command` maps the exceptions to them, once for all entry points.
* :func:`resolve_device` (``auto``/``cpu``/``cuda[:N]``), :func:`env_from_config` (the env a
  configuration describes), :func:`check_out_dir` (the "folder not empty" refusal) and
  :func:`quiet_lightning` (Lightning's start-up chatter off).
* ``pixelsac-train``'s arguments: :func:`train_usage` (``--help``: the entry point's text, then
  every group and key of ``conf/config.yaml`` with its default and meaning,
  :mod:`pixelsac.config_keys`); :func:`split_print_config`, the dry run (``--print-config`` or
  ``print_config=true`` prints the composed, validated configuration as YAML and exits 0,
  writing nothing, once the sizes a run checks before it starts pass:
  :func:`pixelsac.run.check_dry_run`); :func:`check_early`, a new run's overrides composed and
  validated before dm_control, torch or Lightning are imported, so a mistyped key or a wrong
  type answers in a second (the task name against the dm_control suite and a checkpoint to
  resume are checked afterwards).

Heavy libraries (torch, dm_control) are imported where they are used, so ``--help`` and a
mistyped key answer at once.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from pixelsac import allocator
from pixelsac.config import ConfigError, check_each_key_once, conf_dir, load_config, parse_overrides
from pixelsac.config_keys import help_text

EXIT_DONE = 0
EXIT_BAD_INPUT = 2
EXIT_NUMERICAL_FAILURE = 3
#: The run ended short of train.env_frames without a stop signal (a limit outside pixelsac's
#: budget ended it); its last checkpoint stands and resume=auto continues it.
EXIT_INCOMPLETE = 4
#: A process the run depends on died while it ran: an environment worker, another data-parallel
#: rank (killed, out of memory). Not bad input: the last checkpoint stands and resume=auto continues.
EXIT_PROCESS_LOST = 5
#: A write failed while running (EX_IOERR): disk full, read-only filesystem, I/O error. The last
#: complete checkpoint stands; no temporary file is left.
EXIT_IO_FAULT = 74
#: A run stopped by a signal, its work saved (or nothing new to save): EX_TEMPFAIL, "try again
#: later" -- run the same command with resume=auto (or resume=RUN_DIR) to continue.
EXIT_STOPPED = 75
#: Ctrl-C before a command's own signal handling began (libraries loading, input being checked):
#: 128 + SIGINT, what the shell reports for a process SIGINT ended. Nothing was written.
EXIT_INTERRUPTED = 130

#: (code, meaning, an example of the line printed) -- the exit codes of every entry point.
EXIT_CODES = (
    (EXIT_DONE, "done: the budget trained and evaluated", "done: 320 env frames, 24 updates, best eval return ..."),
    (
        EXIT_BAD_INPUT,
        "bad input, nothing written: a key, value, task, checkpoint or run directory to fix",
        "error: agent.lr=nan must be a finite number",
    ),
    (
        EXIT_NUMERICAL_FAILURE,
        "stopped by non-finite numbers, or every update was skipped",
        "error: every one of the 24 critic updates was skipped ...",
    ),
    (
        EXIT_INCOMPLETE,
        "ended short of train.env_frames without a signal; resume=auto continues",
        "error: the run ended at env frame 515 of train.env_frames=1500 ...",
    ),
    (
        EXIT_PROCESS_LOST,
        "a process of the run died (an env worker, another data-parallel rank); resume=auto continues",
        "error: env worker 1 (cartpole_swingup, seed 2) died with exit code -9: ... resume=auto continues ...",
    ),
    (
        EXIT_IO_FAULT,
        "a write failed while running (disk full, read-only); the last checkpoint stands",
        "error: no space left on device: R/checkpoints/.last.ckpt.tmp ...",
    ),
    (
        EXIT_STOPPED,
        "stopped by a signal, work saved; the same command with resume=auto continues",
        "stopped by SIGTERM after update 12 at env frame 224: saved R/checkpoints/last.ckpt ...",
    ),
    (
        128,
        "128 + N: a second signal N during the save (third otherwise) exits at once; the previous checkpoint stands. "
        "Ctrl-C while the command starts, before anything is written: 130",
        "pixelsac: SIGINT again: exiting now with code 130 ...",
    ),
)

#: The lock file of a run directory (see pixelsac.rundir).
RUN_DIR_LOCK = ".lock"
#: Files a folder may hold and still count as empty (the run directory's lock file).
IGNORED_IN_EMPTY_DIRS = (RUN_DIR_LOCK,)

#: Lightning's notes about choices pixelsac makes on purpose (a single-process iterable loader,
#: ``training_step(dataloader_iter)``, a run directory that holds our config, ...).
_LIGHTNING_CHATTER = (
    "does not have many workers",
    "IterableDataset",
    "Total length of `DataLoader`",
    "LeafSpec",
    "smaller than the logging interval",
    "dataloader_iter",
    "experimental",
    "exists and is not empty",
    "resuming from a checkpoint that ended",
)


class UsageError(ValueError):
    """A problem with what the user asked for (exit code 2)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with the one line that says what it stopped (exit code :data:`EXIT_INTERRUPTED`)."""


#: What a Ctrl-C before the run's own signal handling stopped.
INTERRUPTED_WHILE_STARTING = (
    "SIGINT while starting (loading libraries, checking the configuration): stopped before anything was written"
)


class RunFault(RuntimeError):
    """A run that cannot go on or cannot claim success, in one line, with its exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def describe_os_error(exc: OSError, then: str = "fix that, then run the command again", where: str = "") -> str:
    """One line for a failed read or write: what failed, on which path (``where`` when the error
    names none: a write to an open file), and ``then``, what to do."""
    import errno as errnos

    first = root_os_error(exc)
    path = first.filename or (f"a file in {where}" if where else "a file this command writes")
    what = {
        errnos.ENOSPC: "no space left on device",
        errnos.EDQUOT: "disk quota exceeded",
        errnos.EROFS: "read-only file system",
        errnos.EACCES: "permission denied",
        errnos.EPERM: "operation not permitted",
        errnos.EIO: "input/output error",
    }.get(first.errno or 0, first.strerror or type(first).__name__)
    return f"{what}: {path}; {then}"


def root_os_error(exc: BaseException) -> OSError:
    """The first OSError in ``exc``'s chain (a failed write raised in cleanup hides the one that
    caused it), preferring one that names a file."""
    chain: list[OSError] = []
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError):
            chain.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    named = [e for e in chain if e.filename]
    return (named or chain)[-1]


def wants_help(argv: Sequence[str]) -> bool:
    return any(a in ("-h", "--help", "help") for a in argv)


def _bad_input_errors() -> tuple[type[BaseException], ...]:
    # Looked up, not imported: a module that never loaded cannot have raised its error, and
    # importing them (torch, dm_control) would make a mistyped key wait seconds for its answer.
    others = (
        ("pixelsac.checkpoint", "CheckpointError"),
        ("pixelsac.envs", "EnvError"),
    )
    found = (getattr(sys.modules.get(module), name, None) for module, name in others)
    return (ConfigError, UsageError, *(error for error in found if error is not None))


def run_command(body: Callable[[list[str]], int], argv: Sequence[str] | None, usage: str | Callable[[], str]) -> int:
    """Run an entry point's ``body(argv)`` and turn what it raises into one line and an exit code:
    ``-h``/``--help`` prints ``usage`` (a text, or a function making it: what that raises is
    answered the same way); bad input exits 2; a numerical failure exits 3; a Ctrl-C that reaches
    here (no handler of the run's caught it) exits 130."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if wants_help(argv):
            print(usage if isinstance(usage, str) else usage())
            return 0
        return body(argv)
    except KeyboardInterrupt as exc:  # Ctrl-C where no handler of ours catches it: no traceback
        print(f"pixelsac: {exc if isinstance(exc, Interrupted) else 'interrupted by SIGINT (Ctrl-C)'}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except _bad_input_errors() as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RunFault as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        print(f"error: {describe_os_error(exc)}", file=sys.stderr)
        return EXIT_IO_FAULT
    except Exception as exc:
        # Looked up, not imported: pixelsac.precision loads torch, which a mistyped key should not
        # wait for, and a run that never imported it cannot have raised its NumericalFailure.
        precision = sys.modules.get("pixelsac.precision")
        if precision is None or not isinstance(exc, precision.NumericalFailure):
            raise
        print(f"error: training stopped: {exc}", file=sys.stderr)
        return EXIT_NUMERICAL_FAILURE


def check_device_name(name: str) -> str:
    """``name`` when it reads as a device (auto, cpu, cuda, cuda:N), else a ConfigError; whether
    the device exists is :func:`resolve_device`'s to say."""
    if name not in ("auto", "cpu") and not name.startswith("cuda"):
        raise ConfigError(f"device={name!r}; choose auto, cpu, cuda or cuda:N")
    return name


def resolve_device(name: str) -> Any:
    """``auto`` -> cuda when available, else cpu; a cuda device that is missing is a ConfigError."""
    import torch

    name = check_device_name(str(name).strip())
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={name} but torch sees no CUDA device; use device=cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"device={name!r} is not a torch device ({exc})") from None
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"device={name}, but torch sees {torch.cuda.device_count()} CUDA device(s)")
    return device


#: the env keys of a configuration that build a :class:`pixelsac.envs.DMCEnv`
ENV_KEYS = ("obs", "image_size", "frame_stack", "action_repeat", "camera_id", "episode_frames")
#: env keys added since checkpoints were first written, with the value older ones mean
OPTIONAL_ENV_KEYS = {"shadow_size": None}


def env_kwargs(config: Any) -> dict[str, Any]:
    """``DMCEnv`` keyword arguments from a configuration's ``env`` group (an OmegaConf config or
    the plain dict a checkpoint stores); a missing key is a ConfigError."""
    env = config["env"]
    try:
        kwargs = {key: env[key] for key in ENV_KEYS}
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"the configuration has no usable env settings (missing {exc})") from None
    return {**kwargs, **{key: env.get(key, default) for key, default in OPTIONAL_ENV_KEYS.items()}}


def env_from_config(config: Any, seed: int) -> Any:
    """The environment a configuration (``task`` and ``env.*``) describes, seeded with ``seed``."""
    from pixelsac.envs import DMCEnv

    return DMCEnv(config["task"], seed=seed, **env_kwargs(config))


def task_shapes(config: Any) -> tuple[tuple[int, ...], int, tuple[int, ...], Any]:
    """Observation shape, action size, frame shape and frame dtype of the configured task (the
    environment built and closed, nothing rendered)."""
    env = env_from_config(config, int(config["seed"]))
    try:
        return tuple(env.obs_shape), env.action_dim, tuple(env.frame_shape), env.frame_dtype
    finally:
        env.close()


def out_dir_is_free(path: Path) -> bool:
    """Nothing there yet, or an empty folder (a lock file alone counts as empty)."""
    return not path.exists() or (path.is_dir() and not any(p.name not in IGNORED_IN_EMPTY_DIRS for p in path.iterdir()))


def check_out_dir(
    path: str | Path, overwrite: bool, what: str = "out_dir", hint: str = "", overwrite_key: str = "overwrite"
) -> Path:
    """``path`` when it may be written: absent, empty, or ``overwrite``; else a UsageError that
    names the ways out (``what=...``, ``overwrite_key=true``, and ``hint``, e.g. ``resume=...``)."""
    path = Path(path)
    if not overwrite and not out_dir_is_free(path):
        ways = f"choose another {what}=..., pass {overwrite_key}=true" + (f", or {hint}" if hint else "")
        raise UsageError(f"{what} {path} already exists and is not empty; {ways}")
    return path


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Lightning's start-up lines (tips, device lines, loader notes) say nothing a pixelsac user
    can act on; pixelsac's own lines say which device and precision run. Warnings that matter
    still show, and the logger levels are restored afterwards."""
    names = ("lightning.pytorch", "lightning.fabric")
    levels = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            for pattern in _LIGHTNING_CHATTER:
                warnings.filterwarnings("ignore", message=f".*{pattern}.*")
            yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


# --- the console scripts -------------------------------------------------------------------------
def train() -> int:
    """``pixelsac-train``."""
    return _run_entry_point("pixelsac.train")


def evaluate() -> int:
    """``pixelsac-evaluate``."""
    return _run_entry_point("pixelsac.evaluate")


def bench() -> int:
    """``pixelsac-bench`` and ``python -m pixelsac.bench``."""
    # The benchmark renders nothing; without this, importing dm_control (for the task's shapes)
    # loads the OpenGL library MUJOCO_GL names, which a GPU box without display libraries lacks.
    os.environ["MUJOCO_GL"] = "disable"
    return _run_entry_point("pixelsac.bench")


def _run_entry_point(module: str) -> int:
    """The allocator set, then ``module.main()``; a Ctrl-C while ``module`` imports is one line."""
    allocator.configure()
    try:
        main = importlib.import_module(module).main
    except KeyboardInterrupt:
        print(f"pixelsac: {INTERRUPTED_WHILE_STARTING}", file=sys.stderr)
        return EXIT_INTERRUPTED
    return main()


# --- pixelsac-train's arguments, before the heavy imports ----------------------------------------
PRINT_FLAG = "--print-config"
PRINT_KEY = "print_config"


def train_usage(text: str) -> str:
    """``text`` (the entry point's docstring) followed by the list of keys."""
    return (
        f"{text.rstrip()}\n\n"
        f"{PRINT_FLAG} (or {PRINT_KEY}=true) prints the composed, validated configuration and exits without "
        "running or writing anything, after the size checks a run makes before it starts.\n\n"
        "Keys (conf/config.yaml; every one with its full meaning: docs/configuration.md):\n\n"
        f"{help_text(conf_dir() / 'config.yaml')}\n"
    )


def split_print_config(argv: Sequence[str]) -> tuple[list[str], bool]:
    """``argv`` without the dry-run request, and whether it was there. ``print_config`` takes true
    or false; anything else is a one-line ConfigError."""
    rest, wanted = [], False
    for arg in argv:
        if arg == PRINT_FLAG:
            wanted = True
        elif arg.partition("=")[0].strip() == PRINT_KEY:
            value = parse_overrides([arg])[PRINT_KEY]
            if not isinstance(value, bool):
                raise ConfigError(f"{PRINT_KEY}={value!r} has the wrong type; it takes true or false")
            wanted = wanted or value
        else:
            rest.append(arg)
    return rest, wanted


def check_early(argv: Sequence[str]) -> None:
    """Compose and validate a new run's configuration from ``argv`` without the task list (which
    needs dm_control); raises :class:`ConfigError` on the first problem. A key given twice is
    refused for every command; a ``resume=`` command is otherwise checked against its checkpoint
    later (its keys and limits differ), so it is left alone here."""
    check_each_key_once(argv)
    if "resume" not in parse_overrides(argv):
        load_config(argv)


def config_yaml(cfg: Any) -> str:
    """The configuration as the YAML a run directory's ``config.yaml`` holds."""
    return OmegaConf.to_yaml(cfg, resolve=True)
