"""CUDA-graph updates (perf.cuda_graphs): the bookkeeping around capture and replay on a CPU, the
configurations that cannot be captured, and (on a GPU only) real graphs against eager updates.

On a CPU a stand-in runner "replays" by calling the recorded function again with the same static
tensors -- what a replay does, minus the GPU -- so the static-batch copies, the losses handed to
logging and the loss scalers' host-side counting are checked against plain eager updates.
"""

import subprocess
import sys

import pytest
import torch
from conftest import REPO
from dispatch_count import DispatchCount
from test_module import fit, make_batch, make_module, mode

from pixelsac.config import load_config
from pixelsac.graphs import UpdateGraphs, graph_conflicts


class ReplayByCalling:
    """Stand-in for GraphRunner: capture keeps the function, replay calls it."""

    def __init__(self) -> None:
        self.captured, self.replays, self.eager_runs = 0, 0, 0

    def eager(self, fn):
        self.eager_runs += 1
        return fn()

    def capture(self, fn):
        self.captured += 1
        return fn

    def replay(self, graph):
        self.replays += 1
        graph()


SYNC_FREE = ["perf.sync_free=true", "perf.aug_backend=index", "lowp.growth_interval=3", "train.log_every_updates=5"]


@pytest.mark.parametrize("precision", ["fp16", "fp16-six", "fp32"])
def test_replayed_updates_equal_eager_updates(precision):
    batches = [make_batch(seed=i) for i in range(14)]
    torch.manual_seed(0)
    eager = make_module(*mode(precision), *SYNC_FREE)
    fit(eager, batches)

    torch.manual_seed(0)
    graphed = make_module(*mode(precision), *SYNC_FREE)
    runner = ReplayByCalling()
    graphed.update_graphs = UpdateGraphs(graphed, warmup_updates=2, runner=runner)
    fit(graphed, batches)

    # two kinds of update (critic + actor + target, critic only): 2 warm-ups each, then graphs
    assert runner.eager_runs == 4 and runner.captured == 2 and runner.replays == 10
    for (name, a), b in zip(eager.state_dict().items(), graphed.state_dict().values()):
        assert torch.equal(a, b), name
    assert graphed.skipped == eager.skipped and graphed.updates == eager.updates == 14
    assert graphed.loss_scales() == eager.loss_scales()
    if precision.startswith("fp16"):  # growth_interval 3: the host-side counting after replays grew the scales
        assert graphed.loss_scales()["critic"] > 1e4, graphed.loss_scales()
        for name in ("critic", "actor", "alpha"):
            assert graphed.scalers[name].state_dict() == eager.scalers[name].state_dict()
    assert set(graphed.metrics) == set(eager.metrics)
    for key, value in eager.metrics.items():
        assert torch.equal(graphed.metrics[key], value), key


class CountingReplays(ReplayByCalling):
    """The stand-in that also counts what each replay of a recorded update dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: list[DispatchCount] = []

    def replay(self, graph):
        with DispatchCount() as count:
            super().replay(graph)
        self.counts.append(count)


@pytest.mark.parametrize("precision", ["fp16", "fp16-six", "bf16", "fp32"])
def test_the_recorded_update_reads_nothing_on_the_host(precision):
    """What capture would record (``update(graph_safe=True)``): no host read, which inside
    ``torch.cuda.graph`` is an error. Both kinds of update, and a replay that skips on overflow."""
    batches = [make_batch(seed=i) for i in range(8)]
    batches[6]["reward"].fill_(3e4)  # its squared TD error overflows fp16: a device-side skip
    torch.manual_seed(0)
    module = make_module(*mode(precision), *SYNC_FREE[:2], "lowp.growth_interval=1000", "train.log_every_updates=1000")
    runner = CountingReplays()
    module.update_graphs = UpdateGraphs(module, warmup_updates=1, runner=runner)
    fit(module, batches)
    assert runner.captured == 2 and len(runner.counts) == 6
    reads = [(count.host_reads, dict(count.read_sites)) for count in runner.counts]
    assert all(n == 0 for n, _ in reads), reads
    if precision.startswith("fp16"):
        assert module.skipped["critic"] >= 1, module.skipped


def test_logged_losses_are_copies_that_later_replays_do_not_change():
    torch.manual_seed(0)
    module = make_module("precision=fp32", *SYNC_FREE)
    module.update_graphs = UpdateGraphs(module, warmup_updates=1, runner=ReplayByCalling())
    fit(module, [make_batch(seed=i) for i in range(10)])  # logs at update 5 and 10
    logged = {k: v.clone() for k, v in module.metrics.items()}
    outputs = module.update_graphs.outputs[(False, False)]
    outputs["critic_loss"].fill_(123.0)  # what the next replay would do to the graph's output
    assert torch.equal(module.metrics["critic_loss"], logged["critic_loss"])


@pytest.mark.parametrize(
    "overrides,device,world,message",
    [
        ([], "cpu", 1, "needs a CUDA device"),
        ([], "cuda", 2, "needs one device"),
        (["perf.sync_free=false"], "cuda", 1, "needs perf.sync_free"),
        (["precision=amp"], "cuda", 1, "AMP's GradScaler"),
        (["lowp.hadam=false"], "cuda", 1, "needs hAdam when loss scaling is on"),
        (["perf.compile=true", "perf.compile_mode=reduce-overhead"], "cuda", 1, "without CUDA graphs of its own"),
    ],
)
def test_configurations_that_cannot_be_captured_are_named(overrides, device, world, message):
    cfg = load_config(["precision=fp16", *overrides])
    conflict = graph_conflicts(cfg, device, world)
    assert conflict is not None and message in conflict, conflict


@pytest.mark.parametrize(
    "overrides",
    [
        ["precision=fp16"],
        ["precision=bf16"],
        ["precision=fp32"],
        ["precision=fp16", "lowp.all=false"],
        ["precision=fp16", "perf.aug_backend=kornia"],  # kornia's warp draws its offsets on the device
    ],
)
def test_capturable_configurations_pass(overrides):
    assert graph_conflicts(load_config(overrides), "cuda", 1) is None


def test_cuda_graphs_on_a_cpu_is_one_error_line(tmp_path):
    from conftest import TINY

    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pixelsac.train",
            *TINY,
            "perf.cuda_graphs=true",
            "trainer.accelerator=cpu",
            f"run_dir={run_dir}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "perf.cuda_graphs needs a CUDA device" in lines[-1], lines
    assert not run_dir.exists()


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_real_cuda_graphs_equal_eager_updates_on_a_gpu(precision):
    """Same seed, same batches: replayed graphs and eager sync-free updates agree to rounding
    (kernel choice may differ between capture and eager), and a replay reads nothing on the host."""
    import lightning as L
    from torch.utils.data import DataLoader

    def run(graphs: bool):
        torch.manual_seed(0)
        module = make_module(
            f"precision={precision}",
            *SYNC_FREE,
            f"perf.cuda_graphs={str(graphs).lower()}",
            "perf.graph_warmup_updates=2",
        )
        trainer = L.Trainer(
            accelerator="cuda",
            devices=1,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, DataLoader([make_batch(seed=i) for i in range(14)], batch_size=None))
        return module

    eager, graphed = run(False), run(True)
    assert graphed.update_graphs is not None and len(graphed.update_graphs.graphs) == 2
    assert graphed.skipped == eager.skipped
    for (name, a), b in zip(eager.state_dict().items(), graphed.state_dict().values()):
        if a.is_floating_point():
            torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-3, msg=name)
