"""Configuration composition, overrides and the one-line errors for bad input."""

import re

import pytest

from pixelsac.config import ConfigError, from_plain, load_config, load_options, to_plain

TASKS = ["cartpole_swingup", "cheetah_run", "walker_walk", "quadruped_walk", "point_mass_easy"]


def test_defaults_follow_drq():
    cfg = load_config([])
    assert cfg.agent.batch_size == 512 and cfg.agent.init_temperature == 0.1
    assert cfg.env.image_size == 84 and cfg.env.frame_stack == 3
    assert cfg.train.seed_steps == 1000 and cfg.agent.lr == 1e-3


@pytest.mark.parametrize(
    "task,repeat",
    [
        ("cartpole_swingup", 8),
        ("reacher_easy", 4),
        ("cheetah_run", 4),
        ("finger_spin", 2),
        ("ball_in_cup_catch", 4),
        ("walker_walk", 2),
    ],
)
def test_task_files_set_planet_action_repeat(task, repeat):
    assert load_config([f"task={task}"]).env.action_repeat == repeat


def test_order_defaults_task_preset_cli():
    cfg = load_config(["preset=tiny"])
    assert cfg.task == "cartpole_swingup" and cfg.env.action_repeat == 8 and cfg.agent.batch_size == 32
    cfg = load_config(["preset=tiny", "task=walker_walk", "agent.batch_size=7", "env.action_repeat=3"])
    assert (cfg.task, cfg.agent.batch_size, cfg.env.action_repeat) == ("walker_walk", 7, 3)
    cfg = load_config(["preset=state", "task=cheetah_run"])  # the preset wins over the task file
    assert cfg.env.action_repeat == 1 and cfg.env.obs == "state"


def test_types_are_coerced_and_trainer_flags_pass_through():
    cfg = load_config(["agent.lr=1", "trainer.devices=2", "trainer.log_every_n_steps=10", "trainer.accelerator=cpu"])
    assert cfg.agent.lr == 1.0 and isinstance(cfg.agent.lr, float)
    assert (cfg.trainer.devices, cfg.trainer.log_every_n_steps, cfg.trainer.accelerator) == (2, 10, "cpu")


def test_plain_round_trip():
    cfg = load_config(["seed=5"])
    assert to_plain(from_plain(to_plain(cfg))) == to_plain(cfg)


@pytest.mark.parametrize(
    "override,fragment",
    [
        (["agent.batchsize=3"], "unknown key 'agent.batchsize' (did you mean 'agent.batch_size'?)"),
        (["agent.batch_size=abc"], "agent.batch_size='abc' has the wrong type; it takes an integer"),
        (["agent.batch_size=1.5"], "it takes an integer"),
        (["agent.lr=true"], "it takes a number"),
        (["agent.batch_size=0"], "agent.batch_size=0 must be positive"),
        (["replay.capacity=-5"], "must be positive"),
        (["agent.discount=1.5"], "must lie in [0, 1]"),
        (["precision=fp8"], "unknown precision 'fp8'; choose one of fp32, fp16, bf16, amp"),
        (["task=cheeta_run"], "unknown task 'cheeta_run' (did you mean 'cheetah_run'?)"),
        (["trainer.devics=2"], "did you mean 'devices'?"),
        (["trainer.logger=false"], "set by pixelsac itself"),
        (["preset=tinny"], "unknown preset 'tinny' (did you mean 'tiny'?)"),
        (["batch_size"], "expected key=value"),
        (["agent=3"], "agent is a group of keys"),
        (["nope.x=1"], "unknown key 'nope.x'; top-level keys:"),
        (["env.obs=depth"], "env.obs='depth'; choose one of pixels, state"),
        (["seed=null"], "seed cannot be null"),
    ],
)
def test_bad_input_is_one_clear_line(override, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(override, valid_tasks=TASKS)
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message


def test_cli_values_are_checked_against_task_files_too(tmp_path):
    (tmp_path / "task").mkdir()
    (tmp_path / "preset").mkdir()
    (tmp_path / "config.yaml").write_text("task: a\npreset: null\nprecision: fp32\nenv:\n  size: 3\n")
    (tmp_path / "task" / "a.yaml").write_text("env:\n  sise: 4\n")
    with pytest.raises(ConfigError, match="in .*a.yaml: unknown key 'env.sise'"):
        load_config([], conf=tmp_path)


def test_entry_point_options_are_one_checked_config_group(tmp_path):
    """config.load_options: the evaluate and bench options' defaults live in conf/<name>.yaml and
    are checked the way training keys are (names, types, bounds, choices), one line each."""
    (tmp_path / "tool.yaml").write_text("episodes: 10\nseed: null\nout: null\nprefer: best\nlist: 0\n")
    load = lambda argv, **kw: load_options(  # noqa: E731
        "tool",
        argv,
        conf=tmp_path,
        nullable={"seed": int, "out": str},
        lower_bounds={"episodes": 1},
        choices={"prefer": ("best", "last")},
        verbatim=("out",),
        untyped=("list",),
        **kw,
    )
    assert load([]) == {"episodes": 10, "seed": None, "out": None, "prefer": "best", "list": 0}
    got = load(["episodes=3", "seed=7", "out=2024", "list=[1, 2]"])
    assert got["episodes"] == 3 and got["seed"] == 7 and got["out"] == "2024" and got["list"] == [1, 2]
    for argv, message in [
        (["episods=3"], "unknown option 'episods' (did you mean 'episodes'?); options: episodes, seed"),
        (["episodes=ten"], "episodes='ten' has the wrong type; it takes an integer"),
        (["episodes=0"], "episodes=0 must be positive"),
        (["seed=x"], "seed='x' has the wrong type; it takes an integer"),
        (["prefer=newest"], "prefer='newest'; choose one of best, last"),
        (["out="], "out= needs a value"),
        (["episodes"], "expected key=value"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load(argv)
    assert load(["tool.episodes=4"], prefix="tool.")["episodes"] == 4
    with pytest.raises(ConfigError, match=re.escape("unknown option 'episodes'")):
        load(["episodes=4"], prefix="tool.")
