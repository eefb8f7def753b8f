"""Finding, safely loading and validating pixelsac checkpoints.

A pixelsac checkpoint is a Lightning checkpoint that holds tensors and plain containers only
(the configuration as a plain dict, counters as numbers), so it loads with
``torch.load(weights_only=True)``: unpickling cannot run code. A file that would need arbitrary
unpickling is refused unless the caller opts in with ``trust=True`` (``trust_checkpoint=true``
at the command line).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

#: Bumped when the checkpoint layout changes incompatibly.
FORMAT_VERSION = 1


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
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{file} has checkpoint format {version}; this pixelsac reads format "
                              f"{FORMAT_VERSION} -- use the pixelsac version that wrote it")
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
