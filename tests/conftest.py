"""Shared test settings: headless rendering, few threads, small sizes; the tiny runs that
several test files read, trained once per session."""

import os

os.environ.setdefault("MUJOCO_GL", "egl")

import subprocess  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from overrides import merged  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"  # on a helper script's PYTHONPATH (stop_helper.py imports marks.py from here)

# Two threads in one process on CI's 2 cores; under pytest-xdist (`make test`: one worker per
# core) the cores are shared out between the workers. PIXELSAC_TEST_THREADS=1 beside a background
# run: two threads on a busy core spin-wait for each other (the small-op tests ran ~10x slower).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(int(os.environ.get("PIXELSAC_TEST_THREADS", max(1, 2 // WORKERS))))

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


def load_tool(filename: str) -> ModuleType:
    """A script of ``tools/`` as a module (``tools/`` on ``sys.path`` for its own imports)."""
    import importlib.util

    if str(REPO / "tools") not in sys.path:
        sys.path.insert(0, str(REPO / "tools"))
    spec = importlib.util.spec_from_file_location(f"pixelsac_tools_{Path(filename).stem}", REPO / "tools" / filename)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tiny_overrides() -> list[str]:
    return list(TINY)


def cli_env(*extra_paths: Path | str, **settings: str) -> dict[str, str]:
    """The environment a test runs pixelsac or a helper script in: this checkout first on
    PYTHONPATH, then ``extra_paths``; ``settings`` (hooks, a MUJOCO_GL to test) on top. MUJOCO_GL
    is inherited: set above, before anything imported dm_control."""
    path = os.pathsep.join(str(p) for p in (REPO, *extra_paths))
    return {**os.environ, "PYTHONPATH": path, **settings}


def run_cli(*args: str, cwd: Path, extra_path: Path | str | None = None) -> subprocess.CompletedProcess:
    """``python -m pixelsac.train ARGS`` from ``cwd``, to the end (a key given twice in ``args``:
    the later value, see :func:`overrides.merged`)."""
    return subprocess.run(
        [sys.executable, "-m", "pixelsac.train", *merged(*args)],
        cwd=cwd,
        env=cli_env(*([extra_path] if extra_path else [])),
        capture_output=True,
        text=True,
        timeout=600,
    )


def start_cli(
    *args: str, cwd: Path, stdout: int = subprocess.DEVNULL, stderr: int = subprocess.PIPE
) -> subprocess.Popen:
    """``run_cli`` in the background, unbuffered (a test can wait for a line of stdout): by
    default its stderr is kept and its stdout dropped; ``subprocess.PIPE`` or ``DEVNULL`` choose."""
    return subprocess.Popen(
        [sys.executable, "-m", "pixelsac.train", *merged(*args)],
        cwd=cwd,
        env=cli_env(PYTHONUNBUFFERED="1"),
        stdout=stdout,
        stderr=stderr,
        text=True,
    )


def main_in(cwd: Path, monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """``pixelsac.train.main(args)`` in this process, run from ``cwd``: its exit code and stderr
    (a key given twice in ``args``: the later value)."""
    from pixelsac.train import main

    monkeypatch.chdir(cwd)
    threads = torch.get_num_threads()
    try:
        code = main(merged(*args))
    finally:
        torch.set_num_threads(threads)
    return code, capsys.readouterr().err


@dataclass(frozen=True)
class TrainedRun:
    """A finished run of ``python -m pixelsac.train``: its directory and what it printed. Shared
    by every test of the session that asks for it, so read it, or copy it before changing it."""

    run_dir: Path
    stdout: str


def train_once(tmp_path_factory: pytest.TempPathFactory, name: str, *overrides: str) -> TrainedRun:
    run_dir = tmp_path_factory.mktemp("trained") / name
    result = run_cli(*overrides, f"run_dir={run_dir}", cwd=run_dir.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return TrainedRun(run_dir, result.stdout)


@pytest.fixture(scope="session")
def tiny_fp32_run(tmp_path_factory: pytest.TempPathFactory) -> TrainedRun:
    """TINY in fp32, its whole 320-frame budget: 24 updates, evaluations at 160 and 320."""
    return train_once(tmp_path_factory, "tiny_fp32", *TINY, "precision=fp32")


@pytest.fixture(scope="session")
def tiny_fp16_run(tmp_path_factory: pytest.TempPathFactory) -> TrainedRun:
    """TINY at the default precision (fp16 + six, so its checkpoint also proves an fp16 run
    evaluates on a CPU), 160 frames with two evaluations (80, 160) so it has a learning curve:
    4 updates, one logged row."""
    return train_once(tmp_path_factory, "tiny_fp16", *TINY, "train.env_frames=160", "train.eval_every_frames=80")


@pytest.fixture(scope="session")
def run16(tiny_fp16_run: TrainedRun) -> Path:
    """The tiny fp16 run's directory (the evaluation and plot tests read only that)."""
    return tiny_fp16_run.run_dir
