"""Finding, safely loading and validating pixelsac checkpoints.

A pixelsac checkpoint is a Lightning checkpoint that holds tensors and plain containers only
(the configuration as a plain dict, counters as numbers), so it loads with
``torch.load(weights_only=True)``: unpickling cannot run code. A file that would need arbitrary
unpickling is refused unless the caller opts in with ``trust=True`` (``trust_checkpoint=true``
at the command line).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
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
    )


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
