"""Where a scaled backward comes closest to the 16-bit range, against what the loss scaler sees.

Headroom growth (``lowp.headroom_growth``) raises a loss scale ``S`` as far as the largest scaled
weight gradient ``max|S·g|`` of the last interval leaves room for. The backward forms other
gradients on its way -- of activations, of intermediate values -- and where one of those is
larger, its overflow turns the weight gradients inf and the step is skipped although no weight
gradient was near the range. So the premise holds for a loss when the ratio below is near 1.

For a run's ``last.ckpt`` and the replay saved beside it, this computes each loss (critic, actor,
temperature) on real batches as the run computes them (its dtype and precision policy, the same
augmentation shifts and policy noise as ``tools/fidelity.py grad``), backs each one up at the
run's own loss scale, and reports per loss over the batches: the loss's dtype and scale, the
largest scaled weight gradient, the largest gradient in the run's 16-bit dtype formed anywhere in
the backward (every autograd node's gradients with respect to its inputs), their ratio and the
node that formed it.

    python tools/instruments/backward_peaks.py RUN_DIR --batches 8 [--out OUT]

Writes ``OUT.md`` and ``OUT.json`` when ``--out`` is given. Needs a 16-bit run with loss scaling.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pixelsac.module import LOSSES, SACModule

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/
from judges.common import RunUnreadable, load_run, losses, run_scales  # noqa: E402
from table_files import write_table_files  # noqa: E402


def _graph_nodes(root: Any) -> list[Any]:
    """Every autograd node that ``root`` (a loss's ``grad_fn``) reaches."""
    seen, stack, nodes = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        stack.extend(parent for parent, _ in node.next_functions)
    return nodes


def backward_peaks(
    loss: torch.Tensor, params: list[torch.Tensor], scale: float, dtype: torch.dtype
) -> tuple[float, float, str]:
    """Back up ``scale·loss`` into ``params``; return the largest ``|S·g|`` of their gradients, the
    largest gradient of ``dtype`` that any node formed, and that node's name."""
    largest: dict[str, float] = {}

    def hook_for(node_name: str) -> Any:
        def hook(grad_inputs: tuple, _grad_outputs: tuple) -> None:
            for grad in grad_inputs:
                if grad is not None and grad.dtype == dtype and grad.numel():
                    largest[node_name] = max(largest.get(node_name, 0.0), float(grad.detach().abs().max()))

        return hook

    handles = [node.register_hook(hook_for(node.name())) for node in _graph_nodes(loss.grad_fn)]
    try:
        for param in params:
            param.grad = None
        torch.autograd.backward(loss * scale, inputs=params, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    weight_peak = max(float(p.grad.detach().abs().max()) for p in params if p.grad is not None)
    node, peak = max(largest.items(), key=lambda item: item[1]) if largest else ("-", 0.0)
    return weight_peak, peak, node


def loss_peaks(
    module: SACModule, batch: dict[str, torch.Tensor], seed: int, scales: dict[str, float]
) -> dict[str, dict[str, Any]]:
    """Per loss: its dtype, the weight peak, the backward's peak and where it formed."""
    dtype = module.precision_policy.param_dtype
    result = {}
    for name, (loss, params) in losses(module, batch, seed).items():
        weight_peak, peak, node = backward_peaks(loss, list(params.values()), scales[name], dtype)
        result[name] = {"loss_dtype": str(loss.dtype).replace("torch.", ""), "weight_peak": weight_peak,
                        "backward_peak": peak, "node": node}  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write OUT.md and OUT.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    try:
        module, replay, checkpoint = load_run(args.run_dir)
    except RunUnreadable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not module.precision_policy.loss_scaling:
        print(f"error: {args.run_dir} was trained without loss scaling; nothing to compare", file=sys.stderr)
        return 2
    scales = run_scales(checkpoint)
    dtype = module.precision_policy.param_dtype
    largest = torch.finfo(dtype).max
    rng = np.random.default_rng(args.seed)
    batch_size = module.cfg.agent.batch_size
    per_batch = [loss_peaks(module, replay.sample(batch_size, rng), b, scales) for b in range(args.batches)]
    rows = []
    for name in LOSSES:
        found = [batch[name] for batch in per_batch]
        worst = max(found, key=lambda r: r["backward_peak"] / max(r["weight_peak"], 1e-30))
        rows.append({
            "loss": name,
            "loss_dtype": found[0]["loss_dtype"],
            "scale": scales[name],
            "weight_peak": max(r["weight_peak"] for r in found),
            "backward_peak": max(r["backward_peak"] for r in found),
            "largest_ratio": worst["backward_peak"] / max(worst["weight_peak"], 1e-30),
            "node": max(found, key=lambda r: r["backward_peak"])["node"],
        })  # fmt: skip
    info = checkpoint.get("pixelsac", {})
    lines = [
        f"{args.run_dir.name}: {module.precision_policy.mode}, {info.get('updates')} updates, {args.batches} replay "
        f"batches at the run's loss scales; peaks as a fraction of {str(dtype).replace('torch.', '')}'s largest "
        f"value ({largest:g})",
        "",
        "| loss | loss dtype | S | largest \\|S·g\\| of a weight | largest gradient in the backward | "
        "largest ratio in a batch | formed by |",
        "|---|---|---|---|---|---|---|",
    ] + [
        f"| {r['loss']} | {r['loss_dtype']} | {r['scale']:g} | {r['weight_peak'] / largest:.4f} "
        f"| {r['backward_peak'] / largest:.4f} | {r['largest_ratio']:.2f} | {r['node']} |"
        for r in rows
    ]
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        write_table_files(args.out, "instruments/backward_peaks.py", argv, table, {"rows": rows, "dtype_max": largest})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
