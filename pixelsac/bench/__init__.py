"""Benchmark the update step under each precision mode::

    pixelsac-bench                                   # the configured agent, default modes
    pixelsac-bench agent.batch_size=128 bench.modes=fp32,fp16
    pixelsac-bench bench.batch_sizes=128,512 bench.ablations=true bench.updates=500
    pixelsac-bench bench.channels_last=both bench.compile=both bench.modes=fp32,fp16
    pixelsac-bench bench.sync_free=both bench.batch=all bench.modes=fp32,fp16
    pixelsac-bench agent.batch_size=128 bench.modes=fp32,fp16 bench.emulation_saves=both

Every cell (mode x batch size x speed option) builds the configured agent afresh and times its
real training step (``SACModule.training_step`` under a Lightning Trainer, no environment) on one
synthetic batch of the run's shapes: ``bench.warmup`` untimed updates, then the mean and standard
deviation over ``bench.updates`` timed ones. Reported per cell: ms/update, and memory where it
is spent -- the peak (GPU: ``torch.cuda.max_memory_allocated``; CPU: the fresh process's
resident-set peak above its baseline), on a CPU also the most tensor bytes alive at once in the
first (full) update, the bytes autograd saves for backward in that update (counted with
``saved_tensors_hooks``: exact, the same on any device), and the state (parameters + optimizer
state + target copies, in total and by group) -- each with its ratio to fp32 at the same batch
size; also the replay buffer's bytes per transition; and what one update dispatches in the form a
GPU runs it -- aten ops, dtype casts and host reads per full and per critic-only update, counted
on the cell's device in about a second (``pixelsac/perf/opcount.py``, docs/performance.md); and
the update's FLOPs with the rate the cell's time sustains (``pixelsac/perf/flops.py``).
Results go to ``bench.out`` as bench.csv,
bench.md (which says what each memory figure counts), bench.json and bench.png.

Time: a CPU cell starts in ~10 s and then takes (warm-up + updates) x the update time (the full
DrQ agent's update: about a second at batch 128 on two cores, four times that at 512);
``bench.emulation_saves=both`` adds a cell and an interleaved run per emulated mode. On a CPU the
benchmark prints each cell's expected time before the first one starts. A CPU without native
fp16 kernels runs ``amp`` (fp16 autocast) and ``fp16-native`` on torch's reference fp16 kernels,
tens of times fp32's time: there they run only when ``bench.modes`` names them. ``amp`` stays
fp16 autocast with one GradScaler per optimizer on a CPU too -- the paper's mixed-precision
baseline, not torch's CPU default (bf16) -- so that its rows mean the same on every device; the
``bf16`` rows are a CPU's bf16.

Arguments are ``key=value``. Keys other than ``bench.*`` are the training configuration's
(``conf/config.yaml``: ``agent.*``, ``env.*``, ``lowp.*``, ``task``, ``seed``, ...); each mode
sets ``precision`` and ``lowp.all`` (and one switch for an ablation) over them. ``trainer.*``
keys are not used: the benchmark runs one device (``bench.device``).
"""

from __future__ import annotations

from pixelsac import cli
from pixelsac.bench.plan import OPTIONS_USAGE

USAGE = (__doc__ or "") + OPTIONS_USAGE


def _command(argv: list[str]) -> int:
    from pixelsac.bench.cells import apply_threads, cell_main, run_plan
    from pixelsac.bench.plan import make_plan

    if argv[:1] == ["--cell"] and len(argv) == 2:  # a fresh process measuring one cell
        return cell_main(argv[1])
    plan = make_plan(argv)
    apply_threads(plan.overrides)
    with cli.quiet_lightning():
        run_plan(plan)
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run_command(_command, argv, USAGE)
