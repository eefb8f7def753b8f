"""DrQ's random shift on this machine: the ``index`` gather, the ``kornia`` backend (kornia's
``remap`` on a map built from the offsets) and kornia's ``translate`` (the ``kornia`` backend
before it built its own map), timed side by side in one process.

For each input dtype and batch size, two augmented copies of a batch of 84×84 9-channel frames
(what an update augments), the same offsets for all three; the outputs are checked equal first.
Rounds alternate the order of the three; the table gives the medians and the ratios to the
gather.

    python tools/instruments/shift_timing.py --out docs/results/aug_shift/shift_cpu

Prints a markdown table (and writes ``OUT.md`` / ``OUT.json``). Measure with nothing else on
the cores.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from kornia.geometry.transform import translate

from pixelsac.augment import RandomShift

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/
from table_files import write_table_files  # noqa: E402

DTYPES = {"uint8": torch.uint8, "fp16": torch.float16, "fp32": torch.float32}


def by_translate(images: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The shift as kornia's ``translate`` by ``(-dx, -dy)`` (nearest, border): the ``kornia``
    backend's former form, kept here as the reference it is measured against."""
    work = images if images.is_floating_point() else images.to(torch.float32)
    moved = translate(
        work, offsets.flip(1).neg().to(work.dtype), mode="nearest", padding_mode="border", align_corners=True
    )
    return moved if moved.dtype == images.dtype else moved.to(images.dtype)


SHIFTS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "index": RandomShift._shift_by_gather,
    "kornia (remap)": lambda images, offsets: RandomShift._shift_by_warp(images, offsets, 4),
    "kornia translate (before)": by_translate,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["uint8", "fp16"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lines = [
        "| input | batch (×2 copies) | "
        + " | ".join(f"{name}, ms" for name in SHIFTS)
        + " | remap ÷ index | translate ÷ index |",
        "|---|---|" + "---|" * (len(SHIFTS) + 2),
    ]
    data = []
    for dtype_name in args.dtypes:
        for batch in args.batches:
            images = torch.randint(0, 256, (2 * batch, 9, 84, 84), dtype=torch.uint8).to(DTYPES[dtype_name])
            offsets = torch.randint(0, 9, (2 * batch, 2)) - 4
            reference = RandomShift._shift_by_gather(images, offsets)
            for name, shift in SHIFTS.items():
                if not torch.equal(shift(images, offsets), reference):
                    raise SystemExit(f"error: {name} differs from the gather ({dtype_name}, batch {batch})")
            times: dict[str, list[float]] = {name: [] for name in SHIFTS}
            for round_index in range(args.rounds):
                order = list(SHIFTS.items())
                for name, shift in order if round_index % 2 == 0 else reversed(order):
                    start = time.perf_counter()
                    shift(images, offsets)
                    times[name].append(time.perf_counter() - start)
            median = {name: statistics.median(values) * 1e3 for name, values in times.items()}
            index, remap, before = median["index"], median["kornia (remap)"], median["kornia translate (before)"]
            lines.append(
                f"| {dtype_name} | {batch} | {index:.0f} | {remap:.0f} | {before:.0f} "
                f"| {remap / index:.2f} | {before / index:.2f} |"
            )
            data.append({"input": dtype_name, "batch": batch, "median_ms": median, "rounds": args.rounds})
            print(lines[-1], flush=True)
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        write_table_files(args.out, "instruments/shift_timing.py", argv, table, {"threads": args.threads, "rows": data})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
