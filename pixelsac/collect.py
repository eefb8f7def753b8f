"""Experience collection interleaved with learning.

:class:`Collector` steps an environment with the current policy (uniform random actions during
the seed steps) and writes every transition into the replay buffer; it keeps the counters the
benchmark reports (env frames = agent steps x action repeat). :class:`ExperienceStream` is the
iterable the Lightning Trainer consumes: each item is one replay batch, and before yielding it the
stream takes one agent step, so collection and updates interleave exactly as in DrQ::

    seed steps (random actions, no updates)
    repeat: 1 agent step -> ``updates_per_step`` batches (one gradient update each)
    until ``train.env_frames`` env frames have been collected
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import IterableDataset

from pixelsac.envs import DMCEnv
from pixelsac.replay import ReplayBuffer

ActFn = Callable[[np.ndarray, bool], np.ndarray]  # (obs batch, sample) -> actions in [-1, 1]


@dataclass
class Episode:
    """A finished training episode, for the logs."""

    env_frames: int  # total env frames collected when it ended
    ret: float
    length: int  # agent steps


class Collector:
    """Steps one environment and fills the replay buffer; owns the step counters.

    A new episode starts lazily, at the first step after the previous one ended, so between
    episodes (:attr:`at_episode_boundary`) the whole collection state is a few counters and RNG
    states: that is where checkpoints meant for exact resumption are taken.
    """

    def __init__(self, env: DMCEnv, replay: ReplayBuffer, act: ActFn, seed_steps: int,
                 rng: np.random.Generator) -> None:
        self.env, self.replay, self.act = env, replay, act
        self.seed_steps = seed_steps
        self.rng = rng
        self.agent_steps = 0
        self.env_frames = 0
        self.episodes = 0
        self.finished: list[Episode] = []  # drained by the logging callback
        self._episode_return = 0.0
        self._episode_length = 0
        self._timestep = None  # None between episodes

    @property
    def at_episode_boundary(self) -> bool:
        return self._timestep is None

    def step(self) -> None:
        """One agent step: choose an action, step the env, store the transition."""
        if self._timestep is None:
            self._timestep = self.env.reset()
            self.replay.add_first(self._timestep.frame)
            self._episode_return, self._episode_length = 0.0, 0
        if self.agent_steps < self.seed_steps:
            action = self.rng.uniform(-1.0, 1.0, size=self.env.action_dim).astype(np.float32)
        else:
            action = self.act(self._timestep.obs[None], True)[0]
        timestep = self.env.step(action)
        self.replay.add(action, timestep.reward, timestep.terminal, timestep.frame)
        self.agent_steps += 1
        self.env_frames += self.env.action_repeat  # the env may end early inside a repeat; PlaNet counts the budget
        self._episode_return += timestep.reward
        self._episode_length += 1
        self._timestep = timestep
        if timestep.last:
            self.episodes += 1
            self.finished.append(Episode(self.env_frames, self._episode_return, self._episode_length))
            self._timestep = None

    def drain_episodes(self) -> list[Episode]:
        done, self.finished = self.finished, []
        return done

    def state_dict(self) -> dict:
        """Counters and RNG states (plain containers). Taken mid-episode, a resume starts a new
        episode: only states taken at an episode boundary resume bit for bit."""
        return {
            "agent_steps": self.agent_steps, "env_frames": self.env_frames, "episodes": self.episodes,
            "rng": self.rng.bit_generator.state, "env_rng": self.env.get_rng_state(),
            "at_episode_boundary": self.at_episode_boundary,
        }

    def load_state_dict(self, state: dict) -> None:
        self.agent_steps, self.env_frames = int(state["agent_steps"]), int(state["env_frames"])
        self.episodes = int(state["episodes"])
        self.rng.bit_generator.state = state["rng"]
        self.env.set_rng_state(state["env_rng"])
        self._timestep, self.finished = None, []


class ExperienceStream(IterableDataset):
    """Yields replay batches for the Trainer, collecting one agent step before each group of
    ``updates_per_step`` batches, until ``total_agent_steps`` have been collected."""

    def __init__(self, collector: Collector, batch_size: int, total_agent_steps: int,
                 updates_per_step: int, rng: np.random.Generator) -> None:
        super().__init__()
        self.collector = collector
        self.batch_size = batch_size
        self.total_agent_steps = total_agent_steps
        self.updates_per_step = updates_per_step
        self.rng = rng

    @property
    def exhausted(self) -> bool:
        """The budget is collected: an iteration now yields nothing."""
        return self.collector.agent_steps >= self.total_agent_steps

    def __len__(self) -> int:
        """Batches still to come (the progress bar's total)."""
        start = max(self.collector.agent_steps, self.collector.seed_steps)
        return max(self.total_agent_steps - start, 0) * self.updates_per_step

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        collector = self.collector
        while collector.agent_steps < min(collector.seed_steps, self.total_agent_steps):
            collector.step()
        while collector.agent_steps < self.total_agent_steps:
            collector.step()
            for _ in range(self.updates_per_step):
                yield self.replay_batch()

    def replay_batch(self) -> dict[str, torch.Tensor]:
        return self.collector.replay.sample(self.batch_size, self.rng)


def run_episodes(env: DMCEnv, act: ActFn, episodes: int, sample: bool = False,
                 on_frame: Callable[[int, DMCEnv], None] | None = None) -> list[float]:
    """Play ``episodes`` full episodes (deterministic mean action unless ``sample``); returns.

    ``on_frame(episode_index, env)`` is called after every reset and step (e.g. to record video).
    """
    returns = []
    for episode in range(episodes):
        timestep = env.reset()
        total = 0.0
        if on_frame is not None:
            on_frame(episode, env)
        while not timestep.last:
            timestep = env.step(act(timestep.obs[None], sample)[0])
            total += timestep.reward
            if on_frame is not None:
                on_frame(episode, env)
        returns.append(total)
    return returns
