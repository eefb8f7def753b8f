"""Replay buffer that stores every frame once and rebuilds frame stacks at sample time.

Layout: one ring of `capacity` slots. Slot i holds

    frame_i     the frame observed after the agent step (uint8 image or float32 state vector)
    action_i    the action that led to frame_i                      (float32, A)
    reward_i    the reward of that step                             (float32)
    terminal_i  the task terminated at that step (no bootstrap)     (bool)
    first_i     frame_i is an episode's first frame                 (bool)

A transition is (slot i-1 -> slot i) for any slot i that is not first: action, reward and
terminal come from slot i. The first slot of an episode carries only its frame.

At 84x84x3 with 6-D actions a slot costs 21,168 + 24 + 4 + 1 + 1 = 21,198 bytes, against 127,044
for DrQ's layout that stores obs and next_obs already stacked.

Frame stacks are rebuilt from the single frames: the stack of obs ends at frame i-1, the stack of
next_obs at frame i, and neither reaches across the episode's first frame, which is repeated in
place of earlier frames exactly like the environment does at reset. Stacks are ordered oldest
frame first on the channel axis.

Placement. By default (`device=None`) frames, actions, rewards and terminals are numpy arrays in
host memory and `sample()` returns host tensors, page-locked with `pin_memory=True` so that the
training step's `.to(device, non_blocking=True)` is a real asynchronous copy. With `device` given
(e.g. "cuda:0") those four arrays are torch tensors on that device and `sample()` gathers the
batch there, so no frame crosses the bus per batch. In every placement the episode-start flags
and counters stay in host numpy: indices are drawn and stacks chained on the host with the same
numpy RNG calls, so a device buffer samples exactly the transitions the host buffer would, and
only the B x (k+1) slot numbers travel to the device.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pixelsac.config import ConfigError

__all__ = ["ReplayBuffer", "ReplaySet"]

_FORMAT_VERSION = 1

# Rejection sampling draws again for the indices that landed on episode-start slots. Those are a
# small fraction in practice; after this many rounds the remaining draws come from the explicit
# list of valid slots instead, so a buffer of mostly one-frame episodes cannot loop for long.
_REJECTION_ROUNDS = 8


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or int(value) != value or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _torch_dtype(dtype: Any) -> torch.dtype:
    """The torch dtype that `torch.from_numpy` gives an array of numpy `dtype`."""
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def _nbytes(array: np.ndarray | torch.Tensor) -> int:
    if isinstance(array, torch.Tensor):
        return array.numel() * array.element_size()
    return int(array.nbytes)


def _resolve_placement(device: torch.device | str | None, pin_memory: bool) -> tuple[torch.device | None, bool]:
    """Checked (device, pin_memory); a bare "cuda" becomes the current CUDA device, so that
    describe() names the GPU the ring really lives on."""
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if pin_memory:
            raise ValueError(
                f"pin_memory applies to host storage (device=None); with device={device} "
                "batches are already sampled on the device"
            )
    if pin_memory and not torch.cuda.is_available():
        raise ValueError(
            "pin_memory=True needs CUDA: page-locked host memory only serves asynchronous "
            "host->GPU copies, and this torch sees no CUDA device; use pin_memory=False"
        )
    return device, bool(pin_memory)


def _checked_frame_shape(frame_shape: tuple[int, ...]) -> tuple[int, ...]:
    shape = tuple(int(size) for size in frame_shape)
    if not shape or any(size <= 0 for size in shape):
        raise ValueError(f"frame_shape needs positive sizes, got {frame_shape}")
    return shape


def _allocate(
    slots: tuple[int, ...],
    frame_shape: tuple[int, ...],
    frame_dtype: np.dtype,
    action_dim: int,
    device: torch.device | None,
) -> tuple[Any, Any, Any, Any]:
    """Zeroed frames, actions, rewards and terminals with leading dimensions `slots` (one ring's
    capacity, or rings x capacity): host numpy arrays (device None) or tensors on `device`."""
    if device is None:
        # np.zeros maps pages lazily, so a large buffer costs RAM only as it fills.
        return (
            np.zeros((*slots, *frame_shape), dtype=frame_dtype),
            np.zeros((*slots, action_dim), dtype=np.float32),
            np.zeros(slots, dtype=np.float32),
            np.zeros(slots, dtype=bool),
        )
    # Allocated (and zeroed) in full now: a device that cannot hold the ring fails at start-up,
    # not hours into a run.
    return (
        torch.zeros((*slots, *frame_shape), dtype=_torch_dtype(frame_dtype), device=device),
        torch.zeros((*slots, action_dim), dtype=torch.float32, device=device),
        torch.zeros(slots, dtype=torch.float32, device=device),
        torch.zeros(slots, dtype=torch.bool, device=device),
    )


def _host_copy(array: np.ndarray, device: torch.device | None) -> torch.Tensor:
    """A private host copy of `array` that `copy_(..., non_blocking=True)` to `device` may read
    later.

    For CUDA it is page-locked, so the copy neither waits for queued GPU work nor blocks the
    host; torch's caching host allocator keeps the block until that copy has run, so the
    caller may reuse `array` at once. Other devices copy synchronously anyway.
    """
    if device is not None and device.type == "cuda":
        staged = torch.empty(array.shape, dtype=_torch_dtype(array.dtype), pin_memory=True)
        staged.numpy()[...] = array
        return staged
    return torch.from_numpy(np.array(array, copy=True))  # writable and contiguous


def _gather(
    storage: tuple[Any, Any, Any, Any],
    slots: np.ndarray,
    frame_stack: int,
    device: torch.device | None,
    pin_memory: bool,
) -> dict[str, torch.Tensor]:
    """The batch of the stacked `slots` (B, k+1) (:meth:`ReplayBuffer._stack_slots`) from
    `storage` (frames, actions, rewards, terminals, each indexed by slot): host numpy arrays
    filled into fresh host tensors (page-locked with `pin_memory`), or tensors on `device`
    gathered there. One ring's slots, or a :class:`ReplaySet`'s slots into its joint storage."""
    frames, actions, rewards, terminals = storage
    batch_size, frame_shape = slots.shape[0], tuple(frames.shape[1:])
    flat_obs_shape = (batch_size, frame_stack * frame_shape[0], *frame_shape[1:])
    if device is not None:
        # The slot numbers are the only host->device transfer (asynchronous from pinned memory
        # on CUDA), and nothing here reads a device value back, so the host never waits for
        # the GPU.
        index = _host_copy(slots, device).to(device, non_blocking=True)
        sampled = index[:, frame_stack]
        # Two gathers rather than one of k+1 frames sliced twice: obs and next_obs come out
        # contiguous and independent, as the host buffer returns them.
        return {
            "obs": frames[index[:, :frame_stack]].reshape(flat_obs_shape),
            "action": actions[sampled],
            "reward": rewards[sampled].unsqueeze(1),
            "not_terminal": (~terminals[sampled]).to(torch.float32).unsqueeze(1),
            "next_obs": frames[index[:, 1:]].reshape(flat_obs_shape),
        }

    def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=pin_memory)

    stacked_shape = (batch_size, frame_stack, *frame_shape)
    sampled = slots[:, frame_stack]
    frame_dtype = _torch_dtype(frames.dtype)
    obs, next_obs = empty(flat_obs_shape, frame_dtype), empty(flat_obs_shape, frame_dtype)
    action = empty((batch_size, actions.shape[1]), torch.float32)
    reward, not_terminal = empty((batch_size, 1), torch.float32), empty((batch_size, 1), torch.float32)
    # np.take writes straight into the tensors' memory (no temporary batch); mode="clip" skips
    # the buffered bounds check that "raise" needs with out=, and the slots are in range by
    # construction.
    take = {"axis": 0, "mode": "clip"}
    np.take(frames, slots[:, :frame_stack], out=obs.numpy().reshape(stacked_shape), **take)
    np.take(frames, slots[:, 1:], out=next_obs.numpy().reshape(stacked_shape), **take)
    np.take(actions, sampled, out=action.numpy(), **take)
    np.take(rewards, sampled, out=reward.numpy().reshape(batch_size), **take)
    not_terminal.numpy()[:, 0] = ~terminals[sampled]
    return {"obs": obs, "action": action, "reward": reward, "not_terminal": not_terminal, "next_obs": next_obs}


class ReplayBuffer:
    """Ring buffer of single frames; samples (obs, action, reward, not_terminal, next_obs).

    Args:
        capacity: number of slots, one per stored frame; each agent step takes one slot and each
            episode start one more, so it holds about `capacity` transitions.
        frame_shape: shape of one frame, e.g. (3, 84, 84) or (D,) for state vectors.
        frame_dtype: numpy dtype of frames (uint8 for images, float32 for states).
        frame_stack: frames per observation, stacked on the first frame axis.
        action_dim: number of action components.
        device: None keeps everything in host numpy arrays (the default). A torch device puts
            frames (in the frame dtype), actions, rewards and terminals in torch tensors there;
            `sample()` then gathers on that device and returns tensors on it. Episode-start
            flags and counters stay on the host either way.
        pin_memory: with host storage, return batches in page-locked memory so copying them to
            a CUDA device is asynchronous; needs CUDA (ValueError otherwise).
        storage: the ring's frames, actions, rewards and terminals, made by :func:`_allocate`
            for this placement (a :class:`ReplaySet` hands each ring its block of one joint
            allocation); None allocates them.

    Usage: `add_first(frame)` at every episode start, then `add(action, reward, terminal,
    next_frame)` after each agent step.
    """

    def __init__(
        self,
        capacity: int,
        frame_shape: tuple[int, ...],
        frame_dtype: Any,
        frame_stack: int,
        action_dim: int,
        device: torch.device | str | None = None,
        pin_memory: bool = False,
        storage: tuple[Any, Any, Any, Any] | None = None,
    ) -> None:
        self._capacity = _positive("capacity", capacity)
        self._frame_stack = _positive("frame_stack", frame_stack)
        self._action_dim = _positive("action_dim", action_dim)
        if self._capacity <= self._frame_stack:
            raise ValueError(
                f"capacity ({capacity}) must exceed frame_stack ({frame_stack}) to hold one "
                "transition with its whole stack"
            )
        self._frame_shape = _checked_frame_shape(frame_shape)
        self._frame_dtype = np.dtype(frame_dtype)
        self._device, self._pin_memory = _resolve_placement(device, pin_memory)

        if storage is None:
            storage = _allocate((self._capacity,), self._frame_shape, self._frame_dtype, self._action_dim, self._device)
        self._frames, self._actions, self._rewards, self._terminals = storage
        expected = (
            (self._capacity, *self._frame_shape),
            (self._capacity, self._action_dim),
            (self._capacity,),
            (self._capacity,),
        )
        if tuple(tuple(array.shape) for array in storage) != expected:
            raise ValueError(f"storage shapes {[tuple(a.shape) for a in storage]} do not match this ring's {expected}")
        # Host numpy in every placement: drawing indices and chaining stacks read it on the host,
        # so a device buffer draws the same indices as a host one and never waits for the device.
        self._firsts = np.zeros(self._capacity, dtype=bool)

        # Absolute number of slots ever written; slot of absolute index j is j % capacity.
        self._written = 0
        # add() is only legal inside an episode: after add_first() and before a terminal step.
        self._episode_open = False

    # ------------------------------------------------------------------ sizes
    @property
    def capacity(self) -> int:
        """Number of slots."""
        return self._capacity

    @property
    def frame_stack(self) -> int:
        """Frames per sampled observation."""
        return self._frame_stack

    @property
    def device(self) -> torch.device | None:
        """Where frames, actions, rewards and terminals live and batches are returned; None: host
        numpy arrays."""
        return self._device

    @property
    def pin_memory(self) -> bool:
        """Host batches are page-locked."""
        return self._pin_memory

    @property
    def nbytes(self) -> int:
        """Bytes allocated by all storage arrays (on the device, plus the host's episode-start
        flags, when the ring lives on a device)."""
        return sum(
            _nbytes(array) for array in (self._frames, self._actions, self._rewards, self._terminals, self._firsts)
        )

    @property
    def bytes_per_transition(self) -> float:
        """`nbytes / capacity`: the memory cost of one stored step."""
        return self.nbytes / self._capacity

    def describe(self) -> str:
        """One line stating the capacity in transitions and bytes, and where they live."""
        return (
            f"replay buffer: {self._capacity:,} transitions x {self.bytes_per_transition:,.0f} B "
            f"= {self.nbytes / 1e9:.2f} GB ({self._contents()})"
        )

    def _contents(self) -> str:
        """What the ring stores and where, for describe()."""
        frame = "x".join(str(size) for size in self._frame_shape)
        where = "" if self._device is None else f" on {self._device}"
        there = "" if self._device is None else "there "
        text = (
            f"{self._frame_dtype.name} frames {frame} stored once{where}, "
            f"stacks of {self._frame_stack} rebuilt {there}at sample time"
        )
        return text + (", batches in pinned host memory" if self._pin_memory else "")

    def __len__(self) -> int:
        """Number of transitions that can be sampled now."""
        low, high = self._sample_range()
        if high <= low:
            return 0
        return (high - low) - int(self._count_firsts(low, high))

    # ------------------------------------------------------------------ writing
    def add_first(self, frame: np.ndarray) -> None:
        """Store the first frame of a new episode."""
        slot = self._write_frame(frame)
        self._write_step(slot, None, 0.0, False)
        self._firsts[slot] = True
        self._written += 1
        self._episode_open = True

    def add(self, action: np.ndarray, reward: float, terminal: bool, next_frame: np.ndarray) -> None:
        """Store one agent step: the action taken, its reward, and the frame it led to.

        `terminal` is True only when the task itself ended the episode; a time-limit end is
        not terminal.
        """
        if not self._episode_open:
            raise ValueError(
                "add() needs an open episode: call add_first(frame) at every episode start "
                "(including after a terminal step)"
            )
        action = np.asarray(action, dtype=np.float32).reshape(-1)
        if action.shape != (self._action_dim,):
            raise ValueError(f"action must have {self._action_dim} components, got {action.shape}")
        slot = self._write_frame(next_frame)
        self._write_step(slot, action, reward, bool(terminal))
        self._firsts[slot] = False
        self._written += 1
        self._episode_open = not terminal

    def _write_frame(self, frame: np.ndarray) -> int:
        frame = np.asarray(frame)
        if frame.shape != self._frame_shape:
            raise ValueError(f"frame must have shape {self._frame_shape}, got {frame.shape}")
        if self._frame_dtype == np.uint8 and frame.dtype != np.uint8:
            # Casting floats in [0, 1] or [0, 255] to uint8 would silently wrap or truncate.
            raise ValueError(f"frames must be uint8 images, got {frame.dtype}")
        slot = self._written % self._capacity
        if self._device is None:
            self._frames[slot] = frame
        else:
            # The same cast as numpy's assignment above (e.g. float64 states to float32).
            staged = _host_copy(np.asarray(frame, dtype=self._frame_dtype), self._device)
            self._frames[slot].copy_(staged, non_blocking=True)
        return slot

    def _write_step(self, slot: int, action: np.ndarray | None, reward: float, terminal: bool) -> None:
        """Action (None: zeros, at an episode start), reward and terminal of `slot`."""
        if self._device is None:
            self._actions[slot] = 0.0 if action is None else action
            self._rewards[slot] = reward
            self._terminals[slot] = terminal
            return
        if action is None:
            self._actions[slot].zero_()
        else:
            self._actions[slot].copy_(_host_copy(action, self._device), non_blocking=True)
        # Python scalars travel as kernel arguments: no host->device copy, no synchronisation.
        self._rewards[slot].fill_(float(reward))
        self._terminals[slot].fill_(terminal)

    # ------------------------------------------------------------------ sampling
    def _sample_range(self) -> tuple[int, int]:
        """Absolute indices [low, high) whose transitions have their whole stack in the ring."""
        oldest = max(0, self._written - self._capacity)
        if oldest == 0:
            # Slot 0 starts an episode, and stacks stop at episode starts, so nothing reaches
            # below it.
            return 1, self._written
        # A stack reaches back at most frame_stack frames from i; the slot before the oldest has
        # been overwritten, so its episode start may be gone (a small loss at the tail).
        return oldest + self._frame_stack, self._written

    def _count_firsts(self, low: int, high: int) -> int:
        start, stop = low % self._capacity, high % self._capacity
        if start < stop:
            return np.count_nonzero(self._firsts[start:stop])
        return np.count_nonzero(self._firsts[start:]) + np.count_nonzero(self._firsts[:stop])

    def _draw_indices(self, batch_size: int, rng: np.random.Generator) -> np.ndarray:
        low, high = self._sample_range()
        indices = rng.integers(low, high, size=batch_size)
        for _ in range(_REJECTION_ROUNDS):
            rejected = np.flatnonzero(self._firsts[indices % self._capacity])
            if rejected.size == 0:
                return indices
            indices[rejected] = rng.integers(low, high, size=rejected.size)
        rejected = np.flatnonzero(self._firsts[indices % self._capacity])
        if rejected.size:
            candidates = np.arange(low, high)
            candidates = candidates[~self._firsts[candidates % self._capacity]]
            indices[rejected] = rng.choice(candidates, size=rejected.size)
        return indices

    def sample(self, batch_size: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        """Draw `batch_size` transitions uniformly (with replacement).

        Returns tensors on `device` (host tensors, page-locked with `pin_memory`, when the ring
        is in host memory): `obs` and `next_obs` of shape (B, k*C, H, W) in the frame dtype (or
        (B, k*D) for state vectors), `action` (B, A), `reward` (B, 1) and `not_terminal` (B, 1,
        0.0 where the task terminated), all float32 except the frames. The same history and RNG
        state give the same values in every placement.
        """
        batch_size = _positive("batch_size", batch_size)
        if len(self) == 0:
            raise ValueError(
                "cannot sample from an empty replay buffer: add an episode start and at least "
                f"one step (stored slots: {min(self._written, self._capacity)})"
            )
        storage = (self._frames, self._actions, self._rewards, self._terminals)
        return _gather(storage, self._sample_slots(batch_size, rng), self._frame_stack, self._device, self._pin_memory)

    def _sample_slots(self, batch_size: int, rng: np.random.Generator) -> np.ndarray:
        """The stacked slots (B, k+1) of `batch_size` uniformly drawn transitions."""
        return self._stack_slots(self._draw_indices(batch_size, rng))

    def _stack_slots(self, indices: np.ndarray) -> np.ndarray:
        """Slots (B, k+1) of the frames i-k .. i of each sampled transition i, oldest first:
        obs is columns [:k], next_obs columns [1:], the transition's own slot column k."""
        # chain[:, m] is the absolute index of the frame m steps back from i, held at the
        # episode's first frame once it reaches it. i itself is never a first slot, so
        # chain[:, 1] = i - 1 is always in the same episode.
        stack = self._frame_stack
        chain = np.empty((indices.shape[0], stack + 1), dtype=np.int64)
        chain[:, 0] = indices
        for back in range(1, stack + 1):
            previous = chain[:, back - 1]
            at_episode_start = self._firsts[previous % self._capacity]
            chain[:, back] = np.where(at_episode_start, previous, previous - 1)
        return np.ascontiguousarray((chain % self._capacity)[:, ::-1])

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        """Contents and counters as CPU tensors and Python ints (only the filled slots).

        Tensors rather than numpy arrays because `torch.load(weights_only=True)`, the default
        since torch 2.6, refuses numpy arrays inside a checkpoint. The same format in every
        placement (device storage is copied to the host), so a state saved from a device buffer
        loads into a host buffer and vice versa.
        """
        filled = min(self._written, self._capacity)

        def host_copy(array: np.ndarray | torch.Tensor) -> torch.Tensor:
            if isinstance(array, torch.Tensor):
                return array[:filled].to("cpu", copy=True)
            return torch.from_numpy(array[:filled].copy())

        return {
            "format_version": _FORMAT_VERSION,
            "capacity": self._capacity,
            "frame_stack": self._frame_stack,
            "written": self._written,
            "episode_open": int(self._episode_open),
            "frames": host_copy(self._frames),
            "actions": host_copy(self._actions),
            "rewards": host_copy(self._rewards),
            "terminals": host_copy(self._terminals),
            "firsts": host_copy(self._firsts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output into a buffer built with the same arguments (any
        placement: contents are copied onto this buffer's device).

        Accepts tensors or numpy arrays; raises ValueError on any mismatch without changing
        the buffer.
        """
        if int(state.get("format_version", -1)) != _FORMAT_VERSION:
            raise ValueError(f"replay state has format {state.get('format_version')!r}, expected {_FORMAT_VERSION}")
        for name, mine in (("capacity", self._capacity), ("frame_stack", self._frame_stack)):
            if int(state[name]) != mine:
                raise ValueError(f"replay state has {name}={int(state[name])}, this buffer {mine}")
        written = int(state["written"])
        filled = min(written, self._capacity)
        arrays = {
            "frames": (self._frames, self._frame_dtype),
            "actions": (self._actions, np.dtype(np.float32)),
            "rewards": (self._rewards, np.dtype(np.float32)),
            "terminals": (self._terminals, np.dtype(bool)),
            "firsts": (self._firsts, np.dtype(bool)),
        }
        # Check everything before writing anything, so a bad state leaves the buffer intact.
        loaded = {}
        for name, (target, dtype) in arrays.items():
            value = state[name]
            if isinstance(value, torch.Tensor):
                value = value.detach().cpu().numpy()
            source = np.asarray(value)
            row = tuple(target.shape[1:])
            if source.shape != (filled, *row) or source.dtype != dtype:
                raise ValueError(
                    f"replay state {name!r} is {source.dtype}{list(source.shape)}, expected {dtype}{[filled, *row]}"
                )
            loaded[name] = source
        for name, (target, _) in arrays.items():
            if isinstance(target, torch.Tensor):
                # from_numpy needs a writable, contiguous array (np.require copies only if not).
                target[:filled].copy_(torch.from_numpy(np.require(loaded[name], requirements="CW")))
                target[filled:].zero_()
            else:
                target[:filled] = loaded[name]
                target[filled:] = 0
        self._written = written
        self._episode_open = bool(int(state["episode_open"]))


class ReplaySet:
    """One :class:`ReplayBuffer` per environment (``env.num_envs``), sampled as one.

    Each environment's frames must stay consecutive for stacks to be rebuilt, so each gets its
    own ring of ``capacity // num_envs`` slots: block ``e`` of one joint allocation per array
    (frames, actions, rewards, terminals). A batch draws from the rings in proportion to the
    transitions they hold (one multinomial draw); each ring then draws and chains its share of
    the slots on the host, exactly as its own :meth:`ReplayBuffer.sample` would, and all the
    slots, offset into the joint arrays, are gathered at once in ring order (on the rings'
    device, or into page-locked host memory with ``pin_memory``). The values are those of
    sampling each ring and concatenating, without a gather per ring and a copy of the whole
    batch: the ops of one ring's batch whatever the number of rings (docs/performance.md counts
    them). ``device`` and ``pin_memory``: see :class:`ReplayBuffer`.
    """

    def __init__(
        self,
        num_envs: int,
        capacity: int,
        frame_shape: tuple[int, ...],
        frame_dtype: Any,
        frame_stack: int,
        action_dim: int,
        device: torch.device | str | None = None,
        pin_memory: bool = False,
    ) -> None:
        num_envs = _positive("num_envs", num_envs)
        per_env = _positive("capacity", capacity) // num_envs
        if per_env <= frame_stack:
            raise ValueError(
                f"replay capacity {capacity} is too small for {num_envs} envs "
                f"(each needs more than {frame_stack} slots)"
            )
        placement, _ = _resolve_placement(device, pin_memory)
        shape = _checked_frame_shape(frame_shape)
        joint = _allocate(
            (num_envs, per_env), shape, np.dtype(frame_dtype), _positive("action_dim", action_dim), placement
        )
        self.buffers = [
            ReplayBuffer(
                per_env,
                frame_shape,
                frame_dtype,
                frame_stack,
                action_dim,
                device=device,
                pin_memory=pin_memory,
                storage=tuple(array[env] for array in joint),
            )
            for env in range(num_envs)
        ]
        # every ring's slots in one index space: ring e's slot j is joint slot e·per_env + j
        self._joint = tuple(array.reshape(num_envs * per_env, *array.shape[2:]) for array in joint)

    @property
    def capacity(self) -> int:
        return sum(b.capacity for b in self.buffers)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    @property
    def bytes_per_transition(self) -> float:
        return self.nbytes / self.capacity

    @property
    def device(self) -> torch.device | None:
        """Where the rings' storage lives and batches are returned; None: host memory."""
        return self.buffers[0].device

    def describe(self) -> str:
        """One line stating the capacity in transitions and bytes, over all rings, and where."""
        rings = f"; {len(self.buffers)} rings, one per env" if len(self.buffers) > 1 else ""
        return (
            f"replay buffer: {self.capacity:,} transitions x {self.bytes_per_transition:,.0f} B "
            f"= {self.nbytes / 1e9:.2f} GB ({self.buffers[0]._contents()}){rings}"
        )

    def __len__(self) -> int:
        return sum(len(b) for b in self.buffers)

    def add_first(self, env_index: int, frame: np.ndarray) -> None:
        self.buffers[env_index].add_first(frame)

    def add(self, env_index: int, action: np.ndarray, reward: float, terminal: bool, next_frame: np.ndarray) -> None:
        self.buffers[env_index].add(action, reward, terminal, next_frame)

    def sample(self, batch_size: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        """`batch_size` transitions from all rings (class docstring); the returned tensors as
        :meth:`ReplayBuffer.sample`'s."""
        if len(self.buffers) == 1:
            return self.buffers[0].sample(batch_size, rng)
        batch_size = _positive("batch_size", batch_size)
        sizes = np.array([len(b) for b in self.buffers], dtype=np.float64)
        if sizes.sum() <= 0:
            raise ValueError("cannot sample from an empty replay buffer")
        counts = rng.multinomial(batch_size, sizes / sizes.sum())
        slots = [
            buffer._sample_slots(int(count), rng) + env * buffer.capacity
            for env, (buffer, count) in enumerate(zip(self.buffers, counts))
            if count > 0
        ]
        first = self.buffers[0]
        return _gather(self._joint, np.concatenate(slots), first.frame_stack, first.device, first.pin_memory)

    def state_dict(self) -> dict[str, Any]:
        return {"buffers": [b.state_dict() for b in self.buffers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["buffers"]) != len(self.buffers):
            raise ValueError(
                f"the saved replay holds {len(state['buffers'])} env rings; this run has "
                f"{len(self.buffers)} (env.num_envs must match to resume)"
            )
        for buffer, saved in zip(self.buffers, state["buffers"]):
            buffer.load_state_dict(saved)


def replay_placement(replay_cfg: Any, training_device: torch.device) -> tuple[torch.device | None, bool]:
    """``(device, pin_memory)`` for the replay rings from the ``replay`` config group (``device``,
    ``pin_memory``) and the device this rank trains on (``trainer.strategy.root_device``).

    ``auto`` is the training device, or host memory (None) when that is a CPU: there numpy
    storage is the training device's memory already. A bare ``cuda`` is this rank's GPU.
    ``pin_memory`` null is on exactly when batches go from host replay to a CUDA device. A device
    or pinned memory this machine lacks is a ConfigError (one line, exit code 2).
    """
    setting, pin = replay_cfg.device, replay_cfg.pin_memory
    device = None
    if setting == "auto":
        device = None if training_device.type == "cpu" else training_device
    elif setting is not None:
        device = torch.device(setting)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError(
                    f"replay.device={setting} needs a CUDA GPU and torch sees none; "
                    "use replay.device=null (host memory) or auto"
                )
            if device.index is None and training_device.type == "cuda":
                device = training_device  # under DDP each rank keeps its replay on its own GPU
            elif device.index is not None and device.index >= torch.cuda.device_count():
                raise ConfigError(
                    f"replay.device={setting}, but torch sees {torch.cuda.device_count()} CUDA "
                    f"device(s) (cuda:0..cuda:{torch.cuda.device_count() - 1})"
                )
    if pin is None:
        pin = device is None and training_device.type == "cuda"
    elif pin and device is not None:
        raise ConfigError(
            f"replay.pin_memory=true applies to host replay; replay.device={setting} already "
            "samples batches on the device (leave pin_memory null)"
        )
    elif pin and not torch.cuda.is_available():
        raise ConfigError(
            "replay.pin_memory=true needs CUDA (page-locked memory serves host->GPU copies) "
            "and torch sees no CUDA device; use replay.pin_memory=null"
        )
    return device, bool(pin)
