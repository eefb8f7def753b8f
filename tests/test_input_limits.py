"""What a user types is read the way they mean it or refused in one line, exit code 2, before
anything is written: numbers in ordinary notation, a key given twice, counts that leave a result
undefined, sizes this machine cannot hold."""

import pytest
import torch
from conftest import TINY

STATE = [*TINY, "env.obs=state", "precision=fp32", "perf.calibrate_updates=0", "train.video_every_evals=0"]


def typed(tmp_path, monkeypatch, capsys, *args: str, entry: str = "train") -> tuple[int, str, str]:
    """An entry point's ``main(args)`` in this process, with ``args`` exactly as given (the
    harness's ``main_in`` resolves a repeated key; these tests type one on purpose)."""
    import importlib

    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    try:
        code = importlib.import_module(f"pixelsac.{entry}").main(list(args))
    finally:
        torch.set_num_threads(threads)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-3000:]
    return lines[0]


# --- numbers as people write them ------------------------------------------------------------------


def test_ordinary_float_notation_passes_the_command_line(tmp_path, monkeypatch, capsys):
    code, out, err = typed(
        tmp_path,
        monkeypatch,
        capsys,
        "agent.lr=1e-3",
        "agent.init_temperature=1E-1",
        "lowp.init_scale=1e6",
        "train.env_frames=1e6",
        "--print-config",
    )
    assert code == 0, err
    assert "lr: 0.001" in out and "init_temperature: 0.1" in out and "init_scale: 1000000.0" in out
    assert "env_frames: 1000000" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["agent.lr=" + "1" * 100_000], "error: agent.lr=1111111111... (100,000 digits) is too long to be a number"),
        (["train.env_frames=1e30"], "error: train.env_frames=1e30 is too large: integers stop at 2^63 - 1"),
        (["train.eval_episodes=0"], "error: train.eval_episodes=0 must be positive"),
        (
            ["agent.lr=1e-3", "seed=3", "agent.lr=3e-4"],
            "error: agent.lr is given twice: 'agent.lr=1e-3' and 'agent.lr=3e-4'; give each key once",
        ),
        (["resume=auto", "run_dir=r", "run_dir=s"], "error: run_dir is given twice: 'run_dir=r' and 'run_dir=s'"),
    ],
)
def test_train_refuses_in_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, args, message):
    given = {arg.partition("=")[0] for arg in args}
    code, _, err = typed(tmp_path, monkeypatch, capsys, *(o for o in STATE if o.partition("=")[0] not in given), *args)
    assert code == 2 and one_error_line(err).startswith(message)
    assert list(tmp_path.iterdir()) == []


def test_evaluate_and_bench_refuse_a_key_given_twice(tmp_path, monkeypatch, capsys):
    code, _, err = typed(tmp_path, monkeypatch, capsys, "checkpoint=x", "episodes=2", "episodes=3", entry="evaluate")
    assert code == 2 and "episodes is given twice: 'episodes=2' and 'episodes=3'" in one_error_line(err)
    code, _, err = typed(tmp_path, monkeypatch, capsys, "agent.batch_size=8", "agent.batch_size=16", entry="bench")
    assert code == 2 and "agent.batch_size is given twice" in one_error_line(err)
    assert list(tmp_path.iterdir()) == []


# --- sizes this machine cannot hold ----------------------------------------------------------------

GIB = 2**30


def agent_config(*overrides: str):
    from pixelsac.config import load_config

    return load_config(["task=cheetah_run", *overrides])


@pytest.mark.parametrize(
    "obs_shape,overrides",
    [
        ((9, 84, 84), []),
        (
            (6, 32, 32),
            ["agent.num_filters=5", "agent.num_conv_layers=2", "agent.hidden_depth=3", "agent.feature_dim=7"],
        ),
        ((17,), ["env.obs=state", "agent.hidden_dim=33", "agent.hidden_depth=1"]),
    ],
)
def test_the_parameter_count_is_the_networks(obs_shape, overrides):
    """footprint's arithmetic against pixelsac.nets itself: a change to the networks that the
    estimate misses fails here."""
    from pixelsac import footprint
    from pixelsac.nets import build_networks

    agent = agent_config(*overrides).agent
    actor, critic = build_networks(obs_shape, 6, agent)
    built = sum(p.numel() for p in actor.parameters()) + sum(p.numel() for p in critic.parameters())
    assert sum(footprint.network_parameters(obs_shape, 6, agent).values()) == built


def test_the_default_agent_figures():
    """DrQ's agent in fp32: 7,282,778 parameters, 99.4 MiB with Adam's moments and the target
    critic (the state figure docs/performance.md measures), an update at least 1,447 MiB (the
    measured tensor peak is 1,791 MiB); half of each in fp16."""
    from pixelsac import footprint

    agent = agent_config().agent
    assert sum(footprint.network_parameters((9, 84, 84), 6, agent).values()) == 7_282_778
    state, update = footprint.agent_bytes((9, 84, 84), 6, agent, 4)
    assert footprint.bytes_text(state) == "99.40 MiB" and footprint.bytes_text(update) == "1.41 GiB"
    assert footprint.agent_bytes((9, 84, 84), 6, agent, 2) == (state // 2, update // 2)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["agent.hidden_dim=99999999"],
            "the agent does not fit in host memory: its networks take 390.80 PiB (30,000,017,603,950,503 "
            "parameters x 4 B, with Adam's two moments and the target critic) and one update at least 1.49 TiB",
        ),
        (["agent.hidden_dim=99999999"], "16.00 GiB is available: lower agent.hidden_dim (or agent.hidden_depth)"),
        (["agent.batch_size=100000000"], "(100,000,000 samples x 2 augmented copies through the critic)"),
        (
            ["agent.batch_size=100000000"],
            "lower agent.batch_size, or env.image_size, env.frame_stack or agent.num_filters",
        ),
        (["agent.num_filters=100000"], "its networks take 4.09 TiB (282,261,832,410 parameters x 4 B,"),
        (["agent.num_filters=100000"], "is available: lower agent.num_filters"),
        (["agent.feature_dim=10000000"], "lower agent.feature_dim, or env.image_size and agent.num_filters"),
    ],
)
def test_an_agent_too_large_is_refused_with_its_bytes(overrides, message):
    from pixelsac import footprint
    from pixelsac.config import ConfigError

    with pytest.raises(ConfigError) as info:
        footprint.check_agent_fits(agent_config(*overrides), (9, 84, 84), 6, 4, 16 * GIB, "host")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_an_agent_that_fits_passes_and_states_are_small():
    from pixelsac import footprint

    assert footprint.check_agent_fits(agent_config(), (9, 84, 84), 6, 4, 2 * GIB, "host") == (
        104_227_352,
        1_517_641_728,
    )
    state, update = footprint.check_agent_fits(agent_config("env.obs=state"), (17,), 6, 4, 16 * GIB, "host")
    assert state + update < 200 * 2**20


def test_env_workers_are_bounded_by_cores_and_by_memory_per_worker():
    from pixelsac import footprint
    from pixelsac.config import ConfigError

    two_cores = footprint.Machine(cores=2, host_total=24 * GIB, host_available=21 * GIB)
    footprint.check_env_workers(8, "state", two_cores)  # 4 per core
    with pytest.raises(ConfigError) as info:
        footprint.check_env_workers(100_000, "state", two_cores)
    assert str(info.value) == (
        "env.num_envs=100,000 is more environment workers than this machine holds: each is a process of at least "
        "64.00 MiB (state), 6.10 TiB for 100,000, and 21.00 GiB of memory is available; 2 core(s) step at most 8 "
        "usefully (4 per core): choose env.num_envs=1..8"
    )
    little_memory = footprint.Machine(cores=64, host_total=2 * GIB, host_available=1 * GIB)
    with pytest.raises(ConfigError, match=r"choose env.num_envs=1\.\.7$"):
        footprint.check_env_workers(8, "pixels", little_memory)  # 144 MiB each: 7 fit in 1 GiB
    footprint.check_env_workers(1, "pixels", footprint.Machine(cores=1, host_total=None, host_available=0))


def test_the_run_together_must_fit_in_host_memory():
    from types import SimpleNamespace

    from pixelsac import footprint
    from pixelsac.config import ConfigError

    cfg = agent_config("env.num_envs=4", "replay.capacity=100000", "train.env_frames=400000")
    env = SimpleNamespace(
        obs_shape=(9, 84, 84), frame_shape=(3, 84, 84), frame_dtype="uint8", action_dim=6, action_repeat=4
    )
    roomy = footprint.Machine(cores=8, host_total=64 * GIB, host_available=32 * GIB)
    footprint.check_run_fits(cfg, env, None, 1, 4, roomy)
    tight = footprint.Machine(cores=8, host_total=4 * GIB, host_available=3 * GIB)
    with pytest.raises(ConfigError) as info:
        footprint.check_run_fits(cfg, env, None, 1, 4, tight)
    assert str(info.value) == (
        "this run needs 4.05 GiB of host memory together (the replay's filled part 1.97 GiB, 4 env workers "
        "576.00 MiB, the networks 99.40 MiB, one update 1.41 GiB) and 3.00 GiB is available: lower replay.capacity "
        "(or train.env_frames)"
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["env.num_envs=100000"], "error: env.num_envs=100,000 is more environment workers than this machine holds"),
        (["agent.hidden_dim=99999999"], "error: the agent does not fit in host memory: its networks take"),
        (["agent.batch_size=10000000000"], "(10,000,000,000 samples through the critic)"),
        (["agent.batch_size=100000000000000000000"], "error: agent.batch_size=100000000000000000000 is too large"),
        (["env.obs=pixels", "agent.num_filters=10000000"], "error: the agent does not fit in host memory"),
        (["env.obs=pixels", "env.image_size=1000000"], "error: render size 1000000 exceeds the offscreen buffer"),
        (["env.obs=pixels", "env.image_size=14"], "error: env.image_size=14 is too small for 4 conv layers"),
        (["replay.capacity=1000000000000000"], "error: replay.capacity=1,000,000,000,000,000 needs"),
    ],
)
def test_train_refuses_sizes_this_machine_cannot_hold_before_anything_is_written(
    tmp_path, monkeypatch, capsys, args, message
):
    given = {arg.partition("=")[0] for arg in args}
    base = [o for o in STATE if o.partition("=")[0] not in given]
    code, _, err = typed(tmp_path, monkeypatch, capsys, *base, *args, f"run_dir={tmp_path / 'run'}")
    assert code == 2 and message in one_error_line(err)
    assert list(tmp_path.iterdir()) == []
