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
        raise CheckpointError(f"no checkpoint in {path} (looked for {', '.join(f'{n}.ckpt' for n in order)} "
                              f"in {folder}); pass a .ckpt file or a run directory")
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; pass a .ckpt file or a run directory")
    return path


def load(path: str | Path, map_location: str | torch.device = "cpu", trust: bool = False,
         prefer: str = "best") -> dict[str, Any]:
    """Load and validate a pixelsac checkpoint (``path`` may be a run directory)."""
    file = resolve(path, prefer)
    try:
        checkpoint = torch.load(file, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        if "GLOBAL" not in str(exc) and "global" not in str(exc):  # torch names the refused class
            raise CheckpointError(f"{file} is not a readable checkpoint, or is truncated ({_first_line(exc)})") from exc
        if not trust:
            raise CheckpointError(
                f"{file} holds pickled Python objects, which could run code when loaded; refusing. "
                "Pass trust_checkpoint=true only if you trust where the file came from") from exc
        checkpoint = _load_trusted(file, map_location)
    except Exception as exc:  # truncated zip, not a torch file at all, I/O errors...
        raise CheckpointError(f"{file} is not a readable checkpoint, or is truncated ({_first_line(exc)})") from exc
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

    def finished(self, budget_frames: int) -> bool:
        """Nothing left to do for a budget of ``budget_frames`` env frames."""
        return self.env_frames >= budget_frames and self.final_eval_done

    def describe(self) -> str:
        how = "" if self.stopped_by is None else f", saved on {self.stopped_by}"
        if not self.exact:
            how += ", mid-episode: new episodes start"
        return f"resuming from {self.checkpoint} at env frame {self.env_frames}{how}"


def resume_point(file: Path, checkpoint: dict[str, Any]) -> ResumePoint:
    """What a loaded checkpoint says about resuming from it (frames are totals over ranks)."""
    try:
        saved = checkpoint["callbacks"]["Checkpointer"]
        collected = saved["collector"]
        frames = int(collected["env_frames"])
    except (KeyError, TypeError):
        raise CheckpointError(f"{file} holds no training state to resume from") from None
    world = collected.get("world_size", len(saved["ranks"]) if saved.get("ranks") else None)
    total = frames * int(world or 1)
    last_eval = int(checkpoint["callbacks"].get("Evaluator", {}).get("last_eval_frames", -1))
    return ResumePoint(file, total, None if world is None else int(world),
                       exact=bool(collected.get("at_episode_boundary", True)), final_eval_done=last_eval == total,
                       stopped_by=saved.get("stopped_by"))


def _load_trusted(file: Path, map_location: str | torch.device) -> dict[str, Any]:
    try:
        return torch.load(file, map_location=map_location, weights_only=False)
    except Exception as exc:  # anything: it is not a checkpoint we can use
        raise CheckpointError(f"{file} is not a readable checkpoint ({_first_line(exc)})") from exc


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
        raise CheckpointError(f"{file} has checkpoint format {version}; this pixelsac reads formats "
                              f"{readable} -- use the pixelsac version that wrote it")
    return checkpoint


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def module_from_checkpoint(checkpoint: dict[str, Any]):
    """Rebuild the SACModule a checkpoint was written from (any precision, any device it was
    trained on) with its weights, Kahan target copies and counters."""
    from pixelsac.module import SACModule

    hparams = checkpoint["hyper_parameters"]
    module = SACModule(hparams["config"], tuple(hparams["obs_shape"]), int(hparams["action_dim"]))
    try:
        module.load_state_dict(checkpoint["state_dict"])
    except RuntimeError as exc:
        raise CheckpointError(f"checkpoint weights do not fit the network its config describes ({_first_line(exc)})") from exc
    module.on_load_checkpoint(checkpoint)
    return module.eval()
