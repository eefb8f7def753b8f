"""Evaluate a trained agent from a checkpoint: returns, a results file and videos::

    pixelsac-evaluate checkpoint=runs/cheetah_run/20260101-120000_fp16_s1
    pixelsac-evaluate checkpoint=run/checkpoints/last.ckpt episodes=20 video=false
    pixelsac-evaluate checkpoint=RUN video_episodes=all agent_view=true out_dir=eval/

Options are ``key=value``; ``conf/evaluate.yaml`` lists each with its default and meaning
(``--help`` prints it). The first episode is filmed unless ``video=false``.

Checkpoints of any precision (fp32, fp16, bf16, amp), written on a GPU or a CPU, evaluate on
either device. A bad option or an unusable checkpoint is reported in one line with exit code 2,
before anything is written.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from pixelsac import cli
from pixelsac.config import ConfigError, load_options, option_lines
from pixelsac.evaluation import EVAL_SEED_OFFSET, EvalOptions, Evaluation, evaluate, load_agent, make_env

__all__ = [
    "EVAL_SEED_OFFSET",
    "EvalOptions",
    "Evaluation",
    "evaluate",
    "load_agent",
    "main",
    "make_env",
    "parse_options",
]

USAGE = (
    (__doc__ or "")
    + "\noptions (conf/evaluate.yaml: name, default, meaning):\n"
    + "\n".join(f"  {line}" for line in option_lines("evaluate").values())
)


#: options that only make sense with video=true
_VIDEO_OPTIONS = ("video_episodes", "video_size", "video_camera", "agent_view")
_DEVICES = "auto, cpu, cuda or cuda:N"


def parse_options(argv: Sequence[str]) -> EvalOptions:
    """Turn ``key=value`` arguments into :class:`EvalOptions`: ``conf/evaluate.yaml`` holds each
    option's default, :func:`pixelsac.config.load_options` checks names, types and bounds;
    :class:`ConfigError` on a mistake."""
    values = load_options(
        "evaluate",
        argv,
        nullable={"checkpoint": str, "seed": int, "video_camera": int, "out_dir": str},
        lower_bounds={"episodes": 1, "video_size": 1, "seed": 0, "video_camera": 0},
        choices={"prefer": ("best", "last"), "arithmetic": ("trained", "fp32", "fp64")},
        verbatim=("checkpoint", "out_dir", "device"),  # paths and names keep their text
        untyped=("video_episodes",),
    )
    if values["checkpoint"] is None:
        raise ConfigError("checkpoint=PATH is required (a .ckpt file or a run directory)")
    device = values["device"]
    if device not in ("auto", "cpu") and not device.startswith("cuda"):
        raise ConfigError(f"device={device!r}; choose {_DEVICES}")
    named = {item.partition("=")[0].strip() for item in argv}  # load_options checked them
    video_options = [key for key in _VIDEO_OPTIONS if key in named]
    if video_options and not values["video"]:  # the default is true: false was asked for
        raise ConfigError(f"video=false contradicts {', '.join(video_options)}; drop one of them")
    values["video_episodes"] = _episode_list(values["video_episodes"], str(values["video_episodes"]))
    options = EvalOptions(**values)
    if options.video_episodes is not None:
        beyond = [e for e in options.video_episodes if e >= options.episodes]
        if beyond:
            raise ConfigError(
                f"video_episodes {beyond} do not exist: episodes=... plays "
                f"{options.episodes} episode(s), numbered 0..{options.episodes - 1}"
            )
    return options


def _episode_list(value: Any, raw: str) -> tuple[int, ...] | None:
    """``0`` / ``0,1`` / ``[0, 1]`` / ``all`` -> episode indices (None: all)."""
    if value == "all":
        return None
    items = value if isinstance(value, list) else [value] if isinstance(value, int) else str(raw).split(",")
    try:
        indices = [int(str(item).strip()) for item in items]
    except ValueError:
        indices = [-1]
    if not indices or any(i < 0 for i in indices):
        raise ConfigError(f"video_episodes={raw!r}; give episode numbers from 0 (e.g. 0,1) or all")
    return tuple(sorted(set(indices)))


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: 0 on success, 2 with one ``error: ...`` line on bad input."""

    def body(args: list[str]) -> int:
        evaluate(parse_options(args))
        return 0

    return cli.run_command(body, argv, USAGE)


if __name__ == "__main__":
    from pixelsac import allocator

    allocator.configure()  # glibc malloc keeps large freed buffers, as under make (pixelsac/allocator.py)
    sys.exit(main())
