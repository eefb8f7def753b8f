"""Experience collection interleaved with learning.

:class:`Collector` steps an environment with the current policy (uniform random actions during
the seed steps) and writes every transition into the replay buffer; it keeps the counters the
benchmark reports (env frames = agent steps x action repeat). :class:`ExperienceStream` is the
iterable the Lightning Trainer consumes: each item is one replay batch, and before yielding it the
stream takes one agent step, so collection and updates interleave exactly as in DrQ::

    seed steps (random actions, no updates)
    repeat: 1 agent step -> ``updates_per_step`` batches (one gradient update each)
    until ``train.env_frames`` env frames have been collected

With ``overlap=True`` (``train.overlap_collection``) the environments step while the learner
updates: the stream picks the actions and hands them out (:meth:`Collector.begin_step`), yields
the step's batches, and takes the transitions after them (:meth:`Collector.finish_step`)::

    repeat: act on s_t, hand out a_t -> ``updates_per_step`` batches -> store (s_t, a_t, r_t, s_t+1)

A step then costs about the larger of the update and the environments' step instead of their
sum. The batches are drawn before the step in flight is stored, so they come from one transition
fewer than in DrQ's order (the policy that acts is the same: it has had the same updates); the
rest is as it was. Two steps run in DrQ's order even so: the one that may end an episode (so a
callback sees the episode boundary after its updates, where exact-resume checkpoints are taken)
and the budget's last (so a run never ends with a step in flight).

A checkpoint can come between the updates of one agent step (``updates_per_step`` above 1, or
several environments: the step that ends an episode is followed by all its batches). The
collector counts the batches its steps still owe the learner (:attr:`Collector.batches_due`) and
keeps the count in its state, so a resumed stream draws those first, before it collects again,
and the resumed run does the same updates as the uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from pixelsac.envs import DMCEnv, TimeStep
from pixelsac.replay import ReplaySet

ActFn = Callable[[np.ndarray, bool], np.ndarray]  # (obs batch, sample) -> actions in [-1, 1]


@dataclass
class Episode:
    """A finished training episode, for the logs."""

    env_frames: int  # total env frames collected when it ended
    ret: float
    length: int  # agent steps


class Collector:
    """Steps ``envs.num_envs`` environments in lockstep and fills the replay set; owns the step
    counters (summed over environments).

    Each step is one batched policy forward pass for all environments. A new episode starts
    lazily, at the first step after the previous one ended, so between episodes
    (:attr:`at_episode_boundary`, all environments) the whole collection state is a few counters
    and RNG states: that is where checkpoints meant for exact resumption are taken.

    :attr:`batches_due`: the replay batches (one update each) that the steps collected so far
    still owe the learner; set and drawn down by :class:`ExperienceStream`, kept in the state.
    """

    def __init__(
        self, envs: Any, replay: ReplaySet, act: ActFn, seed_steps: int, rng: np.random.Generator, world_size: int = 1
    ) -> None:
        self.envs, self.replay, self.act = envs, replay, act
        self.world_size = world_size  # data-parallel ranks, each collecting the same amount
        self.num_envs = envs.num_envs
        self.seed_steps = seed_steps
        self.rng = rng
        self.agent_steps = 0
        self.env_frames = 0
        self.episodes = 0
        self.finished: list[Episode] = []  # drained by the logging callback
        self._returns = [0.0] * self.num_envs
        self._lengths = [0] * self.num_envs
        self._timesteps: list[TimeStep | None] = [None] * self.num_envs  # None between episodes
        self._actions: np.ndarray | None = None  # the actions of a step in flight (begin_step)
        self.batches_due = 0

    @property
    def at_episode_boundary(self) -> bool:
        return not self.in_flight and all(t is None for t in self._timesteps)

    @property
    def steps_to_episode_boundary(self) -> int | None:
        """At most how many more steps until :attr:`at_episode_boundary` (0 there), from the time
        limit; an episode may end sooner. None when the environments' episodes are out of step
        (one ended early, by termination), so that no common boundary is in sight."""
        if self.at_episode_boundary:
            return 0
        episode = self._episode_steps()
        if episode is None or len(set(self._lengths)) > 1 or None in self._timesteps:
            return None
        return max(episode - self._lengths[0], 1)

    def _episode_steps(self) -> int | None:
        """Agent steps in an episode that runs to the time limit (None: no time limit known)."""
        frames, repeat = getattr(self.envs, "episode_frames", None), getattr(self.envs, "action_repeat", None)
        return None if frames is None or repeat is None else -(-frames // repeat)

    @property
    def total_env_frames(self) -> int:
        """Env frames collected by all data-parallel ranks together (what logs report)."""
        return self.env_frames * self.world_size

    @property
    def total_agent_steps(self) -> int:
        return self.agent_steps * self.world_size

    @property
    def in_flight(self) -> bool:
        """A step is handed out (:meth:`begin_step`) and its transitions not yet stored."""
        return self._actions is not None

    def next_step_may_end_episode(self) -> bool:
        """Could the next step end an episode? From the time limit; True where it cannot be told
        (episodes out of step, an env without a time limit)."""
        steps = self.steps_to_episode_boundary
        if steps == 0:  # the next step starts new episodes: they end at the time limit, or sooner
            steps = self._episode_steps()
        return steps is None or steps <= 1

    def step(self) -> None:
        """One step of every environment: reset the finished ones, act, store the transitions."""
        self.begin_step()
        self.finish_step()

    def begin_step(self) -> None:
        """The first half of :meth:`step`: reset the finished environments, pick the actions
        (the policy's forward pass, or uniform random ones in the seed steps) and hand them out;
        the environments step until :meth:`finish_step` takes their transitions."""
        if self.in_flight:
            raise RuntimeError("begin_step() while a step is in flight: finish_step() first")
        starting = [i for i, t in enumerate(self._timesteps) if t is None]
        if starting:
            for i, timestep in zip(starting, self.envs.reset(starting)):
                self._timesteps[i] = timestep
                self.replay.add_first(i, timestep.frame)
                self._returns[i], self._lengths[i] = 0.0, 0
        if self.agent_steps < self.seed_steps:
            actions = self.rng.uniform(-1.0, 1.0, size=(self.num_envs, self.envs.action_dim)).astype(np.float32)
        else:
            actions = self.act(np.stack([t.obs for t in self._timesteps]), True)
        self.envs.step_async(actions)
        self._actions = actions

    def finish_step(self) -> None:
        """The second half of :meth:`step`: wait for the transitions and store them; nothing
        when no step is in flight."""
        if self._actions is None:
            return
        actions, self._actions = self._actions, None
        for i, timestep in enumerate(self.envs.step_wait()):
            self.replay.add(i, actions[i], timestep.reward, timestep.terminal, timestep.frame)
            self._returns[i] += timestep.reward
            self._lengths[i] += 1
            self._timesteps[i] = timestep
            # the env may end inside a repeat; PlaNet counts the budget in repeats
            frames_after = (self.env_frames + (i + 1) * self.envs.action_repeat) * self.world_size
            if timestep.last:
                self.episodes += 1
                self.finished.append(Episode(frames_after, self._returns[i], self._lengths[i]))
                self._timesteps[i] = None
        self.agent_steps += self.num_envs
        self.env_frames += self.num_envs * self.envs.action_repeat

    def drain_episodes(self) -> list[Episode]:
        done, self.finished = self.finished, []
        return done

    def state_dict(self) -> dict:
        """Counters and RNG states (plain containers). Taken mid-episode, a resume starts new
        episodes: only states taken at an episode boundary resume bit for bit. A step in flight
        is finished first (its transitions stored), so the state holds every step handed out."""
        self.finish_step()
        return {
            "agent_steps": self.agent_steps,
            "env_frames": self.env_frames,
            "episodes": self.episodes,
            "rng": self.rng.bit_generator.state,
            "env_rngs": self.envs.get_rng_states(),
            "at_episode_boundary": self.at_episode_boundary,
            "world_size": self.world_size,
            "batches_due": self.batches_due,
        }

    def load_state_dict(self, state: dict) -> None:
        if self.in_flight:
            raise RuntimeError("load_state_dict() while a step is in flight")
        if len(state["env_rngs"]) != self.num_envs:
            raise ValueError(
                f"the checkpoint collected with {len(state['env_rngs'])} envs; this run has "
                f"{self.num_envs} (env.num_envs must match to resume)"
            )
        self.agent_steps, self.env_frames = int(state["agent_steps"]), int(state["env_frames"])
        self.episodes = int(state["episodes"])
        self.batches_due = int(state.get("batches_due", 0))  # absent: written between agent steps
        self.rng.bit_generator.state = state["rng"]
        self.envs.set_rng_states(state["env_rngs"])
        self._timesteps, self.finished = [None] * self.num_envs, []


class ExperienceStream(IterableDataset):
    """Yields replay batches for the Trainer, collecting one agent step before each group of
    ``updates_per_step`` batches, until ``total_agent_steps`` have been collected.

    ``stop_check``, when set, is asked before every agent step (seed steps included) and between
    the updates of one step: True ends the iteration there, with the collection in a resumable
    state and :attr:`stopped_early` set (see :mod:`pixelsac.stopping`). Asking before a step
    lets a stop land even during the seed steps, which take no updates at all; asking between a
    step's updates bounds the wait however many updates a step holds (the batches left stay due,
    :attr:`Collector.batches_due`). Not between a step's collection and its first update: with
    one update per step (the default) the stop points are the steps'.

    ``overlap``: the environments step while the step's batches are updated on (module
    docstring), except in a step that may end an episode and the budget's last step.
    """

    def __init__(
        self,
        collector: Collector,
        batch_size: int,
        total_agent_steps: int,
        updates_per_step: int,
        rng: np.random.Generator,
        overlap: bool = False,
    ) -> None:
        super().__init__()
        self.overlap = overlap
        self.collector = collector
        self.batch_size = batch_size
        self.total_agent_steps = total_agent_steps
        self.updates_per_step = updates_per_step
        self.rng = rng
        self.stop_check: Callable[[], bool] | None = None
        self.stopped_early = False

    @property
    def exhausted(self) -> bool:
        """The budget is collected and updated on: an iteration now yields nothing."""
        return self.collector.agent_steps >= self.total_agent_steps and self.collector.batches_due == 0

    def __len__(self) -> int:
        """Batches still to come (the progress bar's total)."""
        start = max(self.collector.agent_steps, self.collector.seed_steps)
        return max(self.total_agent_steps - start, 0) * self.updates_per_step + self.collector.batches_due

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        collector = self.collector
        while collector.agent_steps < min(collector.seed_steps, self.total_agent_steps):
            if self._stop_here():
                return
            collector.step()
        between_updates = True  # batches due from a checkpoint come after updates: a stop may land first
        while True:
            while collector.batches_due > 0:
                if between_updates and self._stop_here():
                    return
                between_updates = True
                collector.batches_due -= 1
                yield self.replay_batch()
            collector.finish_step()  # nothing left to do unless the step overlapped its updates
            if collector.agent_steps >= self.total_agent_steps or self._stop_here():
                return
            overlap = self._overlaps()
            collector.begin_step()
            if not overlap:
                collector.finish_step()
            # the update-to-data ratio holds per agent step, whatever the number of envs
            collector.batches_due = self.updates_per_step * collector.num_envs
            between_updates = False

    def _overlaps(self) -> bool:
        """Is the next step to overlap its updates (class docstring)?"""
        collector = self.collector
        if not self.overlap or self.updates_per_step == 0:
            return False
        last_of_budget = collector.agent_steps + collector.num_envs >= self.total_agent_steps
        return not last_of_budget and not collector.next_step_may_end_episode()

    def _stop_here(self) -> bool:
        if self.stop_check is not None and self.stop_check():
            self.stopped_early = True
        return self.stopped_early

    def replay_batch(self) -> dict[str, torch.Tensor]:
        return self.collector.replay.sample(self.batch_size, self.rng)


def run_episodes(
    env: DMCEnv,
    act: ActFn,
    episodes: int,
    sample: bool = False,
    on_frame: Callable[[int, DMCEnv], None] | None = None,
    should_abandon: Callable[[], bool] | None = None,
) -> list[float] | None:
    """Play ``episodes`` full episodes (deterministic mean action unless ``sample``); returns.

    ``on_frame(episode_index, env)`` is called after every reset and step (e.g. to record video).
    ``should_abandon()`` is asked before every step: True gives up at once and returns None (an
    evaluation can take minutes; a run asked to stop should not wait for it).
    """
    returns = []
    for episode in range(episodes):
        timestep = env.reset()
        total = 0.0
        if on_frame is not None:
            on_frame(episode, env)
        while not timestep.last:
            if should_abandon is not None and should_abandon():
                return None
            timestep = env.step(act(timestep.obs[None], sample)[0])
            total += timestep.reward
            if on_frame is not None:
                on_frame(episode, env)
        returns.append(total)
    return returns
