"""What a run's sizes cost in memory and processes, checked before anything is allocated or started.

A size that cannot fit used to fail late and loudly: ``agent.hidden_dim=99999999`` in the
allocator's traceback, ``env.num_envs=100000`` as 200 worker processes and the kernel's
out-of-memory kill (exit 137, no error line). Each check here compares an estimate with what this
machine has (:class:`Machine`) and raises a one-line :class:`~pixelsac.config.ConfigError` with
the bytes, before any worker process starts and before the run directory is written:

* the replay (:func:`check_replay_fits`): a ring on the device is allocated whole; host rings
  fill as the run collects, so the whole ring is held against what the machine has and the part
  this run's budget fills against what is available now;
* environment workers (:func:`check_env_workers`): at most :data:`WORKERS_PER_CORE` per core, each
  a process of at least :data:`WORKER_BYTES`;
* the agent (:func:`check_agent_fits`): its networks with Adam's two moments and the target
  critic (:func:`network_parameters`), plus one update's activations (:func:`update_values`),
  on the device that trains;
* all of it together on the host (:func:`check_run_fits`, what the run's builder calls).

The estimates are floors -- what must exist at once, not every buffer torch keeps -- so a run is
refused only when it certainly cannot fit (the default agent's estimate against its measured
peak: docs/performance.md). Standard library only; the caller passes the parameters' size in
bytes (the precision policy decides it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pixelsac.config import ConfigError

#: More environment workers than this per core only wait for each other: they step in lockstep,
#: so N workers on C < N cores take N / C times as long per step and collect no faster.
WORKERS_PER_CORE = 4
#: The least memory one environment worker holds of its own (an interpreter with numpy, MuJoCo and
#: dm_control, and its GL context when rendering): private memory measured on the 2-core VM with
#: cheetah_run, 68 MiB for states and 148 MiB for 84x84 pixels (software rendering), rounded down.
WORKER_BYTES = {"state": 64 * 2**20, "pixels": 144 * 2**20}
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB")


def bytes_text(n: float) -> str:
    """``n`` bytes for a person: ``3,082 B``, ``280.31 TiB``; past YiB in powers of ten."""
    for unit in _UNITS:
        if n < 1024 or unit == _UNITS[-1]:
            if unit == "B":
                return f"{n:,.0f} B"
            return f"{n:,.2f} {unit}" if n < 1024**2 else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n} B"


@dataclass(frozen=True)
class Machine:
    """What a run is checked against: usable cores, host memory, and the training GPU's free
    memory when a GPU trains. None: the system does not say (then nothing is refused for it)."""

    cores: int
    host_total: int | None  # RAM + swap, or the cgroup's limit when lower
    host_available: int | None  # available now
    device_free: int | None = None  # free memory of the CUDA device that trains

    @classmethod
    def this(cls, device: Any = None) -> Machine:
        """This machine, and the CUDA ``device`` (a torch.device) when one trains."""
        total, available = host_memory()
        free = None
        if device is not None and getattr(device, "type", None) == "cuda":
            import torch

            free, _ = torch.cuda.mem_get_info(device)
        return cls(usable_cores(), total, available, free)


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a SLURM or container cpuset), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def host_memory() -> tuple[int | None, int | None]:
    """(RAM + swap, or the cgroup's limit when lower; memory available now), in bytes; None where
    the system does not say (not Linux)."""
    info: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None, None
    total = info.get("MemTotal", 0) + info.get("SwapTotal", 0) or None
    available = info.get("MemAvailable")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            limit = int(Path(limit_file).read_text().strip())
        except (OSError, ValueError):
            continue
        total = min(total, limit) if total else limit
        available = min(available, limit) if available is not None else limit
        break
    return total, available


# --- the replay ------------------------------------------------------------------------------------
def replay_bytes(
    cfg: Any, frame_shape: tuple[int, ...], frame_itemsize: int, action_dim: int, action_repeat: int, world: int
) -> tuple[int, int, int]:
    """(bytes of the whole ring, bytes of one slot, bytes this run's budget fills) of one rank's
    replay: a slot is a frame, its action (float32), reward (float32), terminal and episode-start
    flags; the budget fills one slot per agent step, one more per episode, and two per env."""
    frame_bytes = 1
    for side in frame_shape:
        frame_bytes *= int(side)
    slot = frame_bytes * frame_itemsize + 4 * action_dim + 4 + 1 + 1
    slots = int(cfg.replay.capacity)
    agent_steps = -(-cfg.train.env_frames // (action_repeat * world))
    episode_steps = -(-cfg.env.episode_frames // action_repeat)
    filled = min(slots, agent_steps + agent_steps // max(episode_steps, 1) + 2 * cfg.env.num_envs)
    return slots * slot, slot, filled * slot


def check_replay_fits(cfg: Any, env: Any, device: Any, world: int, machine: Machine | None = None) -> None:
    """A ConfigError, with the bytes it would need, for a replay this machine cannot hold (see the
    module's text); ``env`` gives the frame shape, ``device`` is where the ring lives (None: host)."""
    import numpy as np

    itemsize = np.dtype(env.frame_dtype).itemsize
    need, slot, filled = replay_bytes(cfg, env.frame_shape, itemsize, env.action_dim, env.action_repeat, world)
    slots = int(cfg.replay.capacity)
    what = f"replay.capacity={slots:,} needs {bytes_text(need)} ({slots:,} slots x {slot:,} B)"
    on_device = device is not None and getattr(device, "type", None) == "cuda"
    machine = machine or Machine.this(device if on_device else None)
    if on_device:
        if machine.device_free is not None and need > machine.device_free:
            raise ConfigError(
                f"{what} on {device}, which has {bytes_text(machine.device_free)} free: lower replay.capacity"
            )
        return
    if machine.host_total is not None and need > machine.host_total:
        raise ConfigError(
            f"{what} of host memory; this machine has {bytes_text(machine.host_total)} in all: lower replay.capacity"
        )
    if machine.host_available is not None and filled > machine.host_available:
        raise ConfigError(
            f"{what}; this run's budget fills {bytes_text(filled)} of it and {bytes_text(machine.host_available)} "
            "of host memory is available: lower replay.capacity (or train.env_frames)"
        )


# --- environment workers ---------------------------------------------------------------------------
def check_env_workers(num_envs: int, obs_kind: str, machine: Machine) -> None:
    """A ConfigError for more environment worker processes than ``machine`` runs usefully
    (:data:`WORKERS_PER_CORE` per core) or holds (:data:`WORKER_BYTES` each); one env runs in
    the trainer itself and is never refused here."""
    if num_envs <= 1:
        return
    per_worker = WORKER_BYTES[obs_kind]
    by_cores = WORKERS_PER_CORE * machine.cores
    by_memory = machine.host_available // per_worker if machine.host_available is not None else by_cores
    limit = max(1, min(by_cores, by_memory))
    if num_envs <= limit:
        return
    memory = (
        f"{bytes_text(machine.host_available)} of memory is available"
        if machine.host_available is not None
        else "this system does not say how much memory is available"
    )
    raise ConfigError(
        f"env.num_envs={num_envs:,} is more environment workers than this machine holds: each is a process of "
        f"at least {bytes_text(per_worker)} ({obs_kind}), {bytes_text(num_envs * per_worker)} for {num_envs:,}, "
        f"and {memory}; {machine.cores} core(s) step at most {by_cores} usefully ({WORKERS_PER_CORE} per core): "
        f"choose env.num_envs=1..{limit}"
    )


# --- the agent -------------------------------------------------------------------------------------
def _mlp_parameters(in_dim: int, hidden: int, out_dim: int, depth: int) -> int:
    """``nets.mlp``: ``depth`` hidden layers of ``hidden`` units, then a linear output (weights and biases)."""
    return in_dim * hidden + hidden + (depth - 1) * (hidden * hidden + hidden) + hidden * out_dim + out_dim


def _conv_sides(obs_shape: tuple[int, ...], num_layers: int) -> list[int]:
    """The side of each conv layer's output (``nets.ConvTrunk``: 3x3, the first with stride 2)."""
    first = (int(obs_shape[1]) - 3) // 2 + 1
    return [first - 2 * i for i in range(num_layers)]


def network_parameters(obs_shape: tuple[int, ...], action_dim: int, agent: Any) -> dict[str, int]:
    """Parameters of the DrQ networks (``pixelsac.nets.build_networks``) by part: ``trunk`` (the
    convolutions, shared), ``projections`` (actor's and critic's), ``actor`` and ``critic`` (their
    MLPs: the policy head and both Q heads). Pixels: a 3-D ``obs_shape``; states: 1-D."""
    hidden, depth = int(agent.hidden_dim), int(agent.hidden_depth)
    if len(obs_shape) == 3:
        channels, filters, layers = int(obs_shape[0]), int(agent.num_filters), int(agent.num_conv_layers)
        trunk = channels * 9 * filters + filters + (layers - 1) * (filters * 9 * filters + filters)
        flat = filters * _conv_sides(obs_shape, layers)[-1] ** 2
        features = int(agent.feature_dim)
        projections = 2 * (flat * features + features + 2 * features)  # Linear + LayerNorm, per head
    else:
        trunk, projections, features = 0, 0, int(obs_shape[0])
    return {
        "trunk": trunk,
        "projections": projections,
        "actor": _mlp_parameters(features, hidden, 2 * action_dim, depth),
        "critic": 2 * _mlp_parameters(features + action_dim, hidden, 1, depth),
    }


def network_state_values(parameters: dict[str, int]) -> int:
    """Values the agent holds between updates: every parameter with Adam's two moments, and the
    target critic (its trunk, projection and Q heads) once more."""
    critic = parameters["trunk"] + parameters["projections"] // 2 + parameters["critic"]
    return 3 * sum(parameters.values()) + critic


def _sample_values(obs_shape: tuple[int, ...], agent: Any) -> dict[str, int]:
    """One sample's values in an update: ``pixels`` -- its input and every conv output (pixels),
    or its state vector; ``heads`` -- the projection's three outputs and both Q heads' hidden
    layers; ``target`` -- a next observation and its first conv output, without a graph."""
    inputs = 1
    for side in obs_shape:
        inputs *= int(side)
    heads = 2 * int(agent.hidden_depth) * int(agent.hidden_dim)
    if len(obs_shape) != 3:
        return {"pixels": inputs, "heads": heads, "target": inputs}
    filters = int(agent.num_filters)
    sides = _conv_sides(obs_shape, int(agent.num_conv_layers))
    return {
        "pixels": inputs + filters * sum(side * side for side in sides),
        "heads": 3 * int(agent.feature_dim) + heads,
        "target": inputs + filters * sides[0] ** 2,
    }


def update_values(obs_shape: tuple[int, ...], agent: Any) -> int:
    """Values alive at once in one update (a floor: what the critic's backward needs, and the
    target's largest pair of layers): ``aug_q_copies`` augmented copies of the batch through the
    critic, each keeping its input, every conv output, the projection's outputs and both Q heads'
    hidden layers; ``aug_target_copies`` copies of the next observations and their first conv
    output, without a graph."""
    sample = _sample_values(obs_shape, agent)
    batch = int(agent.batch_size)
    graph = batch * int(agent.aug_q_copies) * (sample["pixels"] + sample["heads"])
    return graph + batch * int(agent.aug_target_copies) * sample["target"]


def _largest(parts: dict[str, tuple[int, str]]) -> str:
    """The keys to lower for the largest of ``parts`` (name -> (values, keys))."""
    return max(parts.values(), key=lambda part: part[0])[1]


def agent_bytes(obs_shape: tuple[int, ...], action_dim: int, agent: Any, value_bytes: int) -> tuple[int, int]:
    """(bytes of the networks' state, bytes of one update) at ``value_bytes`` per value."""
    state = network_state_values(network_parameters(obs_shape, action_dim, agent)) * value_bytes
    return state, update_values(obs_shape, agent) * value_bytes


def check_agent_fits(
    cfg: Any, obs_shape: tuple[int, ...], action_dim: int, value_bytes: int, available: int | None, where: str
) -> tuple[int, int]:
    """A ConfigError, with the bytes, when the agent's networks and one update (at
    ``value_bytes`` per value: the parameters' dtype) exceed ``available`` bytes of ``where``
    memory ("host", "cuda:0"); else (state bytes, update bytes)."""
    agent = cfg.agent
    parameters = network_parameters(obs_shape, action_dim, agent)
    total_parameters = sum(parameters.values())
    state, update = agent_bytes(obs_shape, action_dim, agent, value_bytes)
    if available is None or state + update <= available:
        return state, update
    sample = _sample_values(obs_shape, agent)
    pixels = len(obs_shape) == 3
    mlps = parameters["actor"] + parameters["critic"]
    lower_networks = _largest(
        {
            "mlps": (mlps, "agent.hidden_dim (or agent.hidden_depth)"),
            "projections": (parameters["projections"], "agent.feature_dim, or env.image_size and agent.num_filters"),
            "trunk": (parameters["trunk"], "agent.num_filters"),
        }
    )
    lower_update = "agent.batch_size, or " + (
        "env.image_size, env.frame_stack or agent.num_filters"
        if pixels and sample["pixels"] > sample["heads"]
        else "agent.hidden_dim"
    )
    lower = lower_networks if state >= update else lower_update
    copies = f" x {int(agent.aug_q_copies)} augmented copies" if pixels else ""
    raise ConfigError(
        f"the agent does not fit in {where} memory: its networks take {bytes_text(state)} "
        f"({total_parameters:,} parameters x {value_bytes} B, with Adam's two moments and the target critic) "
        f"and one update at least {bytes_text(update)} ({int(agent.batch_size):,} samples{copies} through the "
        f"critic); {bytes_text(available)} is available: lower {lower}"
    )


def check_run_fits(
    cfg: Any, env: Any, device: Any, world: int, value_bytes: int, machine: Machine | None = None
) -> None:
    """Everything a run allocates beyond the replay, before any of it is: its environment workers
    (:func:`check_env_workers`), its agent on the training ``device`` (:func:`check_agent_fits`),
    and, on the host, the replay's filled part, the workers and (when the CPU trains) the agent
    together. ``env`` is the run's evaluation environment (shapes), ``value_bytes`` the size of one
    parameter."""
    on_gpu = getattr(device, "type", None) == "cuda"
    machine = machine or Machine.this(device if on_gpu else None)
    obs_kind = str(cfg.env.obs)
    check_env_workers(int(cfg.env.num_envs), obs_kind, machine)
    where = str(device) if on_gpu else "host"
    available = machine.device_free if on_gpu else machine.host_available
    state, update = check_agent_fits(cfg, tuple(env.obs_shape), int(env.action_dim), value_bytes, available, where)
    if machine.host_available is None:
        return
    import numpy as np

    itemsize = np.dtype(env.frame_dtype).itemsize
    _, _, replay = replay_bytes(cfg, env.frame_shape, itemsize, env.action_dim, env.action_repeat, world)
    workers = WORKER_BYTES[obs_kind] * int(cfg.env.num_envs) if cfg.env.num_envs > 1 else 0
    parts = {"the replay's filled part": replay, f"{cfg.env.num_envs} env workers": workers}
    if not on_gpu:
        parts.update({"the networks": state, "one update": update})
    if sum(parts.values()) <= machine.host_available:
        return
    listed = ", ".join(f"{name} {bytes_text(n)}" for name, n in parts.items() if n)
    lower = {
        "the replay's filled part": "replay.capacity (or train.env_frames)",
        f"{cfg.env.num_envs} env workers": "env.num_envs",
        "the networks": "agent.hidden_dim",
        "one update": "agent.batch_size",
    }[max(parts, key=parts.get)]
    raise ConfigError(
        f"this run needs {bytes_text(sum(parts.values()))} of host memory together ({listed}) and "
        f"{bytes_text(machine.host_available)} is available: lower {lower}"
    )
