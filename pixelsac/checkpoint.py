"""Finding, safely loading and validating pixelsac checkpoints.

A pixelsac checkpoint is a Lightning checkpoint that holds tensors and plain containers only
(the configuration as a plain dict, counters as numbers), so it loads with
``torch.load(weights_only=True)``: unpickling cannot run code. A file that would need arbitrary
unpickling is refused unless the caller opts in with ``trust=True`` (``trust_checkpoint=true``
at the command line).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

#: Bumped when the checkpoint layout changes. 2: the target critic may be derived
#: (``lowp.derived_target``: no ``critic_target.*`` keys, ``target_updater.updates_applied``).
FORMAT_VERSION = 2
#: Formats this version still reads (SACModule converts a stored target to a derived one and back).
READABLE_FORMATS = (1, 2)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, described in one line (exit code 2 at the command line)."""


def resolve(path: str | Path, prefer: str = "best") -> Path:
    """A checkpoint file from a file path or a run directory (its ``checkpoints/<prefer>.ckpt``,
    falling back to the other of best/last)."""
    path = Path(path)
    if path.is_dir():
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        order = [prefer, "last" if prefer == "best" else "best"]
        for name in order:
            if (folder / f"{name}.ckpt").is_file():
                return folder / f"{name}.ckpt"
        raise CheckpointError(
            f"no checkpoint in {path} (looked for {', '.join(f'{n}.ckpt' for n in order)} "
            f"in {folder}); pass a .ckpt file or a run directory"
        )
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; pass a .ckpt file or a run directory")
    return path


def load(
    path: str | Path, map_location: str | torch.device = "cpu", trust: bool = False, prefer: str = "best"
) -> dict[str, Any]:
    """Load and validate a pixelsac checkpoint (``path`` may be a run directory)."""
    file = resolve(path, prefer)
    try:
        checkpoint = torch.load(file, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        if "GLOBAL" not in str(exc) and "global" not in str(exc):  # torch names the refused class
            raise CheckpointError(f"{file} is not a readable checkpoint, or is truncated ({first_line(exc)})") from exc
        if not trust:
            raise CheckpointError(
                f"{file} holds pickled Python objects, which could run code when loaded; refusing. "
                "Pass trust_checkpoint=true only if you trust where the file came from"
            ) from exc
        checkpoint = _load_trusted(file, map_location)
    except Exception as exc:  # truncated zip, not a torch file at all, I/O errors...
        raise CheckpointError(f"{file} is not a readable checkpoint, or is truncated ({first_line(exc)})") from exc
    return validate(checkpoint, file)


def in_run_dir(run_dir: Path) -> Path | None:
    """``run_dir``'s checkpoint to resume from (``checkpoints/last.ckpt``, else ``best.ckpt``), or
    None: nothing to resume (``resume=auto`` then starts a fresh run)."""
    for name in ("last.ckpt", "best.ckpt"):
        if (run_dir / "checkpoints" / name).is_file():
            return run_dir / "checkpoints" / name
    return None


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run starts, read from its checkpoint before anything is built."""

    checkpoint: Path
    env_frames: int  # collected by all ranks together (what logs count)
    world_size: int | None  # data-parallel ranks that wrote it (None: written before this was recorded)
    exact: bool  # taken at an episode boundary: the continuation is the uninterrupted run's
    final_eval_done: bool  # the evaluation at its last frame ran (the end of a run evaluates once more)
    stopped_by: str | None  # the signal whose stop wrote it
    pending_eval_frames: int | None = None  # an evaluation in flight when it was written (eval_in_worker)
    # the checkpoint as loaded and checked: the resumed run restores from this dict, never from
    # the file again (a file swapped after the check is never read)
    loaded: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    identity: tuple[int, ...] | None = None  # file_identity() of the file when it was loaded

    def unchanged(self) -> bool:
        """The checkpoint file is still the one loaded (checked again once the run directory is
        locked: a process that wrote the directory meanwhile replaced it)."""
        return self.identity is None or file_identity(self.checkpoint) == self.identity

    def finished(self, budget_frames: int) -> bool:
        """Nothing left to do for a budget of ``budget_frames`` env frames."""
        return self.env_frames >= budget_frames and self.final_eval_done

    def describe(self) -> str:
        how = "" if self.stopped_by is None else f", saved on {self.stopped_by}"
        if not self.exact:
            how += ", mid-episode: new episodes start"
        return f"resuming from {self.checkpoint} at env frame {self.env_frames}{how}"


def callback_state(checkpoint: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The state a Lightning callback of class ``name`` saved (its key is the class name, or the
    name followed by ``{...}`` for a callback that makes its state key from its arguments)."""
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if (key == name or str(key).startswith(name + "{")) and isinstance(state, dict):
            return state
    return None


def saved_counters(checkpoint: dict[str, Any]) -> dict[str, int | None]:
    """Where a checkpoint was written: ``env_frames`` over all data-parallel ranks (what logs
    count), ``world_size`` (None: written before it was recorded) and ``updates``; None where the
    checkpoint does not record a figure."""
    saved = callback_state(checkpoint, "Checkpointer") or {}
    collected = saved.get("collector") or {}
    world = collected.get("world_size", len(saved["ranks"]) if saved.get("ranks") else None)
    frames = collected.get("env_frames")
    updates = (checkpoint.get("pixelsac") or {}).get("updates")
    return {
        "env_frames": None if frames is None else int(frames) * int(world or 1),
        "world_size": None if world is None else int(world),
        "updates": None if updates is None else int(updates),
    }


def file_identity(path: Path) -> tuple[int, ...] | None:
    """(device, inode, size, mtime): which file ``path`` names now (checkpoints are replaced by a
    rename, so a new one has a new inode); None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def resume_point(file: Path, checkpoint: dict[str, Any]) -> ResumePoint:
    """What a loaded checkpoint says about resuming from it (frames are totals over ranks)."""
    saved = callback_state(checkpoint, "Checkpointer")
    counters = saved_counters(checkpoint)
    if saved is None or counters["env_frames"] is None:
        raise CheckpointError(f"{file} holds no training state to resume from")
    total = counters["env_frames"]
    evaluator = callback_state(checkpoint, "Evaluator") or {}
    last_eval = int(evaluator.get("last_eval_frames", -1))
    pending = evaluator.get("pending")
    return ResumePoint(
        file,
        total,
        counters["world_size"],
        exact=bool(saved["collector"].get("at_episode_boundary", True)),
        final_eval_done=last_eval == total,
        stopped_by=saved.get("stopped_by"),
        pending_eval_frames=int(pending["frames"]) if pending else None,
        loaded=checkpoint,
        identity=file_identity(file),
    )


def check_resumable(file: Path, checkpoint: dict[str, Any]) -> None:
    """Refuse, in one line, a checkpoint a run cannot continue from, before anything is written.

    ``best.ckpt`` is never a resume point: it holds the weights of the best evaluation for
    ``python -m pixelsac.evaluate``, and the replay file it names is deleted when a later
    ``last.ckpt`` is saved. The replay files a checkpoint names must be there and readable
    (every member's CRC is checked: a truncated or corrupted file is refused here, not after the
    logs were trimmed).
    """
    if file.name == "best.ckpt":
        raise CheckpointError(
            f"{file} is the best evaluation's checkpoint, for python -m pixelsac.evaluate, not a resume point "
            f"(its replay file goes when a later last.ckpt is saved); resume from {file.with_name('last.ckpt')}"
        )
    saved = callback_state(checkpoint, "Checkpointer") or {}
    names = [saved.get("replay_file")] + [rank.get("replay_file") for rank in saved.get("ranks") or [] if rank]
    for name in dict.fromkeys(n for n in names if n):
        check_replay_file(file.parent / name, file)


def check_replay_file(path: Path, checkpoint_file: Path | str) -> None:
    """A CheckpointError unless ``path`` is a complete torch file (zip members and their CRCs)."""
    if not path.is_file():
        raise CheckpointError(
            f"{checkpoint_file} names replay file {path}, which is missing; restore it, or start a new run"
        )
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        raise CheckpointError(
            f"replay file {path} (named by {checkpoint_file}) is truncated or corrupt ({first_line(exc)})"
        ) from None
    if bad is not None:
        raise CheckpointError(
            f"replay file {path} (named by {checkpoint_file}) is corrupt (member {bad} fails its CRC check)"
        )


def write_file(obj: Any, path: Path) -> None:
    """``torch.save`` into ``path`` itself (no temporary folder elsewhere, no copy across
    filesystems) through a Python file, so that a failed write is an OSError naming ``path``
    (torch's own writer reports a bare RuntimeError) and leaves no partial file behind."""
    path = Path(path)
    try:
        with open(path, "wb") as f:
            sink = _RecordingWriter(f)
            try:
                torch.save(obj, sink)
            except RuntimeError as exc:  # torch's writer hides why a write failed; the sink saw it
                if sink.error is not None:
                    raise sink.error from exc
                raise
            f.flush()
            os.fsync(f.fileno())
    except BaseException as exc:
        with contextlib.suppress(OSError):
            path.unlink()
        if isinstance(exc, OSError) and not exc.filename:
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise


class _RecordingWriter:
    """A binary file for ``torch.save`` that keeps the OSError of a failed write."""

    def __init__(self, file: Any) -> None:
        self.file, self.error = file, None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.file.flush()


def save_atomically(obj: Any, path: Path) -> None:
    """Write ``obj`` as ``.<name>.tmp`` beside ``path``, fsync, rename over ``path`` and fsync the
    folder: readers see the old file or the new one, never a part; a failed write leaves no
    temporary file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    write_file(obj, tmp)
    try:
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _load_trusted(file: Path, map_location: str | torch.device) -> dict[str, Any]:
    try:
        return torch.load(file, map_location=map_location, weights_only=False)
    except Exception as exc:  # anything: it is not a checkpoint we can use
        raise CheckpointError(f"{file} is not a readable checkpoint ({first_line(exc)})") from exc


def validate(checkpoint: Any, file: Path | str = "checkpoint") -> dict[str, Any]:
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(f"{file} is not a Lightning checkpoint (no state_dict)")
    ours = checkpoint.get("pixelsac")
    hparams = checkpoint.get("hyper_parameters", {})
    if not isinstance(ours, dict) or not {"config", "obs_shape", "action_dim"} <= set(hparams):
        raise CheckpointError(f"{file} is a Lightning checkpoint but not one written by pixelsac")
    version = ours.get("format", 1)
    if version not in READABLE_FORMATS:
        readable = " and ".join(map(str, READABLE_FORMATS))
        raise CheckpointError(
            f"{file} has checkpoint format {version}; this pixelsac reads formats "
            f"{readable} -- use the pixelsac version that wrote it"
        )
    return checkpoint


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (or its type), at most 200 characters."""
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__
