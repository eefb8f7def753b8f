"""Shared test settings: headless rendering, few threads, small sizes."""

import os

os.environ.setdefault("MUJOCO_GL", "egl")

import pytest  # noqa: E402
import torch  # noqa: E402

# two on CI's 2 cores; PIXELSAC_TEST_THREADS=1 beside a background run (two threads on a busy core
# spin-wait for each other: the small-op tests ran ~10x slower)
torch.set_num_threads(int(os.environ.get("PIXELSAC_TEST_THREADS", "2")))

# Tiny but complete configuration for CPU tests: same code paths as a full run.
TINY = [
    "task=cartpole_swingup",
    "env.image_size=32",
    "env.episode_frames=64",
    "replay.capacity=400",
    "agent.batch_size=8",
    "agent.num_filters=8",
    "agent.feature_dim=16",
    "agent.hidden_dim=32",
    "train.seed_steps=16",
    "train.env_frames=320",
    "train.eval_every_frames=160",
    "train.eval_episodes=1",
    "train.log_every_updates=4",
    "train.video_size=64",
    "trainer.enable_progress_bar=false",
]


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` tests need a CUDA device: skipped, with the reason, where torch sees none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tiny_overrides() -> list[str]:
    return list(TINY)
