"""FLOPs of one update of the configured agent at several batch sizes, and what a time per update
asks of the hardware (``pixelsac/perf/flops.py``: convolutions and matmuls, forward and backward).

    python tools/instruments/update_flops.py --batch-sizes 128,512 --ms 3,6 task=cartpole_swingup
    python tools/instruments/update_flops.py --batch-sizes 512 --measured "512:16.4:fp16, CUDA graphs" \\
        --out docs/results/update_flops/drq task=cartpole_swingup

``key=value`` arguments are the training configuration's (``conf/config.yaml``). ``--ms`` adds a
column per time: the TFLOP/s an update of that many ms sustains. ``--measured BATCH:MS:LABEL``
(repeatable) turns a time measured elsewhere into the rate it sustained. Counted on this CPU in a
few seconds; no GPU needed. Prints a markdown table (and writes ``OUT.md`` / ``OUT.json``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/
from table_files import write_table_files  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _measured(text: str) -> tuple[int, float, str]:
    batch, ms, label = text.split(":", 2)
    return int(batch), float(ms), label


def count(overrides: list[str], batch_sizes: list[int]) -> tuple[dict[int, Any], tuple[int, ...], int]:
    """:class:`~pixelsac.perf.flops.UpdateFlops` per batch size (counted once, scaled to each),
    the observation shape, the action size."""
    from pixelsac import cli
    from pixelsac.config import load_config, to_plain
    from pixelsac.perf.flops import count_update_flops

    cfg = load_config(overrides)
    obs_shape, action_dim, _, _ = cli.task_shapes(cfg)
    flops = count_update_flops(to_plain(cfg), obs_shape, action_dim)
    return {batch: flops.at_batch(batch) for batch in batch_sizes}, obs_shape, action_dim


def table(flops: dict[int, Any], ms: list[float], measured: list[tuple[int, float, str]]) -> str:
    header = "| batch | GFLOP full | GFLOP critic-only | GFLOP per update (cycle mean) "
    header += "| conv fwd / conv bwd / matmul, full |"
    rule = "|---|---|---|---|---|"
    for each in ms:
        header += f" TFLOP/s at {each:g} ms |"
        rule += "---|"
    lines = [header, rule]
    for batch, f in flops.items():
        by_op = f.full_by_op
        matmul = sum(n for op, n in by_op.items() if op in ("mm", "addmm", "bmm"))
        share = " / ".join(
            f"{100 * n / f.full:.1f}%"
            for n in (by_op.get("convolution", 0), by_op.get("convolution_backward", 0), matmul)
        )
        row = f"| {batch} | {f.full / 1e9:,.1f} | {f.critic_only / 1e9:,.1f} | {f.gflop_per_update:,.1f} | {share} |"
        row += "".join(f" {f.achieved_tflops(each):,.1f} |" for each in ms)
        lines.append(row)
    if measured:
        lines += ["", "| measured | batch | ms per update | TFLOP/s sustained |", "|---|---|---|---|"]
        for batch, each, label in measured:
            rate = flops[batch].achieved_tflops(each) if batch in flops else float("nan")
            lines.append(f"| {label} | {batch} | {each:g} | {rate:,.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=_ints, default=[128, 512])
    parser.add_argument("--ms", type=_floats, default=[], help="times per update to turn into TFLOP/s")
    parser.add_argument("--measured", type=_measured, action="append", default=[], metavar="BATCH:MS:LABEL")
    parser.add_argument("--out", type=Path, help="write OUT.md and OUT.json")
    args, overrides = parser.parse_known_args(argv)
    os.environ.setdefault("MUJOCO_GL", "disable")  # the task's shapes only: nothing is rendered
    for batch, _, label in args.measured:
        if batch not in args.batch_sizes:
            parser.error(f"--measured {label!r} is at batch {batch}, not one of --batch-sizes")
    from pixelsac import cli

    # an unknown key or task: one line and exit 2, as the package's own commands do
    return cli.run_command(lambda _: _write(args, overrides, argv), overrides, __doc__ or "")


def _write(args: argparse.Namespace, overrides: list[str], argv: list[str] | None) -> int:
    flops, obs_shape, action_dim = count(overrides, args.batch_sizes)
    text = (
        f"Observations {'x'.join(map(str, obs_shape))}, {action_dim} action(s); configuration: "
        f"{' '.join(overrides) or 'the defaults'}.\n\n" + table(flops, args.ms, args.measured)
    )
    print(text, end="")
    if args.out:
        data = {
            "obs_shape": obs_shape,
            "action_dim": action_dim,
            "overrides": overrides,
            "flops": {
                batch: {
                    "full": f.full,
                    "critic_only": f.critic_only,
                    "per_update": f.per_update,
                    "full_by_op": f.full_by_op,
                }
                for batch, f in flops.items()
            },
            "measured": [{"batch": b, "ms": m, "label": label} for b, m, label in args.measured],
        }
        write_table_files(args.out, "instruments/update_flops.py", argv, text, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
