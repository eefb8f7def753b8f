"""Environments: the dm_control suite wrapper (pixels or states, action repeat, frame stack)."""

from pixelsac.envs.dmc import (
    PLANET_ACTION_REPEAT,
    DMCEnv,
    EnvError,
    TimeStep,
    available_tasks,
)

__all__ = ["PLANET_ACTION_REPEAT", "DMCEnv", "EnvError", "TimeStep", "available_tasks"]
