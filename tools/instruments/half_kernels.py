"""Per layer of the DrQ agent: the CPU's own fp16/bf16 kernels against the fp32-accumulated
emulation (``lowp.fp32_accumulate``) and both against float64.

For each layer type at DrQ's sizes (the trunk's stride-2 and stride-1 convolutions, the
projection, a hidden layer and a Q output of the heads) the same fp16/bf16 inputs, weights and
output gradient go through (a) the CPU's native kernels, (b) the emulation and (c) float64 on the
same rounded values. Every output and gradient (input, weight, bias) is compared in units of the
dtype's spacing at the float64 value (ulps): max and mean. A kernel that accumulates in fp32 and
rounds once stays within about half an ulp of float64 (more only where a sum nearly cancels);
one that accumulates in the low precision itself drifts many ulps away.

    python tools/instruments/half_kernels.py --dtype bf16 --out docs/results/half_kernels/bf16

Prints a markdown table (and writes ``OUT.md`` / ``OUT.json``); the native kernels' time is
reported beside the emulation's (one run, not a benchmark).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pixelsac.lowp import fp32_accumulate
from pixelsac.precision import native_half_kernels

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/
from table_files import write_table_files  # noqa: E402

#: name -> (input shape, weight shape, conv stride or None for a linear layer); batch first
LAYERS = {
    "conv 3x3 stride 2 (9 -> 32, 84x84)": ((4, 9, 84, 84), (32, 9, 3, 3), 2),
    "conv 3x3 stride 1 (32 -> 32, 41x41)": ((4, 32, 41, 41), (32, 32, 3, 3), 1),
    "linear projection (39,200 -> 50)": ((64, 39200), (50, 39200), None),
    "linear hidden (1,024 -> 1,024)": ((64, 1024), (1024, 1024), None),
    "linear Q output (1,024 -> 1)": ((64, 1024), (1, 1024), None),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def ulps(value: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|value - reference| in units of ``dtype``'s spacing at ``reference``."""
    info = torch.finfo(dtype)
    exponent = torch.floor(torch.log2(reference.abs().clamp_min(info.smallest_normal)))
    return (value.double() - reference).abs() / torch.pow(2.0, exponent) / info.eps


def run_layer(stride: int | None, leaves: list[torch.Tensor], grad: torch.Tensor, emulate: bool) -> list[torch.Tensor]:
    x, w, b = (t.detach().clone().requires_grad_(True) for t in leaves)
    with fp32_accumulate() if emulate else torch.enable_grad():
        out = F.linear(x, w, b) if stride is None else F.conv2d(x, w, b, stride=stride)
    out.backward(grad)
    return [out.detach(), x.grad, w.grad, b.grad]


def compare(dtype: torch.dtype, seed: int = 0) -> list[dict]:
    rows = []
    for name, (x_shape, w_shape, stride) in LAYERS.items():
        g = torch.Generator().manual_seed(seed)
        fan_in = w_shape[1] * (w_shape[2] * w_shape[3] if len(w_shape) == 4 else 1)
        leaves = [
            torch.rand(x_shape, generator=g).to(dtype),  # post-ReLU / pixel-like inputs in [0, 1)
            (torch.randn(w_shape, generator=g) / fan_in**0.5).to(dtype),
            (torch.randn(w_shape[0], generator=g) * 0.1).to(dtype),
        ]
        with torch.no_grad():
            x, w, b = (t.float() for t in leaves)
            shape = (F.linear(x, w, b) if stride is None else F.conv2d(x, w, b, stride=stride)).shape
        grad = torch.randn(shape, generator=g).to(dtype)
        start = time.perf_counter()
        native = run_layer(stride, leaves, grad, emulate=False)
        native_s = time.perf_counter() - start
        start = time.perf_counter()
        emulated = run_layer(stride, leaves, grad, emulate=True)
        emulated_s = time.perf_counter() - start
        reference = run_layer(stride, [t.double() for t in leaves], grad.double(), emulate=False)
        for what, n, e, r in zip(("output", "input grad", "weight grad", "bias grad"), native, emulated, reference):
            native_vs_emulated = ulps(n, e.double(), dtype)
            native_vs_64, emulated_vs_64 = ulps(n, r, dtype), ulps(e, r, dtype)
            rows.append(
                {
                    "layer": name,
                    "tensor": what,
                    "native_vs_emulated_max": float(native_vs_emulated.max()),
                    "native_vs_emulated_mean": float(native_vs_emulated.mean()),
                    "native_vs_float64_max": float(native_vs_64.max()),
                    "native_vs_float64_mean": float(native_vs_64.mean()),
                    "emulated_vs_float64_max": float(emulated_vs_64.max()),
                    "emulated_vs_float64_mean": float(emulated_vs_64.mean()),
                    "native_seconds": native_s,
                    "emulated_seconds": emulated_s,
                }
            )
    return rows


def markdown(rows: list[dict], dtype_name: str, kernels: str) -> str:
    lines = [
        f"{dtype_name} per layer, in {dtype_name} ulps (max / mean); native kernels on this CPU: {kernels}; "
        f"torch {torch.__version__}, one thread",
        "",
        "| layer | tensor | native vs emulated | native vs float64 | emulated vs float64 | native s | emulated s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layer']} | {r['tensor']} | {r['native_vs_emulated_max']:.3g} / {r['native_vs_emulated_mean']:.3g} "
            f"| {r['native_vs_float64_max']:.3g} / {r['native_vs_float64_mean']:.3g} "
            f"| {r['emulated_vs_float64_max']:.3g} / {r['emulated_vs_float64_mean']:.3g} "
            f"| {r['native_seconds']:.2f} | {r['emulated_seconds']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--out", type=Path, default=None, help="write OUT.md and OUT.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dtype = DTYPES[args.dtype]
    kernels = native_half_kernels(dtype) or "none (torch's reference kernels)"
    rows = compare(dtype)
    table = markdown(rows, args.dtype, kernels)
    print(table)
    if args.out:
        data = {"kernels": kernels, "torch": torch.__version__, "rows": rows}
        write_table_files(args.out, "instruments/half_kernels.py", argv, table, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
