"""Finding, safely loading and validating pixelsac checkpoints.

A pixelsac checkpoint is a Lightning checkpoint that holds tensors and plain containers only
(the configuration as a plain dict, counters as numbers), so it loads with
``torch.load(weights_only=True)``: unpickling cannot run code. A file that would need arbitrary
unpickling is refused unless the caller opts in with ``trust=True`` (``trust_checkpoint=true``
at the command line).

A replay file (the replay buffer beside ``last.ckpt``, ``replay-<agent step>.pt``) is tied to its
checkpoint: it records the run's id and the agent step it was written at (:data:`REPLAY_OWNER`),
which the checkpoint records too (the Checkpointer's ``run_id``, its collector's
``agent_steps``). :func:`check_resumable` loads the replay files a checkpoint names --
weights-only always (``trust_checkpoint`` covers the one checkpoint, not its replay), memory
mapped, so the check reads little more than the file's index -- and refuses, in one line and
before anything is written, a file that is incomplete, holds pickled objects, or belongs to
another run or another step. Checkpoints written before runs had an id still resume; their
replay files are checked for all but the owner.

Every file here is written through :mod:`pixelsac.files` (whole or not at all, never through a
link, an error naming the file).
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

from pixelsac import files

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
    blank = blank_file(file)
    if blank is not None:
        raise CheckpointError(
            f"{file} {blank}: its contents are lost (a crash before they reached the disk?); resume from another "
            "checkpoint, or start a new run"
        )
    try:
        checkpoint = torch.load(file, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        if not _refused_a_global(exc):
            raise CheckpointError(f"{file} is not a readable checkpoint, or is truncated ({_reason(exc)})") from exc
        if not trust:
            raise CheckpointError(
                f"{file} holds pickled Python objects, which could run code when loaded; refusing. "
                "Pass trust_checkpoint=true only if you trust where the file came from"
            ) from exc
        checkpoint = _load_trusted(file, map_location)
    except Exception as exc:  # truncated zip, not a torch file at all, I/O errors...
        raise CheckpointError(f"{file} is not a readable checkpoint, or is truncated ({_reason(exc)})") from exc
    return validate(checkpoint, file)


def blank_file(path: Path) -> str | None:
    """What is wrong with a file that lost its contents -- ``"is empty"``, ``"holds only zero
    bytes (N)"`` (a write whose data never reached the disk before a crash) -- or None."""
    size = path.stat().st_size
    if size == 0:
        return "is empty (0 bytes)"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):  # a real checkpoint differs at its first byte ("PK")
            if chunk.count(0) != len(chunk):
                return None
    return f"holds only zero bytes ({size:,} of them)"


def _refused_a_global(exc: BaseException) -> bool:
    """torch's weights-only unpickler refused a class or function (torch names the GLOBAL)."""
    return "GLOBAL" in str(exc) or "global" in str(exc)


def _reason(exc: BaseException) -> str:
    """Why torch could not read a file, in a few words: not its advice about ``weights_only``
    and the legacy format, which is about files pixelsac never writes."""
    text = str(exc)
    if "legacy" in text and "format" in text:
        return "not a torch zip archive"
    return first_line(exc)


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
    # its replay files as loaded and checked (name -> contents, memory mapped): what the run restores;
    # the Checkpointer empties the dict once restored, so no mapping outlives the restore
    replays: dict[str, Any] | None = field(default=None, repr=False, compare=False)

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


def resume_point(file: Path, checkpoint: dict[str, Any], replays: dict[str, Any] | None = None) -> ResumePoint:
    """What a loaded checkpoint says about resuming from it (frames are totals over ranks);
    ``replays``: its replay files as :func:`check_resumable` loaded them."""
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
        replays=replays,
    )


def run_id_of(checkpoint: dict[str, Any]) -> str | None:
    """The id of the run that wrote ``checkpoint`` (None: written before runs had one)."""
    run_id = (callback_state(checkpoint, "Checkpointer") or {}).get("run_id")
    return str(run_id) if run_id else None


def check_resumable(file: Path, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Refuse, in one line, a checkpoint a run cannot continue from, before anything is written;
    return the replay files it names, loaded and checked (name -> contents).

    ``best.ckpt`` is never a resume point: it holds the weights of the best evaluation for
    ``python -m pixelsac.evaluate``, and the replay file it names is deleted when a later
    ``last.ckpt`` is saved. The replay files a checkpoint names must be there and complete
    (every member's CRC), hold tensors only, and be this checkpoint's: its run and agent step
    (:func:`load_replay`).
    """
    if file.name == "best.ckpt":
        raise CheckpointError(
            f"{file} is the best evaluation's checkpoint, for python -m pixelsac.evaluate, not a resume point "
            f"(its replay file goes when a later last.ckpt is saved); resume from {file.with_name('last.ckpt')}"
        )
    saved = callback_state(checkpoint, "Checkpointer") or {}
    run_id = run_id_of(checkpoint)
    per_rank = [saved] if not saved.get("ranks") else [rank or {} for rank in saved["ranks"]]
    loaded: dict[str, Any] = {}
    for rank, state in enumerate(per_rank):
        name = state.get("replay_file")
        if not name or name in loaded:
            continue
        steps = (state.get("collector") or {}).get("agent_steps")
        owner = replay_owner(run_id, steps, rank) if run_id is not None and steps is not None else None
        loaded[name] = load_replay(file.parent / name, file, owner)
    return loaded


#: The key of a replay file's record of what wrote it: {"run_id", "agent_steps", "rank"}.
REPLAY_OWNER = "written_by"


def replay_owner(run_id: str, agent_steps: int, rank: int) -> dict[str, Any]:
    """What a replay file records about its writer, and what a checkpoint expects of it."""
    return {"run_id": str(run_id), "agent_steps": int(agent_steps), "rank": int(rank)}


def load_replay(path: Path, checkpoint_file: Path | str, owner: dict[str, Any] | None) -> dict[str, Any]:
    """The replay file at ``path``, named by ``checkpoint_file``: complete (zip CRCs), tensors and
    plain containers only -- a pickled object is refused whatever ``trust_checkpoint`` says, which
    covers the checkpoint alone -- and written by ``owner`` (:func:`replay_owner`; None: a
    checkpoint from before runs had an id, whose replay cannot say). Memory mapped: loading reads
    the index, and the frames only when the buffer copies them. A CheckpointError otherwise."""
    named = f"replay file {path} (named by {checkpoint_file})"
    check_replay_file(path, checkpoint_file)
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:  # a file torch cannot map (written before torch 2.1 aligned it)
            if "mmap" not in str(exc):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if _refused_a_global(exc):
            raise CheckpointError(
                f"{named} holds pickled Python objects, which could run code when loaded; refusing: a replay file "
                "holds tensors only (trust_checkpoint=true covers the checkpoint, never its replay)"
            ) from None
        raise CheckpointError(f"{named} is not a readable replay file ({_reason(exc)})") from None
    except Exception as exc:  # not a torch file, an unaligned old file...
        raise CheckpointError(f"{named} is not a readable replay file ({_reason(exc)})") from None
    if not isinstance(state, dict) or not isinstance(state.get("buffers"), list):
        raise CheckpointError(f"{named} is not a pixelsac replay file (no replay buffers in it)")
    if owner is None:
        return state
    found = state.get(REPLAY_OWNER)
    if not isinstance(found, dict) or "run_id" not in found:
        raise CheckpointError(
            f"{named} does not say which run wrote it (an older pixelsac's file, or another program's), while the "
            "checkpoint names its run: restore the replay file saved with that checkpoint, or start a new run"
        )
    if str(found["run_id"]) != owner["run_id"]:
        raise CheckpointError(
            f"{named} belongs to another run (run {found['run_id']}; the checkpoint is run {owner['run_id']}): "
            "restore the replay file saved with that checkpoint, or start a new run"
        )
    if int(found.get("agent_steps", -1)) != owner["agent_steps"] or int(found.get("rank", -1)) != owner["rank"]:
        raise CheckpointError(
            f"{named} holds rank {found.get('rank')}'s replay at agent step {found.get('agent_steps')}; the "
            f"checkpoint was saved at agent step {owner['agent_steps']} (rank {owner['rank']}): restore the replay "
            "file saved with it, or start a new run"
        )
    return state


def check_replay_file(path: Path, checkpoint_file: Path | str) -> None:
    """A CheckpointError unless ``path`` is a complete torch file (zip members and their CRCs)."""
    if not path.is_file():
        raise CheckpointError(
            f"{checkpoint_file} names replay file {path}, which is missing; restore it, or start a new run"
        )
    blank = blank_file(path)
    if blank is not None:
        raise CheckpointError(
            f"replay file {path} (named by {checkpoint_file}) {blank}: its contents are lost; restore it, or start a "
            "new run"
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
    filesystems), created anew and never through a link (:func:`pixelsac.files.open_new`), so
    that a failed write is an OSError naming ``path`` (torch's own writer reports a bare
    RuntimeError) and leaves no partial file behind."""
    path = Path(path)
    try:
        with files.naming(path), os.fdopen(files.open_new(path), "wb") as f:
            _torch_save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            path.unlink()
        raise


def save_atomically(obj: Any, path: Path) -> None:
    """``torch.save`` as ``.<name>.tmp`` beside ``path``, fsync, rename over ``path`` and fsync the
    folder (:func:`pixelsac.files.replace_atomically`): readers see the old file or the new one,
    never a part; a failed write leaves no temporary file."""
    with files.replace_atomically(Path(path)) as f:
        _torch_save(obj, f)


def _torch_save(obj: Any, file: Any) -> None:
    sink = _RecordingWriter(file)
    try:
        torch.save(obj, sink)
    except RuntimeError as exc:  # torch's writer hides why a write failed; the sink saw it
        if sink.error is not None:
            raise sink.error from exc
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
