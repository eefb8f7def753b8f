"""The console scripts and what pixelsac-train does before the heavy imports: ``--help`` lists
the keys, ``--print-config`` is a dry run that writes nothing, a mistyped key is refused before
dm_control or torch are imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, cli_env, run_cli

from pixelsac import config_keys
from pixelsac.cli import split_print_config
from pixelsac.config import ConfigError


def _scripts() -> dict[str, str]:
    """pyproject's ``[project.scripts]`` table (read by hand: tomllib is Python 3.11+)."""
    section = (REPO / "pyproject.toml").read_text().split("[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    pairs = (line.split("=", 1) for line in section.splitlines() if "=" in line)
    return {name.strip(): value.strip().strip('"') for name, value in pairs}


SCRIPTS = _scripts()


def test_pyproject_declares_the_three_console_scripts():
    assert SCRIPTS == {
        "pixelsac-train": "pixelsac.cli:train",
        "pixelsac-evaluate": "pixelsac.cli:evaluate",
        "pixelsac-bench": "pixelsac.cli:bench",
    }


def _wrapper(tmp_path: Path, name: str) -> Path:
    """The launcher pip writes for a ``[project.scripts]`` entry, for this interpreter."""
    module, _, func = SCRIPTS[name].partition(":")
    script = tmp_path / name
    script.write_text(
        f"#!{sys.executable}\nimport sys\nfrom {module} import {func}\n"
        f"if __name__ == '__main__':\n    sys.exit({func}())\n"
    )
    script.chmod(0o755)
    return script


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_console_script_help_exits_0(tmp_path, name):
    result = subprocess.run(
        [str(_wrapper(tmp_path, name)), "--help"],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert name in result.stdout  # the usage shows the command as the user types it
    assert "python -m" not in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_train_help_lists_every_group_and_key_with_its_meaning(capsys):
    from pixelsac.train import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    keys = config_keys.read_keys(REPO / "conf" / "config.yaml")
    assert len(keys) > 90
    for key in keys:
        shown = f"{key.name}.*" if key.is_group else f"{key.name}={key.default_text}"
        line = next((line for line in out.splitlines() if line.strip().startswith(shown)), None)
        assert line is not None, key.name
        assert key.summary and key.summary[:20] in line, key.name
    assert "--print-config" in out


def test_print_config_prints_the_composed_config_and_writes_nothing(tmp_path):
    result = run_cli("preset=tiny", "agent.batch_size=16", "--print-config", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    import yaml

    printed = yaml.safe_load(result.stdout)
    assert printed["task"] == "cartpole_swingup"  # from the preset
    assert printed["env"]["image_size"] == 48 and printed["agent"]["batch_size"] == 16  # preset, then CLI
    assert list(tmp_path.iterdir()) == []


def test_print_config_still_validates(tmp_path, monkeypatch, capsys):
    from pixelsac.train import main

    monkeypatch.chdir(tmp_path)
    assert main(["print_config=true", "agent.batch_size=-1"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "override,message",
    [
        ("replay.capacity=100000000000000", "error: replay.capacity=100,000,000,000,000 needs "),
        ("env.num_envs=100000", "error: env.num_envs=100,000 is more environment workers than this machine holds"),
        ("env.image_size=100000", "error: render size 100000 exceeds the offscreen buffer"),
        ("train.env_frames=100", "error: train.env_frames=100 ends within the random seed phase"),
    ],
)
def test_print_config_refuses_what_the_run_refuses(tmp_path, monkeypatch, capsys, override, message):
    """The dry run checks the sizes the run checks before it allocates (it printed and exited 0)."""
    from pixelsac.train import main

    monkeypatch.chdir(tmp_path)
    assert main(["preset=tiny", override, "--print-config"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(message) and captured.out == ""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag", ["--print-config", "--help"])
def test_a_conf_folder_that_is_not_there_is_one_line(tmp_path, monkeypatch, capsys, flag):
    """PIXELSAC_CONF naming no conf folder: one line, exit 2 (a FileNotFoundError traceback before)."""
    from pixelsac.train import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIXELSAC_CONF", str(tmp_path / "nonexistent"))
    assert main(["preset=tiny", flag]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: PIXELSAC_CONF=") and "holds no config.yaml" in err and err.count("\n") == 1


def test_split_print_config():
    assert split_print_config(["a=1", "--print-config"]) == (["a=1"], True)
    assert split_print_config(["print_config=true", "b=2"]) == (["b=2"], True)
    assert split_print_config(["print_config=false"]) == ([], False)
    with pytest.raises(ConfigError, match="print_config"):
        split_print_config(["print_config=maybe"])


# the training command as a process, then which heavy libraries it had imported when it answered
MAIN_THEN_MODULES = """
import runpy, sys
sys.argv = ["pixelsac.train", *sys.argv[1:]]
try:
    runpy.run_module("pixelsac.train", run_name="__main__", alter_sys=True)
finally:
    print(sorted(m for m in ("dm_control", "torch", "lightning", "mujoco") if m in sys.modules))
"""


@pytest.mark.parametrize(
    "args,message",
    [
        (["agent.batchsize=256"], "unknown key 'agent.batchsize' (did you mean 'agent.batch_size'?)"),
        (["agent.batch_size=big"], "agent.batch_size='big' has the wrong type"),
        (["preset=tinny"], "unknown preset 'tinny'"),
    ],
)
def test_a_typo_answers_before_dm_control_or_torch_are_imported(tmp_path, args, message):
    result = subprocess.run(
        [sys.executable, "-c", MAIN_THEN_MODULES, *args],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("error: ") and message in result.stderr and result.stderr.count("\n") == 1
    assert result.stdout.strip() == "[]"
    assert list(tmp_path.iterdir()) == []
