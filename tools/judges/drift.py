"""How far each precision mode's weights drift from a float64 run of the same updates.

Every variant starts from the same initial weights (rounded to its dtype) and takes the same
``--updates`` real updates (critic, actor and temperature, target) on the same stream of replay
batches, with the same random draws (augmentation shifts, policy noise: the global seed is reset
before each update). The judge is the fp32 agent's machinery (torch Adam, plain EMA target)
carried out in float64. For each group of weights g the tool reports the relative error of the
displacement::

    err_g = ‖θ_g - θ64_g‖ / ‖θ64_g - θ0_g‖

(0: the variant moved exactly as float64 did; 1: its error is as large as the whole step float64
took). Rewards are drawn in [0, ``--reward-scale``) so that Q values grow as in a run with action
repeat (DrQ's swing-up: up to 8 per agent step), which is what stresses an 8-bit mantissa.

    python tools/fidelity.py drift --updates 1000 --variants fp32,fp16,bf16 \\
        --variant bf16-nokahan-actor="precision=bf16 lowp.kahan_actor=false"

Writes a JSON and a markdown table (``--out``); one thread, so run it beside other work.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from judges.common import flat, float64_policy, make_agent, one_update
from pixelsac.perf import synthetic_batch

PRESET_VARIANTS = {
    "fp32": ["precision=fp32"],
    "fp16": ["precision=fp16"],
    "bf16": ["precision=bf16"],
    "bf16-emulated": ["precision=bf16", "lowp.fp32_accumulate=true"],
    "bf16-native": ["precision=bf16", "lowp.fp32_accumulate=false"],
}
GROUPS = ("critic", "actor", "log_alpha")


def base_overrides(args: argparse.Namespace) -> list[str]:
    return [
        "task=cartpole_swingup",
        "preset=tiny",
        f"agent.batch_size={args.batch}",
        f"env.image_size={args.image}",
        "train.log_every_updates=1000000000",
        "perf.channels_last=false",
    ]


def float64_agent(overrides: list[str]) -> Any:
    """The fp32 agent with every parameter, buffer and optimizer state in float64."""
    module = make_agent([*overrides, "precision=fp32"], OBS_SHAPE, ACTION_DIM)
    module.double()
    inner = getattr(module, "module", module)
    inner.precision_policy = float64_policy(inner.precision_policy)
    return module


def groups(module: Any) -> dict[str, list[torch.Tensor]]:
    inner = getattr(module, "module", module)
    return {
        "critic": list(inner.critic.parameters()),
        "actor": list(inner.actor.parameters()),
        "log_alpha": [inner.log_alpha],
    }


OBS_SHAPE = (9, 48, 48)
ACTION_DIM = 1


def main(argv: list[str] | None = None) -> int:
    global OBS_SHAPE
    parser = argparse.ArgumentParser(prog="tools/fidelity.py drift", description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=1000)
    parser.add_argument("--report-every", type=int, default=250)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--image", type=int, default=48)
    parser.add_argument("--reward-scale", type=float, default=8.0)
    parser.add_argument("--variants", default="fp32,fp16,bf16", help=f"presets: {', '.join(PRESET_VARIANTS)}")
    parser.add_argument("--variant", action="append", default=[], help='NAME="key=value key=value" (repeatable)')
    parser.add_argument("--out", type=Path, default=None, help="write NAME.json and NAME.md with this stem")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    OBS_SHAPE = (9, args.image, args.image)

    variants = {name: PRESET_VARIANTS[name] for name in filter(None, args.variants.split(","))}
    for spec in args.variant:
        name, _, overrides = spec.partition("=")
        variants[name] = overrides.split()
    base = base_overrides(args)
    torch.manual_seed(0)
    judge = float64_agent(base)
    start = {g: flat(t) for g, t in groups(judge).items()}
    agents = {}
    for name, overrides in variants.items():
        torch.manual_seed(0)  # the same initial weights (and target copies) as the judge's, rounded
        agents[name] = make_agent([*base, *overrides], OBS_SHAPE, ACTION_DIM)

    rows: list[dict[str, Any]] = []
    seconds = dict.fromkeys(["float64", *agents], 0.0)
    for step in range(args.updates):
        batch = synthetic_batch(args.batch, OBS_SHAPE, ACTION_DIM, seed=step)
        batch["reward"] = batch["reward"] * args.reward_scale
        for name, agent in [("float64", judge), *agents.items()]:
            torch.manual_seed(1000 + step)
            tick = time.perf_counter()
            one_update(agent, batch)
            seconds[name] += time.perf_counter() - tick
        if (step + 1) % args.report_every == 0 or step + 1 == args.updates:
            reference = {g: flat(t) for g, t in groups(judge).items()}
            for name, agent in agents.items():
                mine = {g: flat(t) for g, t in groups(agent).items()}
                row = {"variant": name, "updates": step + 1}
                for g in GROUPS:
                    moved = float((reference[g] - start[g]).norm())
                    row[g] = float((mine[g] - reference[g]).norm()) / moved if moved > 0 else math.nan
                rows.append(row)
                print(json.dumps(row), flush=True)

    inner = getattr(judge, "module", judge)
    result = {
        "command": "python tools/fidelity.py drift " + " ".join(argv if argv is not None else sys.argv[1:]),
        "variants": variants,
        "base": base,
        "reward_scale": args.reward_scale,
        "float64_q_mean_last": float(inner.metrics.get("q", torch.tensor(math.nan))) if inner.metrics else None,
        "seconds": seconds,
        "rows": rows,
        "torch": torch.__version__,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
        lines = [
            f"Command: `{result['command']}`",
            "",
            "Relative displacement error ‖θ − θ₆₄‖ / ‖θ₆₄ − θ₀‖ per weight group (0 = float64's path).",
            "",
            "| variant | updates | critic | actor | log_alpha |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['variant']} | {r['updates']} | {r['critic']:.4f} | {r['actor']:.4f} | {r['log_alpha']:.4f} |"
            for r in rows
        ]
        args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0
