"""DeepMind Control Suite wrapper: pixels or states, action repeat, frame stack, seeding.

One `DMCEnv` is one dm_control task seen the way the PlaNet/DrQ benchmark sees it:

* observations are RGB renders (channels first, uint8) with the last `frame_stack` frames
  stacked on the channel axis, or the flattened state vector;
* every agent action is repeated `action_repeat` times (the per-task PlaNet preset by default),
  rewards summed over the repeats;
* an episode lasts at most `episode_frames` env frames (physics control steps, repeats included),
  and the end of an episode by a time limit is *not* a terminal, so the learner bootstraps
  through it.

Rendering is the whole cost of pixel collection on a CPU (~15-60 ms per frame against ~0.1 ms per
physics step), so the wrapper renders exactly once per agent step, after the last repeat.
"""

from __future__ import annotations

import collections
import difflib
import operator
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

# dm_control picks its OpenGL backend when it is first imported; without a backend it only fails
# at the first render, with a message about a "platform library". EGL is the one that works
# headless with Debian's Mesa packages, so it is the default unless the user chose otherwise.
os.environ.setdefault("MUJOCO_GL", "egl")

__all__ = [
    "PLANET_ACTION_REPEAT",
    "DMCEnv",
    "EnvError",
    "TimeStep",
    "available_tasks",
]

PLANET_ACTION_REPEAT: dict[str, int] = {
    "cartpole_swingup": 8,
    "reacher_easy": 4,
    "cheetah_run": 4,
    "finger_spin": 2,
    "ball_in_cup_catch": 4,
    "walker_walk": 2,
}

OBS_KINDS = ("pixels", "state")

_GL_HELP = (
    "install the Debian packages libegl1 libegl-mesa0 libgl1-mesa-dri and set MUJOCO_GL=egl "
    "(or MUJOCO_GL=osmesa with libosmesa6)"
)


class EnvError(ValueError):
    """A configuration or system problem that stops an environment from being built.

    The message is one line that says what is wrong and what to do; the entry points turn this
    error into exit code 2.
    """


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _gl_error(err: BaseException) -> EnvError:
    backend = os.environ.get("MUJOCO_GL", "")
    return EnvError(f"cannot render with MUJOCO_GL={backend!r} ({type(err).__name__}: {_first_line(err)}); {_GL_HELP}")


_NVIDIA_GPUS = "/proc/driver/nvidia/gpus"  # one entry per GPU the NVIDIA driver sees


def egl_device_for_process(environ: Mapping[str, str], nvidia_gpus: int, cuda_index: int | None = None) -> str | None:
    """The EGL device this process should render on -- the GPU it trains on -- or None to leave
    EGL's choice (the first device that initialises: device 0 on an NVIDIA machine).

    The process trains on CUDA device ``cuda_index`` (torch's numbering: an index into
    ``CUDA_VISIBLE_DEVICES``) when given, else on ``LOCAL_RANK``: a data-parallel rank trains on
    the visible device of its local rank, and a process without ``LOCAL_RANK`` -- one run alone,
    or rank 0, which Lightning's launcher starts before it sets ``LOCAL_RANK`` for the others --
    on the first visible device. EGL lists every GPU the driver sees, whatever
    ``CUDA_VISIBLE_DEVICES`` says, so that index is mapped through that list to the driver's
    numbering (the same as CUDA's with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``): with
    ``CUDA_VISIBLE_DEVICES=3`` a single run renders on EGL device 3, not 0. None when the user
    set ``MUJOCO_EGL_DEVICE_ID``, when rendering is not EGL, when there is no NVIDIA GPU (Mesa's
    software EGL has one device: every process shares it), or when the mapping is unknown (GPUs
    listed by UUID, an index past the list). A run given an explicit device list
    (``trainer.devices=[2,3]``) trains rank r on the r-th entry of that list:
    :func:`listed_cuda_index` finds it from the command line, which the training entry reads
    before dm_control loads.
    """
    if "MUJOCO_EGL_DEVICE_ID" in environ or environ.get("MUJOCO_GL") != "egl" or nvidia_gpus <= 0:
        return None
    if cuda_index is None:
        local_rank = environ.get("LOCAL_RANK", "0").strip() or "0"
        if not local_rank.isdigit():
            return None
        cuda_index = int(local_rank)
    index = cuda_index
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [item.strip() for item in visible.split(",") if item.strip()]
        if index >= len(ids) or not ids[index].isdigit():
            return None
        index = int(ids[index])
    return str(index) if index < nvidia_gpus else None


def _nvidia_gpu_count() -> int:
    try:
        return len(os.listdir(_NVIDIA_GPUS))
    except OSError:
        return 0


def listed_cuda_index(devices: Any, environ: Mapping[str, str]) -> int | None:
    """The CUDA device (torch's index) this process trains on when Lightning's ``trainer.devices``
    lists the devices -- ``[2, 3]``, ``"2,3"`` or ``"1,"``: local rank r on the r-th entry --
    else None (a count, ``-1`` or ``auto``: rank r on device r, which ``LOCAL_RANK`` says)."""
    if isinstance(devices, str) and "," in devices:
        entries = [item.strip() for item in devices.split(",") if item.strip()]
        if not all(item.isdigit() for item in entries):
            return None
        devices = [int(item) for item in entries]
    if not isinstance(devices, (list, tuple)) or not devices:
        return None
    local_rank = environ.get("LOCAL_RANK", "0").strip() or "0"
    if not local_rank.isdigit() or int(local_rank) >= len(devices):
        return None
    entry = devices[int(local_rank)]
    if isinstance(entry, bool) or not isinstance(entry, int) or entry < 0:
        return None
    return entry


def select_egl_device(cuda_index: int | None = None) -> str | None:
    """Set ``MUJOCO_EGL_DEVICE_ID`` for this process (see :func:`egl_device_for_process`;
    ``cuda_index``: the CUDA device it trains on, when known); must run before dm_control or
    mujoco are imported (dm_control opens its EGL display at import). Returns what it set."""
    device = egl_device_for_process(os.environ, _nvidia_gpu_count(), cuda_index)
    if device is not None:
        os.environ["MUJOCO_EGL_DEVICE_ID"] = device
    return device


def gl_renderer(physics: Any) -> str | None:
    """The OpenGL renderer string of ``physics``'s rendering context (e.g. an NVIDIA GPU's name,
    or ``llvmpipe`` for Mesa's software rasteriser), or None where it cannot be read."""
    try:
        from OpenGL import GL

        with physics.contexts.gl.make_current() as context:
            value = context.call(GL.glGetString, GL.GL_RENDERER)
    except Exception:  # a diagnostic line must never stop a run
        return None
    if value is None:
        return None
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


_RENDERER_SAID = "PIXELSAC_GL_RENDERER_SAID"  # set once said: spawned env workers stay quiet


def _say_renderer(physics: Any) -> None:
    """One line per process tree on stderr: which GL backend, EGL device and renderer draw."""
    if os.environ.get(_RENDERER_SAID):
        return
    os.environ[_RENDERER_SAID] = "1"
    backend = os.environ.get("MUJOCO_GL", "")
    device = os.environ.get("MUJOCO_EGL_DEVICE_ID")
    where = f", EGL device {device}" if backend == "egl" and device is not None else ""
    rank = os.environ.get("LOCAL_RANK")
    print(
        f"render: MUJOCO_GL={backend}{where}{f' (local rank {rank})' if rank else ''}, "
        f"GL renderer {gl_renderer(physics)!r}",
        file=sys.stderr,
        flush=True,
    )


_SUITE: Any = None


def _suite() -> Any:
    """Import `dm_control.suite` on first use.

    The import is deferred because dm_control loads its OpenGL backend at import time, and a
    missing library must surface as an `EnvError` (exit code 2) rather than a raw traceback at
    `import pixelsac.envs`.
    """
    global _SUITE
    if _SUITE is None:
        select_egl_device()
        try:
            from dm_control import suite
        except Exception as err:  # the backend failures are AttributeError, RuntimeError, ...
            raise _gl_error(err) from err
        # MuJoCo 3.x warns through absl on every load of models that use `settotalmass`
        # (cartpole, ...): a note to dm_control's maintainers, not something our users can act on.
        import absl.logging

        absl.logging.set_verbosity(absl.logging.ERROR)
        _SUITE = suite
    return _SUITE


def _task_table() -> dict[str, tuple[str, str]]:
    # Domains and tasks both contain underscores (ball_in_cup_catch, point_mass_easy,
    # acrobot_swingup_sparse), so a name can only be split by looking it up.
    return {f"{domain}_{task}": (domain, task) for domain, task in _suite().ALL_TASKS}


def available_tasks() -> list[str]:
    """Every dm_control suite task as ``domain_task``, in `suite.ALL_TASKS` order."""
    return list(_task_table())


def _resolve_task(name: str) -> tuple[str, str]:
    table = _task_table()
    if name in table:
        return table[name]
    close = difflib.get_close_matches(str(name), table, n=3, cutoff=0.6)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    examples = ", ".join(PLANET_ACTION_REPEAT)
    raise EnvError(
        f"unknown task {name!r}; {hint}see available_tasks() for all {len(table)} tasks (benchmark tasks: {examples})"
    )


def _positive_int(name: str, value: Any) -> int:
    try:
        as_int = operator.index(value)
    except TypeError:
        raise EnvError(f"{name} must be a positive integer, got {value!r}") from None
    if isinstance(value, bool) or as_int <= 0:
        raise EnvError(f"{name} must be a positive integer, got {value!r}")
    return as_int


@dataclass(frozen=True, eq=False)
class TimeStep:
    """What the agent sees after `reset()` or one agent step.

    `eq=False` because the fields are arrays: field-wise `==` would be ambiguous.
    """

    obs: np.ndarray
    """The observation the policy sees: (3*frame_stack, H, W) uint8 or (D,) float32."""
    frame: np.ndarray
    """The newest single frame, what the replay buffer stores: (3, H, W) uint8 or (D,) float32."""
    reward: float
    """Reward summed over the action repeat (0.0 at reset)."""
    terminal: bool
    """The task itself ended the episode (dm_control discount 0): do not bootstrap."""
    last: bool
    """The episode is over, by termination or by a time limit; call `reset()` next."""
    first: bool
    """This step came from `reset()`."""


class DMCEnv:
    """One dm_control suite task with pixel or state observations.

    Args:
        task: ``domain_task`` name, e.g. ``"cheetah_run"`` (see `available_tasks()`).
        obs: ``"pixels"`` (RGB renders, stacked) or ``"state"`` (flat float32 vector).
        image_size: side of the square renders, in pixels.
        frame_stack: number of frames stacked into one pixel observation. State observations are
            never stacked: for ``obs="state"`` this argument is ignored and `frame_stack` is 1.
        action_repeat: env frames per agent step; None picks the PlaNet preset for the six
            benchmark tasks and 1 for every other task.
        camera_id: camera to render; None picks 2 for quadruped and 0 elsewhere, as DrQ does.
        seed: seed of the task's random state (initial positions, targets).
        episode_frames: time limit in env frames (physics control steps, repeats included),
            applied on top of dm_control's own time limit.

    Actions in [-1, 1]^A map linearly onto the task's action bounds (clipped). The lqr tasks
    declare bounds of +-1e10, so there the map is literal and rarely useful.

    Raises:
        EnvError: unknown task, bad observation kind, non-positive sizes, a camera or image size
            the model cannot render, or no working OpenGL backend.
    """

    def __init__(
        self,
        task: str,
        obs: str = "pixels",
        image_size: int = 84,
        frame_stack: int = 3,
        action_repeat: int | None = None,
        camera_id: int | None = None,
        seed: int = 0,
        episode_frames: int = 1000,
        shadow_size: int | None = None,
    ) -> None:
        domain, task_name = _resolve_task(task)
        if obs not in OBS_KINDS:
            raise EnvError(f"obs must be one of {', '.join(OBS_KINDS)}; got {obs!r}")
        self._image_size = _positive_int("image_size", image_size)
        stack = _positive_int("frame_stack", frame_stack)
        self._frame_stack = stack if obs == "pixels" else 1
        if action_repeat is None:
            action_repeat = PLANET_ACTION_REPEAT.get(task, 1)
        self._action_repeat = _positive_int("action_repeat", action_repeat)
        self._episode_frames = _positive_int("episode_frames", episode_frames)

        self._task = task
        self._obs_kind = obs
        self._seed = seed
        self._env = _suite().load(domain, task_name, task_kwargs={"random": seed})
        if shadow_size is not None:  # read when the render context is made, at the first render
            if isinstance(shadow_size, bool) or not isinstance(shadow_size, int) or shadow_size < 0:
                self.close()
                raise EnvError(f"shadow_size must be an integer >= 0 (0: no shadows); got {shadow_size!r}")
            self._env.physics.model.vis.quality.shadowsize = shadow_size
        if camera_id is None:
            camera_id = 2 if domain == "quadruped" else 0
        try:
            self._camera_id = self._check_camera(camera_id)
            if obs == "pixels":
                self._check_render_size(self._image_size)
        except EnvError:
            self.close()
            raise

        spec = self._env.action_spec()
        self._action_low = np.asarray(spec.minimum, dtype=np.float64)
        self._action_high = np.asarray(spec.maximum, dtype=np.float64)
        self._action_dim = int(np.prod(spec.shape))

        # The spec's key order is fixed by the task, so the flat state layout is deterministic.
        obs_spec = self._env.observation_spec()
        self._state_keys = list(obs_spec)
        self._state_dim = int(sum(int(np.prod(obs_spec[key].shape)) for key in self._state_keys))

        self._frames: collections.deque[np.ndarray] = collections.deque(maxlen=self._frame_stack)
        self._frames_this_episode = 0
        self._needs_reset = True
        # Until one render has succeeded, a render failure means the OpenGL setup is broken.
        self._rendering_ok = False

    # ------------------------------------------------------------------ properties
    @property
    def task(self) -> str:
        """The ``domain_task`` name."""
        return self._task

    @property
    def obs_kind(self) -> str:
        """``"pixels"`` or ``"state"``."""
        return self._obs_kind

    @property
    def seed(self) -> int:
        """The seed the task's random state started from."""
        return self._seed

    @property
    def image_size(self) -> int:
        """Side of the square renders (unused for state observations)."""
        return self._image_size

    @property
    def camera_id(self) -> int:
        """The camera pixel observations are rendered from."""
        return self._camera_id

    @property
    def frame_stack(self) -> int:
        """Frames per observation (always 1 for states)."""
        return self._frame_stack

    @property
    def action_repeat(self) -> int:
        """Env frames per agent step."""
        return self._action_repeat

    @property
    def episode_frames(self) -> int:
        """The wrapper's time limit in env frames."""
        return self._episode_frames

    @property
    def frame_shape(self) -> tuple[int, ...]:
        """Shape of one frame: (3, H, W) for pixels, (D,) for states."""
        if self._obs_kind == "pixels":
            return (3, self._image_size, self._image_size)
        return (self._state_dim,)

    @property
    def frame_dtype(self) -> np.dtype:
        """uint8 for pixels, float32 for states."""
        return np.dtype(np.uint8 if self._obs_kind == "pixels" else np.float32)

    @property
    def obs_shape(self) -> tuple[int, ...]:
        """Shape of a policy observation: (3*frame_stack, H, W) or (D,)."""
        channels, *rest = self.frame_shape
        return (channels * self._frame_stack, *rest)

    @property
    def action_dim(self) -> int:
        """Number of action components; actions live in [-1, 1]^action_dim."""
        return self._action_dim

    @property
    def last_frame(self) -> np.ndarray:
        """The newest frame of the current observation: what the policy saw last (for videos)."""
        if not self._frames:
            raise RuntimeError("no observation yet: call reset() first")
        return self._frames[-1]

    @property
    def dmc_env(self) -> Any:
        """The wrapped `dm_control.rl.control.Environment` (for inspection and tests)."""
        return self._live_env()

    @property
    def physics(self) -> Any:
        """The MuJoCo physics of the wrapped environment."""
        return self._live_env().physics

    # ------------------------------------------------------------------ episode
    def reset(self) -> TimeStep:
        """Start a new episode; the first frame is repeated to fill the frame stack."""
        dm_step = self._live_env().reset()
        self._frames_this_episode = 0
        self._needs_reset = False
        frame = self._observe(dm_step.observation)
        for _ in range(self._frame_stack):
            self._frames.append(frame)
        return TimeStep(
            obs=self._stacked_obs(frame),
            frame=frame,
            reward=0.0,
            terminal=False,
            last=False,
            first=True,
        )

    def step(self, action: np.ndarray) -> TimeStep:
        """Apply `action` (in [-1, 1]^A, clipped) for `action_repeat` env frames.

        The repeat stops early when the episode ends inside it. Rewards are summed.

        Raises:
            ValueError: wrong action shape or non-finite action.
            RuntimeError: stepping before `reset()` or after the episode ended.
        """
        env = self._live_env()
        if self._needs_reset:
            raise RuntimeError("step() needs a running episode: call reset() first")
        unit_action = np.asarray(action, dtype=np.float64).reshape(-1)
        if unit_action.shape != (self._action_dim,):
            raise ValueError(f"{self._task} takes {self._action_dim} action components, got shape {np.shape(action)}")
        if not np.all(np.isfinite(unit_action)):
            raise ValueError(f"action must be finite, got {unit_action}")
        scaled = self._action_low + (unit_action + 1.0) * 0.5 * (self._action_high - self._action_low)
        # The map is monotonic, so clipping to the bounds here equals clipping to [-1, 1]
        # before it, and it also catches rounding a hair outside the spec.
        scaled = np.clip(scaled, self._action_low, self._action_high)

        reward = 0.0
        terminal = False
        last = False
        for _ in range(self._action_repeat):
            dm_step = env.step(scaled)
            self._frames_this_episode += 1
            reward += float(dm_step.reward or 0.0)
            if dm_step.last():
                # dm_control ends by its own time limit with discount 1; a task that
                # terminates reports discount 0.
                terminal = float(dm_step.discount) == 0.0
                last = True
                break
            if self._frames_this_episode >= self._episode_frames:
                last = True
                break

        self._needs_reset = last
        frame = self._observe(dm_step.observation)
        self._frames.append(frame)
        return TimeStep(
            obs=self._stacked_obs(frame),
            frame=frame,
            reward=reward,
            terminal=terminal,
            last=last,
            first=False,
        )

    # ------------------------------------------------------------------ rendering
    def render(self, size: int, camera_id: int | None = None) -> np.ndarray:
        """Render the current state at size×size, for videos: (H, W, 3) uint8.

        `camera_id` None uses the observation camera.
        """
        self._live_env()
        size = _positive_int("size", size)
        self._check_render_size(size)
        camera = self._camera_id if camera_id is None else self._check_camera(camera_id)
        return self._render_hwc(size, camera)

    def close(self) -> None:
        """Free the physics and its rendering contexts; the env is unusable afterwards.

        Freeing explicitly avoids the traceback OSMesa prints when contexts die at exit.
        """
        if self._env is not None:
            self._env.physics.free()
            self._env = None

    def __enter__(self) -> DMCEnv:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ seeding
    def get_rng_state(self) -> dict:
        """The task's random state as plain Python containers (str, int, float, list).

        Together with `set_rng_state` this makes the *next* episodes repeat exactly after a
        resume; the physics state of an episode in progress is not part of it.
        """
        state = self._live_env().task.random.get_state(legacy=False)
        return {
            "bit_generator": str(state["bit_generator"]),
            "key": [int(word) for word in state["state"]["key"]],
            "pos": int(state["state"]["pos"]),
            "has_gauss": int(state["has_gauss"]),
            "gauss": float(state["gauss"]),
        }

    def set_rng_state(self, state: dict) -> None:
        """Restore a state returned by `get_rng_state`."""
        try:
            numpy_state = {
                "bit_generator": state["bit_generator"],
                "state": {"key": np.asarray(state["key"], dtype=np.uint32), "pos": state["pos"]},
                "has_gauss": state["has_gauss"],
                "gauss": state["gauss"],
            }
        except (KeyError, TypeError) as err:
            raise ValueError(f"not an env RNG state from get_rng_state(): missing {err}") from None
        self._live_env().task.random.set_state(numpy_state)

    # ------------------------------------------------------------------ internals
    def _live_env(self) -> Any:
        if self._env is None:
            raise RuntimeError(f"DMCEnv({self._task!r}) was closed")
        return self._env

    def _check_camera(self, camera_id: int) -> int:
        camera_count = int(self._env.physics.model.ncam)
        try:
            camera_id = operator.index(camera_id)
        except TypeError:
            raise EnvError(f"camera_id must be an integer, got {camera_id!r}") from None
        # -1 is MuJoCo's free camera.
        if not -1 <= camera_id < camera_count:
            raise EnvError(f"camera_id {camera_id} does not exist for {self._task}: choose -1..{camera_count - 1}")
        return int(camera_id)

    def _check_render_size(self, size: int) -> None:
        visual = self._env.physics.model.vis.global_
        limit = min(int(visual.offwidth), int(visual.offheight))
        if size > limit:
            raise EnvError(
                f"render size {size} exceeds the offscreen buffer of {self._task} "
                f"({visual.offwidth}x{visual.offheight}); use at most {limit}"
            )

    def _render_hwc(self, size: int, camera_id: int) -> np.ndarray:
        physics = self._live_env().physics
        if self._rendering_ok:
            return physics.render(height=size, width=size, camera_id=camera_id)
        try:
            image = physics.render(height=size, width=size, camera_id=camera_id)
        except ValueError:
            raise  # bad arguments, not a broken OpenGL setup
        except Exception as err:  # mujoco.FatalError, RuntimeError, ImportError, ...
            raise _gl_error(err) from err
        self._rendering_ok = True
        _say_renderer(physics)
        return image

    def _observe(self, observation: dict) -> np.ndarray:
        if self._obs_kind == "state":
            return np.concatenate([np.asarray(observation[key], dtype=np.float32).ravel() for key in self._state_keys])
        image = self._render_hwc(self._image_size, self._camera_id)
        return np.ascontiguousarray(image.transpose(2, 0, 1))

    def _stacked_obs(self, newest_frame: np.ndarray) -> np.ndarray:
        if self._frame_stack == 1:
            return newest_frame
        # Oldest frame first on the channel axis, as the replay buffer rebuilds it.
        return np.concatenate(self._frames, axis=0)
