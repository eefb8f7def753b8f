"""Episode videos: record frames while episodes play, write them as mp4 (or GIF).

:class:`EpisodeRecorder` is an ``on_frame`` hook for :func:`pixelsac.collect.run_episodes`::

    recorder = EpisodeRecorder(size=256, episodes={0})
    run_episodes(env, module.act, 10, on_frame=recorder)
    recorder.save(run_dir / "videos" / "eval_0100000.mp4")   # -> the path actually written

For each chosen episode it renders the scene at ``size`` x ``size`` from the environment's own
camera (or ``camera_id``) once per agent step. With ``agent_view=True`` the frame the policy
actually received -- the newest frame of its stacked observation, at the training resolution --
is shown to the right, enlarged by nearest-neighbour (no smoothing, so its pixels stay visible).

mp4 is written through imageio-ffmpeg, which bundles its own ffmpeg binary. Where that package is
missing (the offline GPU machine), :func:`write_video` falls back to an animated GIF via pillow
and returns the ``.gif`` path it wrote instead.

A video is written as ``.NAME.tmp`` beside its name and renamed into place once complete
(:mod:`pixelsac.files`): a full disk leaves no part of a video, and the OSError names the file.
"""

from __future__ import annotations

import errno
import importlib.util
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pixelsac import files

__all__ = ["EpisodeRecorder", "ffmpeg_available", "upscale_nearest", "write_video"]

DEFAULT_FPS = 25.0


def ffmpeg_available() -> bool:
    """True when imageio-ffmpeg (and so an ffmpeg binary) can be imported."""
    return importlib.util.find_spec("imageio_ffmpeg") is not None


def upscale_nearest(image: np.ndarray, height: int) -> np.ndarray:
    """Enlarge an (H, W, C) image to ``height`` rows by nearest-neighbour, keeping its aspect."""
    source_height, source_width = image.shape[:2]
    width = max(1, round(source_width * height / source_height))
    rows = np.arange(height) * source_height // height
    cols = np.arange(width) * source_width // width
    return image[rows[:, None], cols[None, :]]


def _even(frame: np.ndarray) -> np.ndarray:
    # H.264 in yuv420p needs even sides; with macro_block_size=1 imageio would not fix it for us,
    # so repeat the last row/column instead of failing on an odd video_size.
    pad_rows, pad_cols = frame.shape[0] % 2, frame.shape[1] % 2
    if pad_rows or pad_cols:
        frame = np.pad(frame, ((0, pad_rows), (0, pad_cols), (0, 0)), mode="edge")
    return frame


def write_video(path: str | Path, frames: Iterable[np.ndarray], fps: float = DEFAULT_FPS) -> Path:
    """Write (H, W, 3) uint8 frames as a video; returns the path written.

    A ``.gif`` path, or any path when imageio-ffmpeg is not installed, gives an animated GIF
    (same name, ``.gif`` suffix); otherwise an H.264 mp4 at the frames' own size.
    """
    path = Path(path)
    frames = list(frames)
    if not frames:
        raise ValueError(f"no frames to write to {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".gif" or not ffmpeg_available():
        return _write_gif(path.with_suffix(".gif"), frames, fps)
    tmp = files.temporary_name(path)
    os.close(files.open_new(tmp))  # the name is a new regular file of ours, no link, for ffmpeg to fill
    try:
        _write_mp4(tmp, [_even(np.asarray(frame, dtype=np.uint8)) for frame in frames], fps)
        files.move_into_place(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _write_mp4(path: Path, frames: list[np.ndarray], fps: float) -> None:
    """H.264 in an mp4 container, by the ffmpeg that imageio-ffmpeg bundles, called as imageio's
    writer calls it with ``macro_block_size=1`` (imageio would resize 84x84 frames to 96x96), but
    run here: into a name of our choosing (``-f mp4``: not told by its suffix), in a session of
    its own (Ctrl-C is the run's to handle), its exit status checked and its complaint read -- a
    full disk is an OSError naming ``path``, not lines on the terminal and half a video."""
    import subprocess
    from fractions import Fraction

    import imageio_ffmpeg

    height, width = frames[0].shape[:2]
    command = [
        imageio_ffmpeg.get_ffmpeg_exe(),
        "-y",
        *("-f", "rawvideo", "-vcodec", "rawvideo", "-s", f"{width}x{height}", "-pix_fmt", "rgb24"),
        *("-r", str(Fraction(fps).limit_denominator()), "-i", "-", "-an"),
        *("-vcodec", "libx264", "-pix_fmt", "yuv420p", "-v", "error", "-f", "mp4", str(path)),
    ]
    ffmpeg = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        for frame in frames:
            ffmpeg.stdin.write(np.ascontiguousarray(frame).tobytes())
    except BrokenPipeError:
        pass  # ffmpeg gave up: it says why below
    except BaseException:
        ffmpeg.kill()
        ffmpeg.wait()
        raise
    _, complaint = ffmpeg.communicate()
    if ffmpeg.returncode == 0:
        return
    said = complaint.decode(errors="replace").strip().splitlines()
    if any("No space left on device" in line for line in said) or _disk_is_full(path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    why = said[-1] if said else f"exit status {ffmpeg.returncode}"
    raise OSError(errno.EIO, f"ffmpeg could not write it ({why})", str(path))


def _disk_is_full(path: Path) -> bool:
    try:
        return os.statvfs(path.parent).f_bavail == 0
    except OSError:
        return False


def _write_gif(path: Path, frames: Sequence[np.ndarray], fps: float) -> Path:
    from PIL import Image

    images = [Image.fromarray(np.asarray(frame, dtype=np.uint8)) for frame in frames]
    # GIF stores delays in 10 ms units; pillow rounds the milliseconds it is given.
    with files.replace_atomically(path) as file:
        images[0].save(
            file, format="GIF", save_all=True, append_images=images[1:], duration=max(20, round(1000 / fps)), loop=0
        )
    return path


def _policy_frame(env: Any) -> np.ndarray:
    """The newest frame of the observation the policy was given, (H, W, 3) uint8.

    DMCEnv keeps the frames it stacks into observations in ``_frames`` (oldest first) and has no
    public accessor for the newest one; reading it (rather than rendering again) guarantees the
    video shows exactly the pixels the policy acted on.
    """
    frame = np.asarray(env.last_frame)
    if frame.ndim != 3 or frame.shape[0] != 3:
        raise ValueError("agent_view needs pixel observations (env.obs=pixels)")
    return frame.transpose(1, 2, 0)


class EpisodeRecorder:
    """``on_frame`` hook for :func:`~pixelsac.collect.run_episodes` that records chosen episodes.

    Args:
        size: side of the rendered scene, in pixels (the video height).
        camera_id: camera for the scene; None uses the environment's observation camera.
        agent_view: put the policy's own newest observation frame, enlarged to ``size``, to the
            right of the scene (the video is then twice as wide).
        episodes: indices (as ``run_episodes`` counts them, from 0) of the episodes to record;
            None records every episode.
        fps: playback rate; None plays at simulated real time (one frame per agent step of
            ``action_repeat`` control steps), read from the environment at the first frame.
    """

    def __init__(
        self,
        size: int = 256,
        camera_id: int | None = None,
        agent_view: bool = False,
        episodes: Iterable[int] | None = frozenset({0}),
        fps: float | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"video size must be positive, got {size}")
        self.size = int(size)
        self.camera_id = camera_id
        self.agent_view = agent_view
        self.episodes = None if episodes is None else frozenset(int(e) for e in episodes)
        self.fps = fps
        self.frames: dict[int, list[np.ndarray]] = {}  # episode index -> (H, W, 3) uint8 frames

    def wants(self, episode: int) -> bool:
        """Whether episode ``episode`` is recorded."""
        return self.episodes is None or episode in self.episodes

    def __call__(self, episode: int, env: Any) -> None:
        if not self.wants(episode):
            return
        if self.fps is None:
            self.fps = _real_time_fps(env)
        frame = env.render(self.size, self.camera_id)
        if self.agent_view:
            frame = np.concatenate([frame, upscale_nearest(_policy_frame(env), self.size)], axis=1)
        self.frames.setdefault(episode, []).append(frame)

    def save(self, path: str | Path, episode: int | None = None) -> Path:
        """Write the recorded frames of ``episode`` (None: every recorded episode, one after the
        other) to ``path``; returns the path written (``.gif`` when mp4 is unavailable)."""
        if episode is None:
            frames = [frame for index in sorted(self.frames) for frame in self.frames[index]]
        else:
            frames = self.frames.get(episode, [])
        if not frames:
            which = "any episode" if episode is None else f"episode {episode}"
            raise ValueError(f"nothing recorded for {which}; recorded: {sorted(self.frames) or 'none'}")
        return write_video(path, frames, self.fps or DEFAULT_FPS)

    def clear(self) -> None:
        """Drop the recorded frames (to reuse the recorder for the next evaluation)."""
        self.frames = {}


def _real_time_fps(env: Any) -> float:
    try:
        seconds_per_agent_step = env.dmc_env.control_timestep() * env.action_repeat
    except AttributeError:  # not a DMCEnv (a test double): play at the default rate
        return DEFAULT_FPS
    return 1.0 / seconds_per_agent_step
