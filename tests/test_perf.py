"""Throughput and memory tracking: the clock, the memory probe, the fp32 calibration and the
run callback's logs and summary -- on a tiny agent fitted on synthetic batches, no environment."""

import json
import math
import mmap
import time
import types

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, IterableDataset

from pixelsac import perf
from pixelsac.config import load_config, to_plain
from pixelsac.module import SACModule

OBS_SHAPE = (9, 24, 24)
ACTION_DIM = 2
TINY_AGENT = ["env.image_size=24", "agent.num_filters=4", "agent.feature_dim=8", "agent.hidden_dim=16",
              "agent.batch_size=4"]
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
    timed = perf.time_updates(to_plain(cfg), OBS_SHAPE, ACTION_DIM, perf.synthetic_batch(4, OBS_SHAPE, ACTION_DIM),
                              torch.device("cpu"), updates=2, warmup=1)
    assert torch.equal(torch.rand(3), expected)
    assert len(timed.ms) == 2 and all(ms > 0 for ms in timed.ms)
    assert timed.finite_after_first and timed.finite_at_end
    assert timed.peak_bytes is None  # no per-run peak is measurable in-process on a CPU
    assert timed.state["total"] == timed.state["parameters"] + timed.state["optimizer"] + timed.state["target"]


def test_fp32_reference_config_resets_every_switch():
    cfg = to_plain(load_config(["precision=fp16", "lowp.hadam=true", "lowp.all=true", "lowp.fp32_accumulate=true"]))
    reference = perf.fp32_reference_config(cfg)
    assert reference["precision"] == "fp32"
    assert all(reference["lowp"][k] is None for k in ("all", "hadam", "loss_scaling", "kahan_gradients",
                                                      "kahan_momentum", "softplus_fix", "normal_fix", "fp32_accumulate"))
    assert cfg["precision"] == "fp16" and cfg["lowp"]["hadam"] is True  # the run's own config is untouched


def test_summary_ratios_come_from_the_measured_values():
    fp32 = perf.Fp32Reference(ms_per_update=30.0, ms_std=1.0, updates=3, warmup=1,
                              state={"parameters": 400, "optimizer": 800, "target": 400, "total": 1600},
                              peak_bytes=8000, seconds=1.0)
    summary = perf.build_summary(
        precision="fp16", device="cuda:0", batch_size=512, env_frames=1000, agent_steps=250, updates=200,
        wall_s=4.0, ms=[10.0, 14.0], peak_bytes=5000, peak_kind="cuda_max_allocated",
        state={"parameters": 200, "optimizer": 500, "target": 300, "total": 1000},
        loss_scales={"critic": 1e4}, skipped={"critic": 1}, best_eval_return=12.5, fp32=fp32)
    assert summary["ms_per_update"] == 12.0
    assert summary["speedup_vs_fp32"] == pytest.approx(30.0 / 12.0)
    assert summary["memory_vs_fp32"] == pytest.approx(1000 / 1600)
    assert summary["peak_memory_vs_fp32"] == pytest.approx(5000 / 8000)
    assert summary["env_frames_per_s"] == 250.0 and summary["updates_per_s"] == 50.0
    # a CPU's process-wide RSS cannot be compared with the fp32 copy's: no peak ratio
    cpu = perf.build_summary(**{**dict(precision="fp16", device="cpu", batch_size=4, env_frames=8, agent_steps=1,
                                       updates=1, wall_s=1.0, ms=[5.0], peak_bytes=10, state=None, loss_scales={},
                                       skipped={}, best_eval_return=None, fp32=fp32)}, peak_kind="rss_high_water")
    assert cpu["peak_memory_vs_fp32"] is None and cpu["memory_vs_fp32"] is None
    assert "2.50x speed-up" in perf.format_summary(summary)


class StopAt(L.Callback):
    """Raises after a given number of updates, like a run stopped for non-finite weights."""

    def __init__(self, updates: int) -> None:
        self.updates = updates

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.updates >= self.updates:
            raise RuntimeError("stopped for the test")


def _fit_tracked(tmp_path, monkeypatch, *overrides, extra_callbacks=()):
    clock = FakeClock()
    monkeypatch.setattr(perf, "_now", clock)
    cfg = load_config([*TINY_AGENT, "train.log_every_updates=2", "perf.calibrate_updates=2",
                       "perf.warmup_updates=1", *overrides])
    torch.manual_seed(0)
    module = SACModule(to_plain(cfg), OBS_SHAPE, ACTION_DIM)
    collector = types.SimpleNamespace(env_frames=0, agent_steps=0)
    tracker = perf.PerfTracker(collector, tmp_path / "run", cfg)
    logger = RecordingLogger()
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=logger, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[tracker, *extra_callbacks])
    trainer.fit(module, DataLoader(FakeStream(collector, clock, batches=5), batch_size=None))
    return tracker, logger, module


def test_tracker_logs_every_figure_and_writes_the_summary(tmp_path, monkeypatch, capsys):
    tracker, logger, module = _fit_tracked(tmp_path, monkeypatch, "precision=fp16")
    calibration = [m for _, m in logger.rows if "perf/fp32_ms_per_update" in m]
    intervals = [(step, m) for step, m in logger.rows if "perf/ms_per_update" in m]
    assert len(calibration) == 1 and calibration[0]["perf/fp32_ms_per_update"] > 0
    assert [step for step, _ in intervals] == [16, 32]  # every 2 updates, step = env frames then
    named = {"perf/env_frames_per_s", "perf/updates_per_s", "perf/ms_per_update", "perf/peak_rss_mib",
             "perf/state_bytes", "perf/state_bytes_parameters", "perf/state_bytes_optimizer",
             "perf/state_bytes_target", "perf/speedup_vs_fp32", "perf/memory_vs_fp32",
             "lowp/loss_scale_critic", "lowp/loss_scale_actor", "lowp/loss_scale_alpha",
             "lowp/skipped_critic", "lowp/skipped_actor", "lowp/skipped_alpha", "env_frames", "updates"}
    fp32_ms, fp32_bytes = calibration[0]["perf/fp32_ms_per_update"], calibration[0]["perf/fp32_state_bytes"]
    for step, row in intervals:
        assert named <= set(row), named - set(row)
        assert row["env_frames"] == step
        # collecting (a 1000 s jump of the stand-in clock per env step) is not part of an update
        assert 0 < row["perf/ms_per_update"] < FETCH_SECONDS * 1e3
        assert row["perf/speedup_vs_fp32"] == pytest.approx(fp32_ms / row["perf/ms_per_update"])
        assert row["perf/memory_vs_fp32"] == pytest.approx(row["perf/state_bytes"] / fp32_bytes)
        assert row["perf/memory_vs_fp32"] < 1  # fp16 + six holds fewer bytes than fp32 Adam, Kahan buffers included
        assert row["perf/peak_rss_mib"] > 0
    assert module.updates == 5 and len(tracker._ms_all) == 4  # the first live update is warm-up

    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["updates"] == 5 and summary["env_frames"] == 40 and summary["timed_updates"] == 4
    assert summary["ms_per_update"] == pytest.approx(sum(tracker._ms_all) / 4)
    assert summary["speedup_vs_fp32"] == pytest.approx(summary["fp32"]["ms_per_update"] / summary["ms_per_update"])
    assert summary["memory_vs_fp32"] == pytest.approx(summary["state_bytes"]["total"] / summary["fp32"]["state"]["total"])
    assert summary["peak_memory_kind"].startswith("rss_high_water") and summary["peak_memory_bytes"] > 0
    assert set(summary["loss_scales"]) == set(summary["skipped"]) == {"critic", "actor", "alpha"}
    assert summary["best_eval_return"] is None  # no Evaluator in this fit
    markdown = (tmp_path / "run" / "summary.md").read_text()
    for what in ("ms / update", "speed-up", "peak memory", "state bytes", "loss scales", "skipped steps"):
        assert what in markdown
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
        _fit_tracked(tmp_path, monkeypatch, "precision=fp32", "perf.calibrate_updates=0",
                     extra_callbacks=[StopAt(3)])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["updates"] == 3 and summary["stopped_by"] == "RuntimeError: stopped for the test"
    assert "stopped early" in (tmp_path / "run" / "summary.md").read_text()
