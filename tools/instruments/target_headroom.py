"""How close a run's critic weights are to the fixed-K ceiling of the published Kahan-momentum.

Kahan-momentum keeps the target critic as ``K·θ̄`` in the parameters' dtype. With the published
single ``K`` (10⁴ by default) no fp16 parameter may exceed ``65504 / K`` = 6.55 in magnitude; the
default adaptive scale gives each tensor its own ``K_i = K·2^k_i`` instead. For every critic
tensor of a checkpoint this prints ``max|θ|``, ``max|θ̄|``, the scale the run uses (``K_i``), the
fraction of the dtype's range that ``K_i·max(|θ|, |θ̄|)`` fills, and whether the published ``K``
would have overflowed (computed in the dtype, as the update computes it: ``K·θ`` not finite).

    python tools/instruments/target_headroom.py RUN_DIR [--checkpoint last|best] [--out OUT]

Writes ``OUT.md`` and ``OUT.json`` when ``--out`` is given.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from pixelsac import checkpoint as ckpt_io
from pixelsac.module import SACModule

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/
from table_files import write_table_files  # noqa: E402


def headroom_rows(module: SACModule) -> list[dict]:
    """One row per critic tensor, largest ``max(|θ|, |θ̄|)`` first."""
    updater = module.target_updater
    policy = module.precision_policy
    scale = float(updater.scale)
    scales = updater.tensor_scales().tolist() if getattr(updater, "compensated", False) else None
    target = dict(zip(updater.param_names, updater.target_parameters()))
    rows = []
    for i, (name, param) in enumerate(module.critic.named_parameters()):
        theta = param.detach()
        theta_bar = target.get(name, theta).detach()
        peak = max(float(theta.abs().max()), float(theta_bar.abs().max()))
        top = torch.finfo(theta.dtype).max if theta.dtype in (torch.float16, torch.bfloat16) else None
        fixed = theta.to(policy.param_dtype)
        published_finite = bool(torch.isfinite(fixed * torch.tensor(scale, dtype=fixed.dtype)).all())
        used = scales[i] if scales is not None else scale
        rows.append(
            {
                "tensor": f"critic.{name}",
                "max_abs_theta": float(theta.abs().max()),
                "max_abs_target": float(theta_bar.abs().max()),
                "scale_used": used,
                "range_filled": peak * used / top if top else None,
                "published_ceiling": top / scale if top else None,
                "published_overflows": not published_finite,
            }
        )
    return sorted(rows, key=lambda r: -max(r["max_abs_theta"], r["max_abs_target"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--checkpoint", choices=("last", "best"), default="last")
    parser.add_argument("--top", type=int, default=8, help="rows to print (largest weights first)")
    parser.add_argument("--out", type=Path, default=None, help="write OUT.md and OUT.json")
    args = parser.parse_args(argv)
    try:
        checkpoint = ckpt_io.load(args.run_dir, prefer=args.checkpoint)
    except (OSError, ckpt_io.CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    module = SACModule.from_checkpoint(checkpoint)
    rows = headroom_rows(module)
    info = checkpoint.get("pixelsac", {})
    policy = module.precision_policy
    lines = [
        f"{args.run_dir.name}: {policy.mode}, {info.get('updates')} updates, {args.checkpoint}.ckpt; "
        f"published K = {module.target_updater.scale:g}",
        "",
        "| tensor | max abs θ | max abs θ̄ | K used | range filled | published ceiling | published K·θ |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows[: args.top]:
        filled = "-" if r["range_filled"] is None else f"{r['range_filled']:.3f}"
        ceiling = "-" if r["published_ceiling"] is None else f"{r['published_ceiling']:.3g}"
        lines.append(
            f"| {r['tensor']} | {r['max_abs_theta']:.4g} | {r['max_abs_target']:.4g} | {r['scale_used']:g} | "
            f"{filled} | {ceiling} | {'overflows' if r['published_overflows'] else 'finite'} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        write_table_files(args.out, "instruments/target_headroom.py", argv, table, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
