"""How faithful a low-precision agent's gradients are, judged by float64, on a real run's state.

Loads a run's ``last.ckpt`` and the replay buffer saved beside it, samples real batches and, for
each batch, computes the critic loss and the actor and temperature losses with their gradients
twice from the same weights, augmentation shifts and policy noise: once as the run computes them
(its dtype, its precision policy) and once in float64 (the weights upcast exactly, the noise
unrounded). Per group of weights it reports the cosine between the two gradients and the
relative error ``‖g - g64‖ / ‖g64‖``, averaged over the batches (and the relative error's median
and largest over them: the actor's gradient is a near-cancelling difference, and on a batch where
it nearly cancels, its relative error can be tens of times the median); the actor's output layer is
split into its mean (μ) rows and its log σ rows. ``--variant`` recomputes the low-precision side
with extra overrides (e.g. ``lowp.fp32_accumulate=false``), from the same weights.

    python tools/fidelity.py grad RUN_DIR --batches 8

``--loss-scale``: the scale each loss's backward runs at. ``largest`` (the default) starts at
2^15 and halves until the batch's gradients are finite, so the comparison measures fp16's
arithmetic, not gradients lost to underflow; ``run`` takes each loss's scale from the
checkpoint's scalers (the scale the run's next step would use); a number fixes it for every
loss. Repeatable: each scale is a contender of its own, so one float64 judge serves a sweep. At a
fixed scale a batch whose gradients overflow is one the run would skip; it is left out of that
row's means and counted in its ``batches`` column.

``--judge-pixels as-run``: the judge reads the pixel values the run reads (``float(k) / 255``
rounded to its dtype, widened exactly) instead of exact ones, so that the comparison measures the
run's arithmetic alone. bf16 holds k/255 only to within half a grey level, a fixed input
transform that the critic and actor both see; ``exact`` (the default) counts it as error too.

The judge is float64 Adam's view of the same step: a group whose cosine falls well below the
others' is where the low precision loses the learning signal.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf
from table_files import write_table_files

from judges.common import RunUnreadable, float64_policy, load_run, losses, run_scales
from pixelsac.config import from_plain, parse_overrides, to_plain
from pixelsac.lowp import all_finite
from pixelsac.module import LOSSES, SACModule


def _scaled_backward(
    loss: torch.Tensor, params: dict[str, torch.Tensor], scale: float, search: bool
) -> dict[str, torch.Tensor]:
    """Gradients of ``loss`` by backward of ``scale·loss``, unscaled in float64. With ``search`` the
    scale halves until every gradient is finite (a dynamic loss scaler's choice for this one
    batch: a power of two, so scaling and unscaling add no rounding of their own); without it the
    gradients are returned as they come, overflow included."""
    while True:
        for p in params.values():
            p.grad = None
        (loss * scale).backward(retain_graph=True)
        grads = {n: p.grad.detach().double() / scale for n, p in params.items()}
        if not search or scale <= 1.0 or all(bool(all_finite(g)) for g in grads.values()):
            return grads
        scale /= 2


def gradients(
    module: SACModule, batch: dict[str, torch.Tensor], seed: int, scales: dict[str, float] | None = None
) -> dict[str, torch.Tensor]:
    """Gradients of the critic loss (critic weights), the actor loss (actor weights) and the
    temperature loss (log α).

    ``scales`` (per loss: ``critic``, ``actor``, ``alpha``) fixes the scale each backward runs at;
    without it, with fp16's loss scaling, each loss is scaled from 2^15 down until its gradients
    are finite (see ``--loss-scale``), and without loss scaling at 1."""
    search = scales is None
    if scales is None:
        scales = dict.fromkeys(LOSSES, 2.0**15 if module.precision_policy.loss_scaling else 1.0)
    module.zero_grad(set_to_none=True)
    grads: dict[str, torch.Tensor] = {}
    for name, (loss, params) in losses(module, batch, seed).items():
        grads.update(_scaled_backward(loss, params, scales[name], search))
    grads["log_alpha"] = grads["log_alpha"].reshape(1)
    return grads


def parse_loss_scale(spec: str) -> str | float:
    """``largest``, ``run`` or a positive number."""
    if spec in ("largest", "run"):
        return spec
    try:
        value = float(spec)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"--loss-scale takes largest, run or a positive number, not {spec!r}")
    return value


def transplant(variant: SACModule, judge: SACModule) -> None:
    """The run's weights into a variant of another precision (other buffers, other target form),
    from the float64 judge's copy: every network parameter cast to the variant's dtype, and the
    target critic θ̄ as the variant keeps it (stored, or as its scaled copy K·θ̄ with a zero
    Kahan buffer), rounded once from float64."""
    with torch.no_grad():
        source = dict(judge.named_parameters())
        for name, param in variant.named_parameters():
            if not name.startswith("critic_target."):
                param.copy_(source[name])
        target = judge.target_updater.target_parameters()
        updater = variant.target_updater
        if updater.derived_target:
            scaled, compensation = updater._buffers_in_order()
            for buffer, value in zip(scaled, target):
                buffer.copy_(value.double() * updater.scale)
            for buffer in compensation:
                buffer.zero_()
            updater.updates_applied.fill_(1)
            updater._fresh = False
        else:
            for param, value in zip(updater.target.parameters(), target):
                param.copy_(value)


def reading_pixels_as(judge_policy: Any, run_policy: Any) -> Any:
    """``judge_policy`` whose observations are ``run_policy``'s, widened exactly to float64."""
    fields = {f.name: getattr(judge_policy, f.name) for f in dataclasses.fields(judge_policy)}

    def cast_observation(self: Any, obs: torch.Tensor) -> torch.Tensor:
        return run_policy.cast_observation(obs).to(torch.float64)

    return type("AsRunPixelsPolicy", (type(judge_policy),), {"cast_observation": cast_observation})(**fields)


def grouped(grads: dict[str, torch.Tensor], module: SACModule) -> dict[str, torch.Tensor]:
    """Flat gradient per group; the actor's output layer split into μ rows and log σ rows."""
    last = [n for n, m in module.actor.policy.named_modules() if isinstance(m, torch.nn.Linear)][-1]
    out_w, out_b = grads.pop(f"actor.policy.{last}.weight"), grads.pop(f"actor.policy.{last}.bias")
    half = out_w.shape[0] // 2
    groups: dict[str, list[torch.Tensor]] = {
        "actor output: mu rows": [out_w[:half], out_b[:half]],
        "actor output: log_std rows": [out_w[half:], out_b[half:]],
    }
    for name, grad in grads.items():
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] in ("critic", "actor") else parts[0]
        groups.setdefault(key, []).append(grad)
    return {k: torch.cat([t.reshape(-1) for t in v]) for k, v in groups.items()}


def _scale_label(spec: str | float, saved: dict[str, float]) -> str:
    if spec == "run":
        return "run's (" + "/".join(f"{saved[name]:g}" for name in LOSSES) + ")"
    return "largest finite" if spec == "largest" else f"{spec:g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/fidelity.py grad", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", action="append", default=[], help='NAME="key=value ..." (repeatable)')
    parser.add_argument(
        "--judge-pixels",
        choices=("exact", "as-run"),
        default="exact",
        help="the float64 judge reads exact pixel values (k/255) or those the run's dtype holds",
    )
    parser.add_argument(
        "--loss-scale",
        action="append",
        type=parse_loss_scale,
        default=None,
        help="largest (default: from 2^15 down until finite), run (the checkpoint's scalers) or a number; repeatable",
    )
    parser.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    args = parser.parse_args(argv)
    loss_scales = args.loss_scale or ["largest"]
    torch.set_num_threads(1)
    try:
        module, replay, checkpoint = load_run(args.run_dir)
    except RunUnreadable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    judge = copy.deepcopy(module).double()
    judge.precision_policy = dataclasses.replace(float64_policy(module.precision_policy), fp32_accumulate=False)
    if args.judge_pixels == "as-run":
        judge.precision_policy = reading_pixels_as(judge.precision_policy, module.precision_policy)
    contenders = {"as trained": module}
    for spec in args.variant:
        name, _, overrides = spec.partition("=")
        config = OmegaConf.create(to_plain(module.cfg))  # the run's config with other numerics
        for key, value in parse_overrides(overrides.split()).items():
            OmegaConf.update(config, key, value)
        config = OmegaConf.to_container(config)
        variant = SACModule(config, module.obs_shape, module.action_dim)
        try:
            variant.load_state_dict(module.state_dict())
        except RuntimeError:  # another precision: other buffers, maybe another target form
            transplant(variant, judge)
        variant.augment.backend = "index"
        contenders[name] = variant
    saved_scales = run_scales(checkpoint)
    runs: dict[str, tuple[SACModule, dict[str, float] | None]] = {}
    for name, contender in contenders.items():
        if not contender.precision_policy.loss_scaling:  # runs at 1, whatever is asked
            runs[name] = (contender, None)
            continue
        for spec in loss_scales:
            scales = None if spec == "largest" else saved_scales if spec == "run" else dict.fromkeys(LOSSES, spec)
            label = name if len(loss_scales) == 1 else f"{name}, S={_scale_label(spec, saved_scales)}"
            runs[label] = (contender, scales)
    rng = np.random.default_rng(args.seed)
    sums: dict[str, dict[str, list[tuple[float, float]]]] = {name: {} for name in runs}
    for b in range(args.batches):
        batch = replay.sample(module.cfg.agent.batch_size, rng)
        reference = grouped(gradients(judge, batch, seed=b), judge)
        for name, (contender, scales) in runs.items():
            mine = grouped(gradients(contender, batch, seed=b, scales=scales), contender)
            for group, g64 in reference.items():
                g = mine[group]
                values = sums[name].setdefault(group, [])
                if not bool(all_finite(g)):
                    continue  # overflowed at this fixed scale: a step the run would skip
                cosine = float(torch.nn.functional.cosine_similarity(g, g64, dim=0))
                rel = float((g - g64).norm() / g64.norm().clamp_min(1e-300))
                values.append((cosine, rel))
    rows = [
        {
            "variant": name,
            "group": group,
            "cosine": float(np.mean([c for c, _ in values])) if values else float("nan"),
            "relative_error": float(np.mean([r for _, r in values])) if values else float("nan"),
            "relative_error_median": float(np.median([r for _, r in values])) if values else float("nan"),
            "relative_error_max": float(np.max([r for _, r in values])) if values else float("nan"),
            "batches": len(values),
        }
        for name, groups in sums.items()
        for group, values in groups.items()
    ]
    frames = checkpoint.get("pixelsac", {}).get("updates")
    lines = [
        f"Run {args.run_dir.name} ({from_plain(module.cfg).precision}, {frames} updates), "
        f"{args.batches} replay batches; gradients against float64 from the same weights, shifts and noise"
        + (", reading the run's pixel values." if args.judge_pixels == "as-run" else "."),
        "",
        "| variant | group | cosine | ‖g − g64‖ / ‖g64‖ | median | max | batches |",
        "|---|---|---|---|---|---|---|",
    ] + [
        f"| {r['variant']} | {r['group']} | {r['cosine']:.5f} | {r['relative_error']:.4f} "
        f"| {r['relative_error_median']:.4f} | {r['relative_error_max']:.4f} | {r['batches']} |"
        for r in rows
    ]
    if saved_scales and any(spec == "run" for spec in loss_scales):
        lines += ["", "The run's loss scales: " + ", ".join(f"{k} {v:g}" for k, v in saved_scales.items()) + "."]
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        write_table_files(args.out, "fidelity.py grad", argv, table, {"rows": rows})
    return 0
