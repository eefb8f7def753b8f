"""CUDA-graph updates (perf.cuda_graphs): the bookkeeping around capture and replay on a CPU, the
configurations that cannot be captured, and (on a GPU only) real graphs against eager updates.

On a CPU a stand-in runner "replays" by calling the recorded function again with the same static
tensors -- what a replay does, minus the GPU -- so the static-batch copies, the losses handed to
logging and the loss scalers' host-side counting are checked against plain eager updates.
"""

import contextlib
import subprocess
import sys
from unittest import mock

import lightning as L
import pytest
import torch
from conftest import REPO
from dispatch_count import DispatchCount
from test_module import fit, make_batch, make_module
from torch.utils.data import DataLoader

from pixelsac.bench.plan import MODES
from pixelsac.config import load_config
from pixelsac.graphs import UpdateGraphs, graph_conflicts, updates_to_capture


@contextlib.contextmanager
def capturing():
    """What an update sees while a CUDA graph records it (``lowp.graph_capturing``), on a CPU."""
    with (
        mock.patch.object(torch.backends.cuda, "is_built", return_value=True),
        mock.patch.object(torch.cuda, "is_current_stream_capturing", return_value=True),
    ):
        yield


class ReplayByCalling:
    """Stand-in for GraphRunner: capture keeps the function, replay calls it as capture would
    have run it (a real replay runs no Python: what the update's Python did under capture is all)."""

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
        with capturing():
            graph()


SYNC_FREE = ["perf.sync_free=true", "perf.aug_backend=index", "lowp.growth_interval=3", "train.log_every_updates=5"]

#: The test agent's encoder projection: K = 4 filters x 5 x 5 at 24 px (the full agent's is 39,200).
TEST_AGENT_K = 100
#: What the graph checks cover: the modes a GPU run may capture, with either random-shift backend.
#: Each comes after SYNC_FREE, so "perf.aug_backend=kornia" replaces its index shift; fp16-six is
#: the benchmark's "the six as published" (pixelsac.bench.plan.MODES). fp16-splitk splits the
#: projection (a chunk below the test agent's K: the default chunk, 2,048, never splits it), as
#: every fp16/bf16 GPU run does; fp16-compiled is the goals' compiled optimizer
#: (perf.compile_optimizer), last, since triton compiles its step first on a GPU.
GRAPH_MODES = {
    "fp16": ["precision=fp16"],
    "fp32": ["precision=fp32"],
    "fp16-kornia": ["precision=fp16", "perf.aug_backend=kornia"],
    "bf16": ["precision=bf16"],
    "fp16-six": list(MODES["fp16-six"].overrides),
    "fp16-splitk": ["precision=fp16", f"perf.split_k={TEST_AGENT_K // 4}"],
    "fp16-compiled": list(MODES["fp16-compiled"].overrides),
}


def test_the_gate_covers_what_the_gpu_run_times():
    """The goals time fp16-compiled with graphs, the end-to-end run graphs the compiled optimizer,
    and every fp16/bf16 GPU update splits its projection: the gate's modes must reach each."""
    assert "perf.compile_optimizer=true" in GRAPH_MODES["fp16-compiled"]
    module = make_module(*GRAPH_MODES["fp16-splitk"])
    from pixelsac.lowp import SplitKLinear, split_count

    layers = [m for m in module.modules() if isinstance(m, SplitKLinear)]
    assert layers and all(layer.in_features == TEST_AGENT_K for layer in layers)
    assert all(layer.split_chunk and split_count(layer.in_features, layer.split_chunk) == 4 for layer in layers)
    assert list(GRAPH_MODES)[-1] == "fp16-compiled"  # a slow compile cannot hide the other modes' verdicts


#: GRAPH_MODES for the CPU's stand-in checks: the compiled optimizer compiles with inductor's C++
#: backend here, minutes on a busy 2-core machine, so that case is marked slow.
CPU_GRAPH_MODES = [
    pytest.param(name, marks=pytest.mark.slow) if name == "fp16-compiled" else name for name in GRAPH_MODES
]


@pytest.mark.parametrize("precision", CPU_GRAPH_MODES)
def test_replayed_updates_equal_eager_updates(precision):
    batches = [make_batch(seed=i) for i in range(14)]
    torch.manual_seed(0)
    eager = make_module(*SYNC_FREE, *GRAPH_MODES[precision])
    fit(eager, batches)

    torch.manual_seed(0)
    graphed = make_module(*SYNC_FREE, *GRAPH_MODES[precision])
    runner = ReplayByCalling()
    graphed.update_graphs = UpdateGraphs(graphed, warmup_updates=2, runner=runner)
    fit(graphed, batches)

    # two kinds of update (critic + actor + target, critic only): 2 warm-ups each, then graphs
    assert runner.eager_runs == 4 and runner.captured == 2 and runner.replays == 10
    for (name, a), b in zip(eager.state_dict().items(), graphed.state_dict().values()):
        assert torch.equal(a, b), name
    assert graphed.skipped == eager.skipped and graphed.updates == eager.updates == 14
    assert graphed.loss_scales() == eager.loss_scales()
    if precision.startswith("fp16"):  # growth_interval 3: the host-side counting after replays grew a scale
        # (with lowp.headroom_growth only where the peaks leave room: here the actor's and temperature's)
        assert max(graphed.loss_scales().values()) > 1e4, graphed.loss_scales()
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


@pytest.mark.parametrize("precision", CPU_GRAPH_MODES)
def test_the_recorded_update_reads_nothing_on_the_host(precision):
    """What capture would record (``update`` while capturing): no host read, which inside
    ``torch.cuda.graph`` is an error. Both kinds of update, and a replay that skips on overflow."""
    batches = [make_batch(seed=i) for i in range(8)]
    batches[6]["reward"].fill_(3e4)  # its squared TD error overflows fp16: a device-side skip
    torch.manual_seed(0)
    module = make_module(
        *SYNC_FREE[:2], *GRAPH_MODES[precision], "lowp.growth_interval=1000", "train.log_every_updates=1000"
    )
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


# --- on a GPU: real capture and replay -------------------------------------------------------------
#: Unit roundoff of each parameter dtype: one rounding moves a value by at most this, relatively.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def training_state(module, optimizers) -> dict[str, torch.Tensor]:
    """What the update sequence computed, as float64 values: each parameter with its optimizer's
    Kahan compensation folded in (``p - c``: the running sum ``kahan_add_`` keeps), each
    Kahan-momentum copy with its own (``θ̄_S - c``), every other buffer as it is. A compensation
    alone is no result: it holds what one rounding of its sum lost, so a kernel that rounds its
    last bit otherwise rewrites it wholesale while the sum moves by one ulp."""
    comps = {id(p): s["kahan_comp"] for opt in optimizers for p, s in opt.state.items() if "kahan_comp" in s}
    values = {}
    for name, param in module.named_parameters():
        value = param.detach().double()
        values[name] = value - comps[id(param)].double() if id(param) in comps else value
    state = module.state_dict()
    for name, tensor in state.items():
        if name in values or ".kahan_comp." in name:
            continue
        if ".scaled_params." in name:
            values[name] = tensor.double() - state[name.replace(".scaled_params.", ".kahan_comp.")].double()
        else:
            values[name] = tensor.double() if tensor.is_floating_point() else tensor
    return {name: value.cpu() for name, value in values.items()}


def moved_apart(initial, eager, graphed, dtype) -> list[tuple[str, float]]:
    """Tensors whose moves from the common start differ by more than rounding allows, with the
    ratio of the difference to the tolerance (above 1 fails; inf: integer tensors must be equal).

    Tolerance per tensor (L2 norms, ``u`` the dtype's unit roundoff: fp32 2^-24, fp16 2^-11, bf16
    2^-8): ``max(64·u, 1e-4)·|Δ_eager| + 4·u·|θ|``. A kernel whose last bit differs perturbs a
    gradient by ~u relative; Adam's normalised step passes that on, and 14 updates through the
    critic-actor feedback amplify it by a factor of order ten: 64·u of the move covers that (fp16
    3.1%, bf16 25%; fp32 gets 1e-4, far above its 4e-6); 4·u·|θ| covers the last roundings of the
    values themselves. A replay that reads a stale input, skips an update or runs the wrong kind
    changes at least one of the 14 steps wholly: with the stand-in runner, one lost update moved 45
    of fp16's 59 tensors apart (median 5x the tolerance), all of fp32's (median ~1,800x); bf16's
    tolerance catches such a loss in few tensors, only a gross one there."""
    u = UNIT_ROUNDOFF[dtype]
    worst = []
    for name, start in initial.items():
        a, b = eager[name], graphed[name]
        if not a.is_floating_point():
            if not torch.equal(a, b):
                worst.append((name, float("inf")))
            continue
        move = (a - start).norm().item()
        allowed = max(64 * u, 1e-4) * move + 4 * u * a.norm().item()
        differs = ((b - start) - (a - start)).norm().item()
        if differs > allowed:
            worst.append((name, differs / allowed if allowed > 0 else float("inf")))
    return sorted(worst, key=lambda item: -item[1])


def _fit_on_gpu(module, batches, callbacks=()):
    trainer = L.Trainer(
        accelerator="cuda",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )
    trainer.fit(module, DataLoader(batches, batch_size=None))
    return trainer


class LosesOneReplay(ReplayByCalling):
    """A faulty stand-in: its third replay does nothing (as a replay of stale inputs would not
    move the state the right way)."""

    def replay(self, graph):
        self.replays += 1
        if self.replays != 3:
            graph()


@pytest.mark.parametrize("precision", ["fp16", "fp16-six", "fp32"])
def test_the_gpu_gates_comparison_fails_a_lost_update_and_passes_a_rewritten_compensation(precision):
    """What the GPU gate compares, checked here with the stand-in runner: one lost update in 14
    moves the state apart beyond the tolerance; a Kahan compensation rewritten with its sum kept
    (what another kernel's last-bit rounding does to it) does not -- compared elementwise, as the
    gate once did, it would."""
    batches = [make_batch(seed=i) for i in range(14)]
    states = {}
    for name, runner in (("eager", None), ("lost", LosesOneReplay())):
        torch.manual_seed(0)
        module = make_module(*SYNC_FREE, *GRAPH_MODES[precision])
        initial = training_state(module, [])
        if runner is not None:
            module.update_graphs = UpdateGraphs(module, warmup_updates=2, runner=runner)
        trainer = fit(module, batches)
        states[name] = (module, training_state(module, trainer.optimizers))
    eager, eager_state = states["eager"]
    dtype = eager.precision_policy.param_dtype
    assert moved_apart(initial, eager_state, eager_state, dtype) == []
    assert moved_apart(initial, eager_state, states["lost"][1], dtype)  # one update of 14 is too many

    pairs = [n for n in eager.state_dict() if ".scaled_params." in n]
    if not pairs:  # fp32: a plain target EMA, no Kahan buffers
        return
    # every θ̄_S one ulp up and its compensation c up by as much: θ̄_S - c is kept (to a rounding of c)
    rewritten = dict(eager.state_dict())
    for name in pairs:
        scaled, comp = rewritten[name], rewritten[name.replace(".scaled_params.", ".kahan_comp.")]
        up = torch.nextafter(scaled, torch.full_like(scaled, float("inf")))
        rewritten[name] = up
        rewritten[name.replace(".scaled_params.", ".kahan_comp.")] = (
            comp.double() + (up.double() - scaled.double())
        ).to(comp.dtype)
    module = make_module(*SYNC_FREE, *GRAPH_MODES[precision])
    module.load_state_dict(rewritten)
    before, after = training_state(eager, []), training_state(module, [])
    assert moved_apart(initial, before, after, dtype) == []
    comps = [n.replace(".scaled_params.", ".kahan_comp.") for n in pairs]
    elementwise = all(
        torch.allclose(module.state_dict()[n].float(), eager.state_dict()[n].float(), rtol=2e-2, atol=2e-3)
        for n in comps
    )
    assert not elementwise  # the old gate's elementwise check of the compensations fails it


@pytest.mark.gpu
@pytest.mark.parametrize("precision", list(GRAPH_MODES))
def test_real_cuda_graphs_equal_eager_updates_on_a_gpu(precision):
    """Same seed, same batches: replayed graphs and eager sync-free updates compute the same
    training state up to rounding (kernel choice may differ between capture and eager): skips,
    loss scales and counters exactly, weights and Kahan sums within :func:`moved_apart`'s
    tolerance. tools/gpu/gpu_run.sh times CUDA graphs only when every mode here passes."""
    batches = [make_batch(seed=i) for i in range(14)]

    def run(graphs: bool):
        torch.manual_seed(0)
        module = make_module(
            *SYNC_FREE,
            *GRAPH_MODES[precision],
            f"perf.cuda_graphs={str(graphs).lower()}",
            "perf.graph_warmup_updates=2",
        )
        initial = training_state(module, [])
        trainer = _fit_on_gpu(module, batches)
        return module, initial, training_state(module, trainer.optimizers)

    (eager, initial, eager_state), (graphed, _, graphed_state) = run(False), run(True)
    assert graphed.update_graphs is not None and len(graphed.update_graphs.graphs) == 2
    assert graphed.updates == eager.updates == 14
    assert graphed.skipped == eager.skipped and graphed.loss_scales() == eager.loss_scales()
    assert set(graphed_state) == set(eager_state) == set(initial)
    dtype = eager.precision_policy.param_dtype
    apart = moved_apart(initial, eager_state, graphed_state, dtype)
    assert not apart, f"{precision}: moved apart (ratio to the tolerance): {apart[:8]}"


class SyncIsAnError(L.Callback):
    """``torch.cuda.set_sync_debug_mode("error")`` around every update that must not wait for the
    GPU: each eager sync-free update after the first of each kind (which builds the optimizers'
    state and cached index constants once), and with CUDA graphs every replay (the eager warm-ups
    and the captures before them synchronise by design). ``checked`` counts the updates watched."""

    FIRST_CYCLE = 2  # one full update and one critic-only (actor and target every 2 updates)

    def __init__(self) -> None:
        self.checked, self.on = 0, False

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        graphs = module.update_graphs
        if (graphs is None and module.updates >= self.FIRST_CYCLE) or (graphs is not None and len(graphs.graphs) == 2):
            torch.cuda.set_sync_debug_mode("error")
            self.on = True

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self._off()

    def on_exception(self, trainer, module, exception):
        self._off()

    def _off(self):
        if self.on:
            torch.cuda.set_sync_debug_mode("default")
            self.on, self.checked = False, self.checked + 1


@pytest.mark.gpu
@pytest.mark.parametrize(
    "precision,graphs",
    [*((name, False) for name in GRAPH_MODES), ("amp", False), *((name, True) for name in GRAPH_MODES)],
)
def test_sync_free_updates_never_wait_for_the_gpu(precision, graphs):
    """Under torch.cuda.set_sync_debug_mode("error") every synchronising call (a host read, a
    blocking copy, a synchronize) raises: none inside an eager sync-free update or a replay, with
    logging and loss-scale growth left to their intervals (which read the host by design). On the
    CPU, tests/test_sync_free_update.py counts host reads; only a GPU shows blocking copies (a
    tensor built from host values on the device) and synchronisations."""
    overrides = GRAPH_MODES.get(precision, [f"precision={precision}"])
    torch.manual_seed(0)
    module = make_module(
        "perf.sync_free=true",
        "perf.aug_backend=index",
        *overrides,
        "lowp.growth_interval=1000",
        "train.log_every_updates=1000",
        f"perf.cuda_graphs={str(graphs).lower()}",
        "perf.graph_warmup_updates=2",
    )
    watch = SyncIsAnError()
    try:
        _fit_on_gpu(module, [make_batch(seed=i) for i in range(12)], [watch])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert module.updates == 12
    assert watch.checked == 12 - (updates_to_capture(2, 2, 2) if graphs else SyncIsAnError.FIRST_CYCLE) > 0
