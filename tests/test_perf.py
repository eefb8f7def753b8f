"""Throughput and memory tracking: the clock, the memory probe, the fp32 calibration and the
run callback's logs and summary -- on a tiny agent fitted on synthetic batches, no environment."""

import dataclasses
import gc
import json
import math
import mmap
import time
import types

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, IterableDataset

from pixelsac import perf
from pixelsac.config import load_config, to_plain
from pixelsac.module import SACModule
from pixelsac.precision import state_bytes

OBS_SHAPE = (9, 24, 24)
ACTION_DIM = 2
TINY_AGENT = [
    "env.image_size=24",
    "agent.num_filters=4",
    "agent.feature_dim=8",
    "agent.hidden_dim=16",
    "agent.batch_size=4",
]
FETCH_SECONDS = 1000.0  # what each fake env step "costs" on the stand-in clock


class RecordingLogger(Logger):
    """Keeps every (step, metrics) row it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


class FakeClock:
    """perf_counter plus a jump each time the fake stream collects an env step."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.perf_counter() + self.offset


class FakeStream(IterableDataset):
    """Like ExperienceStream: one agent step (8 env frames, FETCH_SECONDS on the fake clock)
    collected before each batch is yielded."""

    def __init__(self, collector, clock: FakeClock, batches: int) -> None:
        self.collector, self.clock, self.batches = collector, clock, batches

    def __iter__(self):
        batch = perf.synthetic_batch(4, OBS_SHAPE, ACTION_DIM, seed=1)
        for _ in range(self.batches):
            self.collector.env_frames += 8
            self.collector.agent_steps += 1
            self.clock.offset += FETCH_SECONDS
            yield batch


def test_update_clock_reports_closed_spans_once():
    clock = perf.UpdateClock(torch.device("cpu"))
    clock.start()
    time.sleep(0.02)
    clock.stop()
    clock.start()  # never closed: not reported
    spans = clock.drain()
    assert len(spans) == 1 and spans[0] >= 19.0
    assert clock.drain() == []
    clock.cancel()
    clock.stop()
    assert clock.drain() == []


def test_cpu_peak_memory_is_the_process_rss_high_water_mark():
    peak = perf.PeakMemory(torch.device("cpu"))
    assert peak.kind.startswith("rss_high_water") and peak.metric == "perf/peak_rss_mib"
    if peak.kind != "rss_high_water":
        pytest.skip("this kernel cannot reset the RSS high-water mark (/proc/self/clear_refs)")
    peak.reset()
    before = peak.read()
    # a fresh anonymous mapping, every page written: malloc could hand back memory that is
    # already resident (the Makefile's allocator settings keep freed memory mapped)
    block = mmap.mmap(-1, 64 * 2**20)
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    after = peak.read()
    block.close()
    assert before > 0
    assert after - before >= 48 * 2**20


def test_time_updates_leaves_the_callers_random_stream_alone():
    cfg = load_config([*TINY_AGENT, "precision=fp32"])
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    timed = perf.time_updates(
        to_plain(cfg),
        OBS_SHAPE,
        ACTION_DIM,
        perf.synthetic_batch(4, OBS_SHAPE, ACTION_DIM),
        torch.device("cpu"),
        updates=2,
        warmup=1,
    )
    assert torch.equal(torch.rand(3), expected)
    assert len(timed.ms) == 2 and all(ms > 0 for ms in timed.ms)
    assert timed.finite_after_first and timed.finite_at_end
    assert timed.peak_bytes is None  # no per-run peak is measurable in-process on a CPU
    assert timed.state["total"] == timed.state["parameters"] + timed.state["optimizer"] + timed.state["target"]
    assert timed.saved.activations > 0 and timed.saved.by_dtype.keys() >= {"float32"}
    assert timed.tensor_peak_bytes >= timed.saved.peak_live_activations > 0
    assert {kind: sum(groups.values()) for kind, groups in timed.state_groups.items()} == {
        k: v for k, v in timed.state.items() if k != "total"
    }


def test_saved_tensor_meter_counts_each_storage_once_and_state_apart():
    weight = torch.nn.Parameter(torch.randn(1000))  # state: 4,000 B
    x = torch.randn(1000, requires_grad=True)  # 4,000 B
    meter = perf.SavedTensorMeter(state=[weight])
    with meter:
        a = x.sin()  # saves x
        b = x[:500].cos()  # saves a view of x: the same storage
        c = a * weight  # saves a (4,000 B, new) and the weight (state)
        d = x.half().exp()  # saves its fp16 result (2,000 B)
    saved = meter.result()
    assert saved.activations == 4000 + 4000 + 2000 and saved.state == 4000 and saved.tensors == 5
    assert saved.by_dtype == {"float32": 8000, "float16": 2000}
    assert saved.peak_live_activations == 10_000
    (c.sum() + b.sum() + d.float().sum()).backward()  # frees every saved tensor ...
    assert meter._live == {} and meter._live_bytes == 0
    x2 = x.detach().clone().requires_grad_()
    ((x2.sin() * weight).sum() + x2[:500].cos().sum() + x2.half().exp().float().sum()).backward()
    assert torch.equal(x.grad, x2.grad)  # ... and the hooks changed no value
    with meter:
        e = x.sin()  # x is still alive: the same storage, not counted again
    assert meter.result().activations == 10_000
    del e


def test_saved_tensor_meter_lets_a_dropped_graph_go():
    """A graph no backward runs through (SACModule's detached trunk pass for the actor) is freed
    when dropped: the meter keeps no reference cycle through the saved outputs."""
    x = torch.randn(1000, requires_grad=True)
    meter = perf.SavedTensorMeter()
    with meter:
        y = torch.relu(x * 2).tanh().detach()  # relu and tanh save their outputs
    gc.collect()
    assert meter.result().activations == 8000 and meter._live == {} and y.shape == x.shape


class _ToyOptimizer(torch.optim.Optimizer):
    """Keeps a state tensor under a name no list knows, and a scalar step."""

    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state.setdefault("step", torch.tensor(0.0))
                state.setdefault("rounding_residual", torch.zeros_like(p))


def test_state_groups_follow_what_the_module_and_optimizers_hold():
    class Agent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.actor = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
            self.critic = torch.nn.Linear(4, 1)
            self.critic_target = torch.nn.Linear(4, 1).requires_grad_(False)
            self.extra = torch.nn.Module()
            self.extra.register_buffer("scaled", torch.zeros(10))
            self.extra.register_buffer("counter", torch.zeros(3, dtype=torch.int64))  # not floating: not state

    agent = Agent()
    opt = _ToyOptimizer([*agent.actor.parameters(), *agent.critic.parameters()])
    opt.step()
    groups = perf.state_groups(agent, [opt])
    assert groups == {
        "parameters": {"actor.0": (32 + 8) * 4, "actor.1": (16 + 2) * 4, "critic.weight": 16, "critic.bias": 4},
        "optimizer": {"rounding_residual": (40 + 18 + 5) * 4},  # the scalar step is left out
        "target": {"critic_target": 20, "extra": 40},
    }
    totals = state_bytes(agent, [opt])
    assert {kind: sum(g.values()) for kind, g in groups.items()} == {k: v for k, v in totals.items() if k != "total"}
    ratios = perf.group_ratios(groups, {"parameters": {"actor.0": 80}, "optimizer": {}})
    assert ratios["parameters"]["actor.0"] == 2.0 and ratios["parameters"]["critic.bias"] is None
    assert ratios["target"] == {"critic_target": None, "extra": None}


def test_state_groups_share_out_a_flat_buffer_by_what_each_view_spans():
    """hAdam's compiled step keeps a bucket's parameters as views into one buffer: each network
    is charged the bytes of its own views, not the first one the whole buffer; an overlapping
    view is not counted twice, and bytes no view spans stay with the first holder."""
    from pixelsac.lowp import HAdam

    class Agent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.actor = torch.nn.Linear(4, 8, dtype=torch.float16)
            self.critic = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 1)).half()

    agent = Agent()
    critic = HAdam(agent.critic.parameters(), lr=1e-3, capturable=True, unbiased_moments=True, compiled=True)
    actor = HAdam(agent.actor.parameters(), lr=1e-3, capturable=True, unbiased_moments=True, compiled=True)
    for opt in (critic, actor):
        for group in opt.param_groups:
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
        opt.step(found_inf=torch.tensor(0.0))
    assert agent.critic[0].weight.untyped_storage().data_ptr() == agent.critic[1].bias.untyped_storage().data_ptr()
    groups = perf.state_groups(agent, [critic, actor])
    assert groups["parameters"] == {"actor.weight": 64, "actor.bias": 16, "critic.0": 108, "critic.1": 14}
    assert groups["optimizer"] == {"exp_avg": 202, "exp_avg_root": 202}
    totals = state_bytes(agent, [critic, actor])
    assert {kind: sum(g.values()) for kind, g in groups.items()} == {k: v for k, v in totals.items() if k != "total"}
    whole = torch.zeros(10)
    assert perf.meters._group_bytes([("a", whole[:6]), ("b", whole[4:8]), ("c", whole[2:5])]) == {"a": 24 + 8, "b": 8}


def test_tensor_peak_meter_sees_what_an_update_allocates():
    x = torch.randn(1000)
    with perf.TensorPeakMeter() as meter:
        a = x * 2  # 4,000 B, alive
        b = (a * 3).sum()  # 4,000 B alive until the sum (4 B) has run
        a.mul_(2)  # in place: nothing new
        view = a[:10]  # a view: nothing new
        del a, view  # freed
        c = torch.empty(500)  # 2,000 B
    assert meter.peak == 4000 + 4000 + 4
    assert meter._bytes == 4 + 2000 and b.numel() == 1 and c.numel() == 500


def test_interleaved_forms_give_each_form_even_and_odd_updates():
    forms = perf.interleaved_forms(warmup=2, updates=8)
    assert forms[:2] == [True, False]
    timed = forms[2:]
    for flag in (True, False):
        updates = [i + 2 for i, f in enumerate(timed) if f == flag]
        assert len(updates) == 4 and sum(u % 2 for u in updates) == 2


def test_fp32_reference_config_resets_every_switch():
    cfg = to_plain(load_config(["precision=fp16", "lowp.hadam=true", "lowp.all=true", "lowp.fp32_accumulate=true"]))
    reference = perf.fp32_reference_config(cfg)
    assert reference["precision"] == "fp32"
    assert all(
        reference["lowp"][k] is None
        for k in (
            "all",
            "hadam",
            "loss_scaling",
            "kahan_gradients",
            "kahan_momentum",
            "softplus_fix",
            "normal_fix",
            "fp32_accumulate",
        )
    )
    assert cfg["precision"] == "fp16" and cfg["lowp"]["hadam"] is True  # the run's own config is untouched


def test_summary_ratios_come_from_the_measured_values():
    fp32 = perf.Fp32Reference(
        ms_per_update=30.0,
        ms_std=1.0,
        updates=3,
        warmup=1,
        state={"parameters": 400, "optimizer": 800, "target": 400, "total": 1600},
        peak_bytes=8000,
        seconds=1.0,
    )
    summary = perf.build_summary(
        precision="fp16",
        device="cuda:0",
        batch_size=512,
        env_frames=1000,
        agent_steps=250,
        updates=200,
        wall_s=4.0,
        ms=[10.0, 14.0],
        peak_bytes=5000,
        peak_kind="cuda_max_allocated",
        state={"parameters": 200, "optimizer": 500, "target": 300, "total": 1000},
        loss_scales={"critic": 1e4},
        skipped={"critic": 1},
        best_eval_return=12.5,
        fp32=fp32,
    )
    assert summary["ms_per_update"] == 12.0
    assert summary["speedup_vs_fp32"] == pytest.approx(30.0 / 12.0)
    assert summary["memory_vs_fp32"] == pytest.approx(1000 / 1600)
    assert summary["peak_memory_vs_fp32"] == pytest.approx(5000 / 8000)
    assert summary["env_frames_per_s"] == 250.0 and summary["updates_per_s"] == 50.0
    # a CPU's process-wide RSS cannot be compared with the fp32 copy's: no peak ratio
    cpu = perf.build_summary(
        **{
            **dict(
                precision="fp16",
                device="cpu",
                batch_size=4,
                env_frames=8,
                agent_steps=1,
                updates=1,
                wall_s=1.0,
                ms=[5.0],
                peak_bytes=10,
                state=None,
                loss_scales={},
                skipped={},
                best_eval_return=None,
                fp32=fp32,
            )
        },
        peak_kind="rss_high_water",
    )
    assert cpu["peak_memory_vs_fp32"] is None and cpu["memory_vs_fp32"] is None
    assert "2.50x speed-up" in perf.format_summary(summary)


class StopAt(L.Callback):
    """Raises after a given number of updates, like a run stopped for non-finite weights."""

    def __init__(self, updates: int) -> None:
        self.updates = updates

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.updates >= self.updates:
            raise RuntimeError("stopped for the test")


def _fit_tracked(tmp_path, monkeypatch, *overrides, extra_callbacks=(), tracker_state=None, save_to=None):
    clock = FakeClock()
    monkeypatch.setattr(perf.meters, "_now", clock)
    cfg = load_config(
        [*TINY_AGENT, "train.log_every_updates=2", "perf.calibrate_updates=2", "perf.warmup_updates=1", *overrides]
    )
    torch.manual_seed(0)
    module = SACModule(to_plain(cfg), OBS_SHAPE, ACTION_DIM)
    collector = types.SimpleNamespace(env_frames=0, agent_steps=0)
    tracker = perf.PerfTracker(collector, tmp_path / "run", cfg)
    if tracker_state is not None:
        tracker.load_state_dict(tracker_state)
    logger = RecordingLogger()
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[tracker, *extra_callbacks],
    )
    trainer.fit(module, DataLoader(FakeStream(collector, clock, batches=5), batch_size=None))
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return tracker, logger, module


def test_tracker_logs_every_figure_and_writes_the_summary(tmp_path, monkeypatch, capsys):
    from pixelsac.lowp import splitk

    # a split product of an earlier run in this process: not this run's (the tracker forgets it)
    monkeypatch.setitem(splitk._PATHS_TAKEN, "fp32_copies", "an earlier run")
    tracker, logger, module = _fit_tracked(tmp_path, monkeypatch, "precision=fp16")
    calibration = [m for _, m in logger.rows if "perf/fp32_ms_per_update" in m]
    intervals = [(step, m) for step, m in logger.rows if "perf/ms_per_update" in m]
    assert len(calibration) == 1 and calibration[0]["perf/fp32_ms_per_update"] > 0
    # every 2 updates, step = env frames then; the first interval is the warm-up cycle, untimed
    assert [step for step, _ in intervals] == [32]
    named = {
        "perf/env_frames_per_s",
        "perf/updates_per_s",
        "perf/ms_per_update",
        "perf/peak_rss_mib",
        "perf/state_bytes",
        "perf/state_bytes_parameters",
        "perf/state_bytes_optimizer",
        "perf/state_bytes_target",
        "perf/speedup_vs_fp32",
        "perf/memory_vs_fp32",
        "env_frames",
        "updates",
        "perf/saved_for_backward_bytes",
        "perf/saved_for_backward_vs_fp32",
        "perf/state_bytes_optimizer/exp_avg",
        "perf/state_bytes_parameters/critic.trunk",
    }
    fp32_ms, fp32_bytes = calibration[0]["perf/fp32_ms_per_update"], calibration[0]["perf/fp32_state_bytes"]
    for step, row in intervals:
        assert named <= set(row), named - set(row)
        assert any(key.startswith("perf/state_bytes_target/") for key in row)  # target copies by group
        assert row["env_frames"] == step
        assert not any(key.startswith("lowp/") for key in row)  # the TrainingLogger's, logged once
        # collecting (a 1000 s jump of the stand-in clock per env step) is not part of an update
        assert 0 < row["perf/ms_per_update"] < FETCH_SECONDS * 1e3
        assert row["perf/speedup_vs_fp32"] == pytest.approx(fp32_ms / row["perf/ms_per_update"])
        assert row["perf/memory_vs_fp32"] == pytest.approx(row["perf/state_bytes"] / fp32_bytes)
        assert row["perf/memory_vs_fp32"] < 1  # fp16 + six holds fewer bytes than fp32 Adam, Kahan buffers included
        assert row["perf/peak_rss_mib"] > 0
        assert row["perf/saved_for_backward_vs_fp32"] == pytest.approx(
            row["perf/saved_for_backward_bytes"] / calibration[0]["perf/fp32_saved_for_backward_bytes"]
        )
        assert row["perf/saved_for_backward_vs_fp32"] <= 0.55  # fp16 saves half of fp32's bytes
    # perf.warmup_updates=1 rounds up to one whole cycle (a full and a critic-only update)
    assert module.updates == 5 and len(tracker._ms_all) == 3

    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["updates"] == 5 and summary["env_frames"] == 40 and summary["timed_updates"] == 3
    assert summary["ms_per_update"] == pytest.approx(sum(tracker._ms_all) / 3)
    assert summary["speedup_vs_fp32"] == pytest.approx(summary["fp32"]["ms_per_update"] / summary["ms_per_update"])
    assert summary["memory_vs_fp32"] == pytest.approx(
        summary["state_bytes"]["total"] / summary["fp32"]["state"]["total"]
    )
    assert summary["peak_memory_kind"].startswith("rss_high_water") and summary["peak_memory_bytes"] > 0
    assert set(summary["loss_scales"]) == set(summary["skipped"]) == {"critic", "actor", "alpha"}
    assert summary["best_eval_return"] is None  # no Evaluator in this fit
    saved, fp32_saved = summary["saved_for_backward"], summary["fp32"]["saved"]
    assert saved["activations"] > 0 and saved["by_dtype"].get("float32", 0) < saved["by_dtype"]["float16"]
    assert summary["saved_for_backward_vs_fp32"] == pytest.approx(saved["activations"] / fp32_saved["activations"])
    groups, fp32_groups = summary["state_groups"], summary["fp32"]["state_groups"]
    assert {k: sum(g.values()) for k, g in groups.items()} == {
        k: v for k, v in summary["state_bytes"].items() if k != "total"
    }
    assert (
        summary["state_groups_vs_fp32"]["parameters"]["critic.trunk"]
        == pytest.approx(groups["parameters"]["critic.trunk"] / fp32_groups["parameters"]["critic.trunk"])
        == 0.5
    )
    assert "exp_avg_sq" in fp32_groups["optimizer"] and set(summary["memory_figures"]) >= {"peak memory", "state"}
    markdown = (tmp_path / "run" / "summary.md").read_text()
    for what in (
        "ms / update",
        "speed-up",
        "peak memory",
        "state bytes",
        "loss scales",
        "skipped steps",
        "state: optimizer",
        "saved for backward",
        "Memory figures",
        "saved_tensors_hooks",
    ):
        assert what in markdown
    # the code that wrote it: the package and the libraries, in the file and in its table
    assert summary["code"]["pixelsac"] and summary["code"]["torch"] == torch.__version__
    assert f"pixelsac {summary['code']['pixelsac']}" in markdown
    # the long-K products' path: the tiny agent's K = 100 is below the default chunk, so none split
    assert summary["split_k"] == "off" and "split-K products" in markdown
    printed = capsys.readouterr().out
    assert "perf summary:" in printed and "fp32 reference" in printed and "resident-set" in printed


def test_tracker_without_calibration_logs_no_ratio(tmp_path, monkeypatch):
    _, logger, _ = _fit_tracked(tmp_path, monkeypatch, "precision=fp32", "perf.calibrate_updates=0")
    logged = set().union(*(m for _, m in logger.rows))
    assert "perf/ms_per_update" in logged and "perf/state_bytes" in logged
    assert not {k for k in logged if "fp32" in k}
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["fp32"] is None and summary["speedup_vs_fp32"] is None
    assert math.isfinite(summary["ms_per_update"])


def test_a_run_that_stops_early_still_writes_its_summary(tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match="stopped for the test"):
        _fit_tracked(tmp_path, monkeypatch, "precision=fp32", "perf.calibrate_updates=0", extra_callbacks=[StopAt(3)])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["updates"] == 3 and summary["stopped_by"] == "RuntimeError: stopped for the test"
    assert "stopped early" in (tmp_path / "run" / "summary.md").read_text()


# --- honest figures: what is timed, in which proportions, against what ------------------------
def test_update_cycles_and_the_updates_until_every_graph_is_captured():
    from pixelsac.graphs import update_cycle, updates_to_capture

    assert update_cycle(2, 2) == 2 and update_cycle(1, 1) == 1 and update_cycle(4, 3) == 12
    # DrQ (actor and target every 2nd update), 3 eager warm-ups: each of the 2 kinds runs 3
    # times eagerly and is captured at its 4th: 8 updates until every update is a replay
    assert updates_to_capture(2, 2, 3) == 8
    assert updates_to_capture(1, 1, 3) == 4  # one kind
    assert updates_to_capture(4, 2, 1) == 7  # the full kind (updates 0, 4) and critic+target (2, 6)


def _record_kinds(kinds):
    def prepare(module):
        real = module.update

        def update(batch, with_actor, with_target):
            kinds.append(with_actor)
            return real(batch, with_actor, with_target)

        module.update = update

    return prepare


def test_calibration_times_whole_cycles_in_the_runs_proportions():
    """DrQ runs the actor every 2nd update, so a run alternates full and critic-only updates
    1:1. Asked for 3 timed updates after 1 warm-up (the start-up default), the calibration times
    2 full and 2 critic-only ones, starting at a full one, after a whole cycle of warm-up."""
    kinds = []
    timed = perf.time_updates(
        to_plain(load_config([*TINY_AGENT, "precision=fp32"])),
        OBS_SHAPE,
        ACTION_DIM,
        perf.synthetic_batch(4, OBS_SHAPE, ACTION_DIM),
        torch.device("cpu"),
        updates=3,
        warmup=1,
        prepare=_record_kinds(kinds),
    )
    timed_kinds = kinds[len(kinds) - len(timed.ms) :]
    assert timed_kinds == [True, False, True, False]
    assert timed.warmup == 2 and kinds == [True, False] * 3  # 2 warm-up + 4 timed updates


class ReplayByCalling:
    """Stand-in for the GPU's GraphRunner: capture keeps the function, replay calls it."""

    def eager(self, fn):
        return fn()

    def capture(self, fn):
        return fn

    def replay(self, graph):
        graph()


def test_graph_warmups_and_captures_are_not_timed():
    """With perf.cuda_graphs a kind of update runs eagerly, is captured, then replays: only the
    replays are what the run costs from then on, so only they are timed."""
    from pixelsac.graphs import UpdateGraphs

    cfg = load_config([*TINY_AGENT, "precision=fp32", "perf.sync_free=true", "perf.aug_backend=index"])
    torch.manual_seed(0)
    module = SACModule(to_plain(cfg), OBS_SHAPE, ACTION_DIM)
    module.update_graphs = UpdateGraphs(module, warmup_updates=2, runner=ReplayByCalling())
    timer = perf.UpdateTimer()
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    batch = perf.synthetic_batch(4, OBS_SHAPE, ACTION_DIM)
    trainer.fit(module, DataLoader([batch] * 10, batch_size=None))
    # 2 kinds x (2 eager warm-ups + 1 capture) = 6 untimed; the 4 replays are timed
    assert module.updates == 10 and len(timer.clock.drain()) == 4
    assert timer.graph_setup_updates == 6


def test_calibration_frees_its_agent_so_the_next_cell_starts_clean():
    """The Trainer and the module hold each other in reference cycles: time_updates collects
    them, or the next calibration or benchmark cell measures on top of this one's memory."""
    import weakref

    refs = []
    perf.time_updates(
        to_plain(load_config([*TINY_AGENT, "precision=fp16"])),
        OBS_SHAPE,
        ACTION_DIM,
        perf.synthetic_batch(4, OBS_SHAPE, ACTION_DIM),
        torch.device("cpu"),
        updates=2,
        warmup=0,
        prepare=lambda module: refs.append(weakref.ref(module)),
    )
    assert refs and refs[0]() is None


def _reference(**overrides):
    values = dict(
        ms_per_update=30.0,
        ms_std=1.0,
        updates=4,
        warmup=2,
        state={"parameters": 400, "optimizer": 800, "target": 400, "total": 1600},
        peak_bytes=8000,
        seconds=1.0,
    )
    return perf.Fp32Reference(**{**values, **overrides})


def _summary(fp32, **overrides):
    values = dict(
        precision="fp16",
        device="cuda:0",
        batch_size=512,
        env_frames=1000,
        agent_steps=250,
        updates=200,
        wall_s=4.0,
        ms=[10.0, 14.0],
        peak_bytes=5000,
        peak_kind="cuda_max_allocated",
        state={"parameters": 200, "optimizer": 500, "target": 300, "total": 1000},
        loss_scales={},
        skipped={},
        best_eval_return=None,
        fp32=fp32,
    )
    return perf.build_summary(**{**values, **overrides})


def test_peak_ratio_divides_the_agents_bytes_by_the_agents_bytes():
    """The fp32 copy's peak is counted above what was allocated before it was built; the run's
    peak also holds a replay buffer kept on the GPU, which the fp32 copy never has: it is left
    out by name before dividing."""
    summary = _summary(_reference(peak_bytes=8000), peak_bytes=5000 + 3000, replay_device_bytes=3000)
    assert summary["peak_memory_vs_fp32"] == pytest.approx(5000 / 8000)
    assert summary["peak_memory_bytes"] == 8000 and summary["replay_device_bytes"] == 3000


def test_the_speed_up_says_what_it_rests_on():
    summary = _summary(_reference())
    assert summary["speedup_vs_fp32"] == pytest.approx(2.5) and summary["speedup_reliable"] is True
    assert summary["speedup_basis"] == "fp32 start-up estimate over 4 updates (after 2 warm-up)"
    assert "2.50x speed-up vs fp32 30.00: fp32 start-up estimate over 4 updates" in perf.format_summary(summary)

    busy = _summary(_reference(host_busy=True, host_load="other processes used 1.7 of 2 cores"))
    assert busy["speedup_reliable"] is False
    assert "unreliable: the host was busy (other processes used 1.7 of 2 cores)" in perf.format_summary(busy)

    shared = _summary(_reference(), shared_device=True)
    assert shared["speedup_vs_fp32"] is None and "shared with other runs" in perf.format_summary(shared)


def test_host_load_meter_counts_other_processes_cpu_time(monkeypatch):
    busy = iter([100.0, 103.5])  # the machine's busy CPU seconds before and after
    own = iter([10.0, 11.0])  # this process's
    wall = iter([0.0, 2.0])
    monkeypatch.setattr(perf.meters, "_system_busy_seconds", lambda: next(busy))
    monkeypatch.setattr(perf.meters, "_own_cpu_seconds", lambda: next(own))
    monkeypatch.setattr(perf.meters.time, "monotonic", lambda: next(wall))
    with perf.meters.HostLoadMeter() as meter:
        pass
    assert meter.result.other_cores == pytest.approx((3.5 - 1.0) / 2.0) and meter.result.busy
    quiet = iter([100.0, 101.1])
    own, wall = iter([10.0, 11.0]), iter([0.0, 2.0])
    monkeypatch.setattr(perf.meters, "_system_busy_seconds", lambda: next(quiet))
    with perf.meters.HostLoadMeter() as meter:
        pass
    assert meter.result.other_cores == pytest.approx(0.05) and not meter.result.busy


def test_an_fp32_run_reports_no_speed_up(tmp_path, monkeypatch, capsys):
    """An fp32 run is its own reference: timing a copy of it would print a 'speed-up' of noise."""
    monkeypatch.setattr(perf.tracker, "time_updates", _must_not_time)
    _, logger, _ = _fit_tracked(tmp_path, monkeypatch, "precision=fp32")
    logged = set().union(*(m for _, m in logger.rows))
    assert not {k for k in logged if "fp32" in k}
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["speedup_vs_fp32"] is None and summary["fp32"] is None
    assert summary["speedup_basis"] == "none: this run is fp32, the reference itself"
    markdown = (tmp_path / "run" / "summary.md").read_text()
    assert "speed-up" not in markdown.replace("no speed-up figure", "")
    assert "no fp32 calibration" in capsys.readouterr().out


def _must_not_time(*args, **kwargs):
    raise AssertionError("the fp32 reference was timed")


def test_a_busy_host_marks_the_estimate_unreliable(tmp_path, monkeypatch):
    monkeypatch.setattr(perf.meters, "BUSY_OTHER_CORES", 0.0)  # any other process counts as busy
    _fit_tracked(tmp_path, monkeypatch, "precision=fp16")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["speedup_reliable"] is False and summary["fp32"]["host_busy"] is True
    assert "fp32 start-up estimate over 2 updates" in summary["speedup_basis"]
    assert "unreliable: the host was busy" in (tmp_path / "run" / "summary.md").read_text()


def test_resuming_reuses_the_saved_fp32_reference(tmp_path, monkeypatch, capsys):
    """The reference is saved in the checkpoint (safe to load: plain data) and a resumed run
    reuses it rather than timing a few start-up updates again."""
    from pixelsac.checkpoint import callback_state

    first, _, _ = _fit_tracked(tmp_path / "a", monkeypatch, "precision=fp16", save_to=tmp_path / "last.ckpt")
    saved = callback_state(torch.load(tmp_path / "last.ckpt", weights_only=True), "PerfTracker")
    assert saved["fp32"]["ms_per_update"] == first.fp32.ms_per_update
    capsys.readouterr()
    monkeypatch.setattr(perf.tracker, "time_updates", _must_not_time)
    resumed, logger, _ = _fit_tracked(tmp_path / "b", monkeypatch, "precision=fp16", tracker_state=saved)
    assert resumed.fp32 == first.fp32
    assert "fp32 reference from the checkpoint, not timed again" in capsys.readouterr().out
    summary = json.loads((tmp_path / "b" / "run" / "summary.json").read_text())
    assert summary["speedup_basis"].endswith("saved in the checkpoint, not timed again")
    assert summary["fp32"]["ms_per_update"] == first.fp32.ms_per_update


def _replay(device=None, pin_memory=False):
    """A stand-in for the run's ReplaySet: where its rings live and whether they pin batches."""
    return types.SimpleNamespace(device=device, buffers=[types.SimpleNamespace(pin_memory=pin_memory)])


@pytest.mark.parametrize(
    "replay,device,source",
    [
        (_replay(torch.device("cuda", 0)), "cuda", "device"),  # replay.device=auto on a GPU
        (_replay(None, pin_memory=True), "cuda", "pinned"),  # host rings, replay.pin_memory (CUDA default)
        (_replay(None, pin_memory=False), "cuda", "host"),  # replay.pin_memory=false
        (_replay(None, pin_memory=False), "cpu", "host"),
        (_replay(torch.device("cuda", 0)), "cpu", "host"),  # a CPU update reads host tensors whatever
        (None, "cuda", "host"),  # a collector without a replay
    ],
)
def test_the_batch_source_is_where_the_runs_replay_hands_its_batches(replay, device, source):
    assert perf.batch_source_of(replay, torch.device(device)) == source


def test_place_batch_moves_only_where_asked():
    batch = perf.synthetic_batch(4, OBS_SHAPE, ACTION_DIM)
    assert perf.place_batch(batch, "host", torch.device("cpu")) is batch
    on_device = perf.place_batch(batch, "device", torch.device("cpu"))
    assert all(torch.equal(on_device[k], batch[k]) for k in batch)
    with pytest.raises(ValueError, match="batch source 'disk'"):
        perf.place_batch(batch, "disk", torch.device("cpu"))


@pytest.mark.parametrize(
    "replay,source", [(_replay(torch.device("cuda", 0)), "device"), (_replay(None, pin_memory=True), "pinned")]
)
def test_the_fp32_calibration_is_fed_the_runs_kind_of_batch(tmp_path, monkeypatch, replay, source):
    """A CUDA run samples pinned or on-device batches: its fp32 reference must not pay a
    synchronous pageable copy the run does not (that biased the in-loop speed-up toward fp16).
    On this CPU the placement and the timing are stand-ins; the GPU test below places for real."""
    placed, timed_on = [], []

    def place(batch, where, device):
        placed.append((where, device))
        return batch

    def time_updates(config, obs_shape, action_dim, batch, device, updates, warmup, **kwargs):
        timed_on.append(batch)
        return perf.TimedUpdates(
            ms=[5.0, 5.0],
            state={"parameters": 1, "optimizer": 1, "target": 1, "total": 3},
            peak_bytes=None,
            finite_after_first=True,
            finite_at_end=True,
            skipped={},
            loss_scales={},
        )

    monkeypatch.setattr(perf.tracker, "place_batch", place)
    monkeypatch.setattr(perf.tracker, "time_updates", time_updates)
    cfg = load_config([*TINY_AGENT, "precision=fp16"])
    module = SACModule(to_plain(cfg), OBS_SHAPE, ACTION_DIM)
    tracker = perf.PerfTracker(types.SimpleNamespace(replay=replay), tmp_path / "run", cfg)
    reference = tracker.calibrate(module, torch.device("cuda", 0))
    assert placed == [(source, torch.device("cuda", 0))] and len(timed_on) == 1
    assert reference.batch_source == source
    expected = {"device": "batches on the device", "pinned": "batches in pinned host memory"}[source]
    assert expected in reference.describe()
    # a reference saved before the batch source was recorded reads as a host batch
    old = {k: v for k, v in dataclasses.asdict(reference).items() if k != "batch_source"}
    tracker.load_state_dict({"fp32": old, "batch_size": tracker.batch_size})
    assert tracker.fp32.batch_source == "host" and "batches" not in tracker.fp32.describe()


@pytest.mark.gpu
def test_placed_batches_are_pinned_or_on_the_gpu():
    batch = perf.synthetic_batch(4, OBS_SHAPE, ACTION_DIM)
    device = torch.device("cuda", 0)
    assert all(v.is_pinned() for v in perf.place_batch(batch, "pinned", device).values())
    assert all(v.device == device for v in perf.place_batch(batch, "device", device).values())
    assert not any(v.is_pinned() for v in perf.place_batch(batch, "host", device).values())
