"""What ``pixelsac-train`` does with its arguments before any heavy library loads.

* :func:`usage`: ``--help`` -- the entry point's text, then every group and key of
  ``conf/config.yaml`` with its default and meaning (:mod:`pixelsac.config_keys`).
* :func:`split_print_config`: the dry run. ``--print-config`` (or ``print_config=true``) makes the
  command print the composed, validated configuration as YAML and exit 0, writing nothing, once
  the sizes a run checks before it starts pass (:func:`pixelsac.run.check_dry_run`).
* :func:`check_early`: a new run's overrides are composed and validated here, before dm_control,
  torch or Lightning are imported, so a mistyped key or a wrong type answers in a second. What
  needs those libraries (the task name against the dm_control suite, a checkpoint to resume)
  is checked afterwards, as before.

Imports: the standard library, :mod:`pixelsac.config` and :mod:`pixelsac.config_keys` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omegaconf import OmegaConf

from pixelsac.config import ConfigError, check_each_key_once, conf_dir, load_config, parse_overrides
from pixelsac.config_keys import help_text

PRINT_FLAG = "--print-config"
PRINT_KEY = "print_config"


def usage(text: str) -> str:
    """``text`` (the entry point's docstring) followed by the list of keys."""
    return (
        f"{text.rstrip()}\n\n"
        f"{PRINT_FLAG} (or {PRINT_KEY}=true) prints the composed, validated configuration and exits without "
        "running or writing anything, after the size checks a run makes before it starts.\n\n"
        "Keys (conf/config.yaml; every one with its full meaning: docs/configuration.md):\n\n"
        f"{help_text(conf_dir() / 'config.yaml')}\n"
    )


def split_print_config(argv: Sequence[str]) -> tuple[list[str], bool]:
    """``argv`` without the dry-run request, and whether it was there. ``print_config`` takes true
    or false; anything else is a one-line ConfigError."""
    rest, wanted = [], False
    for arg in argv:
        if arg == PRINT_FLAG:
            wanted = True
        elif arg.partition("=")[0].strip() == PRINT_KEY:
            value = parse_overrides([arg])[PRINT_KEY]
            if not isinstance(value, bool):
                raise ConfigError(f"{PRINT_KEY}={value!r} has the wrong type; it takes true or false")
            wanted = wanted or value
        else:
            rest.append(arg)
    return rest, wanted


def check_early(argv: Sequence[str]) -> None:
    """Compose and validate a new run's configuration from ``argv`` without the task list (which
    needs dm_control); raises :class:`ConfigError` on the first problem. A key given twice is
    refused for every command; a ``resume=`` command is otherwise checked against its checkpoint
    later (its keys and limits differ), so it is left alone here."""
    check_each_key_once(argv)
    if "resume" not in parse_overrides(argv):
        load_config(argv)


def render(cfg: Any) -> str:
    """The configuration as the YAML a run directory's ``config.yaml`` holds."""
    return OmegaConf.to_yaml(cfg, resolve=True)
