"""pixelsac/cli.py: what the entry points share -- exit codes and one-line errors, device choice,
env settings from a configuration (old checkpoints' too), the output-folder refusal."""

from __future__ import annotations

import pytest
import torch

from pixelsac import cli
from pixelsac.checkpoint import CheckpointError
from pixelsac.config import ConfigError, load_config, to_plain
from pixelsac.envs import EnvError
from pixelsac.precision import NumericalFailure


@pytest.mark.parametrize(
    "error,code",
    [
        (ConfigError("unknown key 'x'"), cli.EXIT_BAD_INPUT),
        (cli.UsageError("run_dir busy"), cli.EXIT_BAD_INPUT),
        (CheckpointError("truncated"), cli.EXIT_BAD_INPUT),
        (EnvError("no GL"), cli.EXIT_BAD_INPUT),
        (NumericalFailure("non-finite weights", weights_finite=False), cli.EXIT_NUMERICAL_FAILURE),
    ],
)
def test_run_command_maps_errors_to_one_line_and_an_exit_code(capsys, error, code):
    def body(argv):
        raise error

    assert cli.run_command(body, ["a=1"], "usage") == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and str(error) in err


def test_run_command_help_and_success(capsys):
    seen = []
    assert cli.run_command(lambda argv: seen.append(argv) or 0, ["a=1", "b=2"], "the usage") == 0
    assert seen == [["a=1", "b=2"]]
    assert cli.run_command(lambda argv: 1 / 0, ["--help"], "the usage") == 0  # help never runs the body
    assert capsys.readouterr().out.strip() == "the usage"
    with pytest.raises(ZeroDivisionError):  # a bug is not bad input: it keeps its traceback
        cli.run_command(lambda argv: 1 / 0, [], "usage")


def test_resolve_device():
    assert cli.resolve_device("cpu") == torch.device("cpu")
    assert cli.resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match="choose auto, cpu, cuda or cuda:N"):
        cli.resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="torch sees no CUDA device"):
            cli.resolve_device("cuda:0")


def test_env_settings_from_a_config_and_from_an_older_checkpoints():
    config = to_plain(load_config(["env.image_size=48", "env.shadow_size=512"]))
    kwargs = cli.env_kwargs(config)
    assert kwargs["image_size"] == 48 and kwargs["shadow_size"] == 512 and kwargs["obs"] == "pixels"
    del config["env"]["shadow_size"]  # written before the key existed: the model's own map
    assert cli.env_kwargs(config)["shadow_size"] is None
    del config["env"]["frame_stack"]
    with pytest.raises(ConfigError, match="no usable env settings"):
        cli.env_kwargs(config)


def test_output_folders_are_never_clobbered(tmp_path):
    assert cli.check_out_dir(tmp_path / "new", overwrite=False) == tmp_path / "new"
    (tmp_path / "empty").mkdir()
    assert cli.check_out_dir(tmp_path / "empty", overwrite=False) == tmp_path / "empty"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    with pytest.raises(cli.UsageError, match=r"choose another bench.out=\.\.\., pass bench.overwrite=true"):
        cli.check_out_dir(tmp_path / "full", False, "bench.out", overwrite_key="bench.overwrite")
    with pytest.raises(cli.UsageError, match="or resume=R"):
        cli.check_out_dir(tmp_path / "full", False, "run_dir", hint="resume=R")
    assert cli.check_out_dir(tmp_path / "full", overwrite=True) == tmp_path / "full"
    assert (tmp_path / "full" / "x").read_text() == "keep"  # checking writes nothing
