"""The actor's loss and backward of the full-size DrQ agent, timed side by side in one process:
a plain ``backward()`` (which also computes a weight gradient for every layer of the critic's
projection and Q heads that the actor's loss reads) against ``backward(inputs=...)`` with the
actor's own parameters, as the update does.

For each precision and batch size, one module (84×84 9-channel frames, DrQ's widths) and one
augmented batch; the actor's gradients of both forms are checked equal first. Rounds alternate
the order of the two; the table gives the medians and their ratio.

    python tools/instruments/actor_backward_timing.py --out docs/results/dispatch_cpu/actor_backward_cpu

Prints a markdown table (and writes ``OUT.md`` / ``OUT.json``). Measure with nothing else on
the cores.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from pixelsac.cli import quiet_lightning
from pixelsac.config import load_config, to_plain
from pixelsac.module import SACModule
from pixelsac.perf.calibration import bare_trainer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/
from table_files import write_table_files  # noqa: E402

OBS_SHAPE, ACTION_DIM = (9, 84, 84), 1


def build(precision: str, batch: int) -> tuple[SACModule, torch.Tensor]:
    """A full-size module set up by a Trainer (no update) and one batch of observations as the
    actor's loss reads them."""
    cfg = to_plain(load_config([f"precision={precision}", f"agent.batch_size={batch}"]))
    torch.manual_seed(0)
    with quiet_lightning():
        module = SACModule(cfg, OBS_SHAPE, ACTION_DIM)
        bare_trainer(torch.device("cpu"), []).fit(module, DataLoader([], batch_size=None))
    frames = torch.randint(0, 256, (batch, *OBS_SHAPE), dtype=torch.uint8)
    return module, module.precision_policy.cast_observation(frames)


def actor_backward(module: SACModule, obs: torch.Tensor, own_only: bool) -> float:
    """Seconds for the actor's loss and its backward; gradients cleared first."""
    for param in module.parameters():
        param.grad = None
    start = time.perf_counter()
    with module.precision_policy.compute_context():
        actor_loss, _, _ = module.actor_and_alpha_loss(obs)
    actor_loss.backward(inputs=list(module.actor.parameters()) if own_only else None)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "fp16", "bf16"])
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lines = [
        "| precision | batch | plain backward, ms | own parameters only, ms | ratio |",
        "|---|---|---|---|---|",
    ]
    data = []
    for precision in args.precisions:
        for batch in args.batches:
            module, obs = build(precision, batch)
            grads = []
            for own_only in (False, True):
                torch.manual_seed(1)  # the same policy noise for both
                actor_backward(module, obs, own_only)
                grads.append([p.grad.clone() for p in module.actor.parameters()])
            if not all(torch.equal(a, b) for a, b in zip(*grads)):
                raise SystemExit(f"error: the actor's gradients differ ({precision}, batch {batch})")
            times: dict[bool, list[float]] = {False: [], True: []}
            for round_index in range(args.rounds):
                for own_only in (False, True) if round_index % 2 == 0 else (True, False):
                    times[own_only].append(actor_backward(module, obs, own_only))
            plain, own = (statistics.median(times[flag]) * 1e3 for flag in (False, True))
            lines.append(f"| {precision} | {batch} | {plain:.1f} | {own:.1f} | {own / plain:.2f} |")
            data.append({"precision": precision, "batch": batch, "plain_ms": plain, "own_ms": own})
            print(lines[-1], flush=True)
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        meta = {"threads": args.threads, "rounds": args.rounds, "rows": data}
        write_table_files(args.out, "instruments/actor_backward_timing.py", argv, table, meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
