"""Configuration composition, overrides and the one-line errors for bad input."""

import re

import pytest
from omegaconf import OmegaConf

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


# --- numbers as people write them, each key once ------------------------------------------------


@pytest.mark.parametrize(
    "override,key,value",
    [
        ("agent.lr=1e-3", "agent.lr", 1e-3),
        ("agent.lr=1e6", "agent.lr", 1e6),
        ("agent.lr=1E6", "agent.lr", 1e6),
        ("agent.lr=2.5E-4", "agent.lr", 2.5e-4),
        ("agent.lr=.5e-3", "agent.lr", 5e-4),
        ("agent.log_std_min=-1e1", "agent.log_std_min", -10.0),
        ("lowp.init_scale=+6.5e4", "lowp.init_scale", 65000.0),
        ("stop.max_wait_seconds=inf", "stop.max_wait_seconds", float("inf")),
        ("train.env_frames=1e6", "train.env_frames", 1_000_000),
        ("train.env_frames=1.5E3", "train.env_frames", 1500),
        ("train.env_frames=2000.0", "train.env_frames", 2000),
        ("replay.capacity=1e5", "replay.capacity", 100_000),
        ("train.num_threads=2e0", "train.num_threads", 2),  # a nullable integer
    ],
)
def test_ordinary_float_notation_is_a_number(override, key, value):
    """YAML 1.1 reads 1e-3 and 1E6 as strings (it wants a dot and a signed exponent); a key that
    takes a number takes them, and a key that takes an integer takes a whole one."""
    read = OmegaConf.select(load_config([override]), key)
    assert read == value and type(read) is type(value)


@pytest.mark.parametrize(
    "override,fragment",
    [
        ("train.env_frames=1.5", "train.env_frames=1.5 has the wrong type; it takes an integer"),
        ("train.env_frames=2.5e0", "train.env_frames='2.5e0' is not a whole number; it takes an integer"),
        ("train.env_frames=1e-3", "is not a whole number"),
        ("train.env_frames=inf", "train.env_frames='inf' is not a whole number"),
        ("train.env_frames=1e20", "train.env_frames=1e20 is too large: integers stop at 2^63 - 1"),
        ("train.env_frames=100000000000000000000", "is too large: integers stop at 2^63 - 1"),
        ("agent.lr=1e400", "agent.lr=1e400 is too large for a number (the largest is about 1.8e308)"),
        ("agent.lr=" + "9" * 400, "is too large for a number (the largest is about 1.8e308)"),
        ("agent.lr=" + "7" * 100_000, "agent.lr=7777777777... (100,000 digits) is too long to be a number"),
        ("agent.lr=1e3x", "agent.lr='1e3x' has the wrong type; it takes a number"),
        ("train.eval_episodes=0", "train.eval_episodes=0 must be positive"),
        ("train.updates_per_step=1000000", "train.updates_per_step=1000000 is more than 1024 updates per agent step"),
    ],
)
def test_numbers_that_are_no_setting_are_one_line(override, fragment):
    with pytest.raises(ConfigError) as info:
        load_config([override])
    assert fragment in str(info.value) and "\n" not in str(info.value)
    assert len(str(info.value)) < 300


def test_numbers_in_yaml_files_are_read_as_written(tmp_path):
    """A conf/ folder of one's own (PIXELSAC_CONF), its task and preset files: 1e-3 and 1e6 are
    numbers there too, whole numbers where an integer is asked for."""
    conf = _conf_copy(tmp_path)
    (conf / "preset" / "mine.yaml").write_text(
        "agent:\n  lr: 1e-3\n  batch_size: 1.28E2\ntrain:\n  env_frames: 1e6\n  progress_every_seconds: inf\n"
    )
    (conf / "task" / "walker_walk.yaml").write_text("env:\n  action_repeat: 2e0\n")
    cfg = load_config(["preset=mine", "task=walker_walk"], conf=conf)
    assert cfg.agent.lr == 1e-3 and cfg.agent.batch_size == 128 and isinstance(cfg.agent.batch_size, int)
    assert cfg.train.env_frames == 1_000_000 and cfg.env.action_repeat == 2
    assert cfg.train.progress_every_seconds == float("inf")
    (conf / "preset" / "long.yaml").write_text("agent:\n  lr: " + "7" * 100_000 + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(["preset=long"], conf=conf)
    assert "long.yaml" in str(info.value) and "\n" not in str(info.value) and len(str(info.value)) < 300


def _conf_copy(tmp_path):
    import shutil

    from pixelsac.config import conf_dir

    return shutil.copytree(conf_dir(), tmp_path / "conf")


def test_a_key_given_twice_on_the_command_line_is_refused_naming_both():
    from pixelsac.config import check_each_key_once

    check_each_key_once(["agent.lr=1e-3", "agent.batch_size=8"])
    with pytest.raises(ConfigError) as info:
        check_each_key_once(["agent.lr=1e-3", "seed=2", " agent.lr =2e-3"])
    assert str(info.value) == ("agent.lr is given twice: 'agent.lr=1e-3' and ' agent.lr =2e-3'; give each key once")


def test_a_key_given_twice_in_a_yaml_file_is_refused_naming_both_lines(tmp_path):
    conf = _conf_copy(tmp_path)
    (conf / "preset" / "twice.yaml").write_text("agent:\n  lr: 1e-3\n  batch_size: 64\n  lr: 3e-4\n")
    with pytest.raises(ConfigError) as info:
        load_config(["preset=twice"], conf=conf)
    message = str(info.value)
    assert message.endswith("twice.yaml: agent.lr is given twice (lines 2 and 4); keep one") and "\n" not in message
    (conf / "preset" / "groups.yaml").write_text(
        "agent:\n  lr: 1e-3\ntrain:\n  env_frames: 10\nagent:\n  batch_size: 4\n"
    )
    with pytest.raises(ConfigError, match=re.escape("groups.yaml: agent is given twice (lines 1 and 5); keep one")):
        load_config(["preset=groups"], conf=conf)


def test_entry_point_options_take_ordinary_numbers_and_each_key_once(tmp_path):
    (tmp_path / "tool.yaml").write_text("episodes: 10\nscale: 1.0\n")
    assert load_options("tool", ["episodes=1e1", "scale=1e-2"], conf=tmp_path) == {"episodes": 10, "scale": 0.01}
    with pytest.raises(ConfigError, match=re.escape("episodes is given twice: 'episodes=2' and 'episodes=3'")):
        load_options("tool", ["episodes=2", "episodes=3"], conf=tmp_path)


@pytest.mark.parametrize(
    "override,fragment",
    [
        ("task=" + "a" * 120_000, "task='aaaaaaaaa... (120,002 characters) must be a task name such as cheetah_run"),
        ("task=../../etc/passwd", "task='../../etc/passwd' must be a task name"),
        ("preset=" + "p" * 120_000, "unknown preset 'ppppppppp... (120,002 characters)"),
        ("run_dir=a\x1b[31mred", "run_dir=... holds the control character '\\x1b' at position 1 of its value"),
        ("run_dir=runs/a\nb", "run_dir=... holds the control character '\\n' at position 6 of its value"),
        ("agent\x1b.lr=1", "agent\\x1b.lr=... holds the control character '\\x1b' at position 5 of its key"),
    ],
)
def test_names_and_paths_that_cannot_be_are_one_short_line(override, fragment):
    """A 120 KB task name was looked up as a file (exit 74, "File name too long", echoing all of
    it); a run_dir with ESC or a newline was accepted and echoed raw to the terminal."""
    with pytest.raises(ConfigError) as info:
        load_config([override])
    line = str(info.value)
    assert line.startswith(fragment) and "\n" not in line and "\x1b" not in line and len(line) < 300, line[:300]
