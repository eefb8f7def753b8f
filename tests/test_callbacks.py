"""pixelsac/callbacks.py, the parts no end-to-end test isolates: the plain progress line of a
log that is not a terminal, the progress bar's frame count, stopping once the budget is
collected, and the training logger's rows (one per finished episode, one per log interval)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pixelsac.callbacks import PlainProgress, StopWhenCollected, TrainingLogger
from pixelsac.collect import Episode


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_plain_progress_prints_a_line_every_interval_only():
    collector = SimpleNamespace(total_env_frames=0)
    clock, lines = Clock(), []
    evaluator = SimpleNamespace(last_return=None)  # what the Evaluator sets after each evaluation
    bar = PlainProgress(collector, 1000, 30.0, evaluator, clock=clock, out=lambda text, flush: lines.append(text))
    trainer = SimpleNamespace()
    module = SimpleNamespace(updates=0)
    bar.on_train_start(trainer, module)
    for step in range(1, 100):  # one update per simulated second
        clock.now, collector.total_env_frames, module.updates = float(step), 4 * step, step
        if step == 70:
            evaluator.last_return = 123.25
        bar.on_train_batch_end(trainer, module, None, None, step)
    assert lines == [
        "progress: env frames 120/1,000 (12%), updates 30, 4.0 frames/s",
        "progress: env frames 240/1,000 (24%), updates 60, 4.0 frames/s",
        "progress: env frames 360/1,000 (36%), updates 90, 4.0 frames/s, last eval return 123.2",
    ]
    assert all("\r" not in line for line in lines)
    bar.disable()
    clock.now = 1000.0
    bar.on_train_batch_end(trainer, module, None, None, 100)
    assert len(lines) == 3


def test_runs_pick_the_plain_line_when_stderr_is_not_a_terminal(monkeypatch):
    from pixelsac import run

    monkeypatch.setattr("sys.stderr", SimpleNamespace(isatty=lambda: False))
    assert not run.progress_is_a_terminal()
    monkeypatch.setattr("sys.stderr", SimpleNamespace(isatty=lambda: True))
    assert run.progress_is_a_terminal()


def test_stop_when_collected_ends_fit_at_the_epoch_end_after_the_budget():
    stream = SimpleNamespace(exhausted=False)
    trainer = SimpleNamespace(should_stop=False)
    callback = StopWhenCollected(stream)
    callback.on_train_epoch_end(trainer, None)
    assert not trainer.should_stop
    stream.exhausted = True
    callback.on_train_epoch_end(trainer, None)
    assert trainer.should_stop


class Logger:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step):
        self.rows.append((step, dict(metrics)))


class Module:
    def __init__(self) -> None:
        self.metrics: dict = {}
        self.updates = 3
        self.skipped = {"critic": 1}
        self.logged: dict = {}

    def loss_scales(self):
        return {"critic": 256.0}

    def lowp_records(self):
        return {"target_peak": 0.25}, []

    def log(self, name, value, **kwargs):
        self.logged[name] = value


def test_training_logger_rows_episodes_and_intervals():
    collector = SimpleNamespace(
        env_frames=50, agent_steps=25, total_env_frames=50, total_agent_steps=25, finished=[Episode(40, 12.5, 20)]
    )
    collector.drain_episodes = lambda: [collector.finished.pop()] if collector.finished else []
    logger, module = Logger(), Module()
    trainer = SimpleNamespace(loggers=[logger])
    callback = TrainingLogger(collector)
    callback.on_train_batch_end(trainer, module, None, None, 0)
    assert logger.rows == [(40, {"train/episode_return": 12.5, "train/episode_length": 20, "env_frames": 40})]
    module.metrics = {"critic_loss": torch.tensor(0.5)}
    callback.on_train_batch_end(trainer, module, None, None, 1)
    step, row = logger.rows[-1]
    assert step == 50 and row["train/critic_loss"] == 0.5 and row["lowp/loss_scale_critic"] == 256.0
    assert row["lowp/skipped_critic"] == 1 and row["updates"] == 3 and row["lowp/target_peak"] == 0.25
    assert module.metrics == {} and callback.progress == {"return": 12.5, "critic_loss": 0.5}
    callback.on_train_batch_end(trainer, module, None, None, 2)  # nothing new: no row
    assert len(logger.rows) == 2


def test_the_progress_bar_reads_no_tensor_when_it_redraws(tmp_path):
    """A real Trainer with the bar redrawn at every batch: the bar shows frames, the episode
    return and the critic loss, and reads no tensor value (``aten._local_scalar_dense``, what
    ``.item()`` runs: a device-to-host wait on a GPU) in any batch-end redraw."""
    import lightning as L
    from torch.utils._python_dispatch import TorchDispatchMode

    from pixelsac.callbacks import ProgressBar

    class CountReads(TorchDispatchMode):
        reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                CountReads.reads += 1
            return func(*args, **(kwargs or {}))

    class CountedBar(ProgressBar):
        def on_train_batch_end(self, *args):
            with CountReads():
                super().on_train_batch_end(*args)
            self.shown = self.get_metrics(args[0], args[1])

    class Agent(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.updates, self.metrics, self.skipped = 0, {}, {}

        def training_step(self, batch):
            self.updates += 1
            if self.updates % 4 == 0:  # a log interval: losses as tensors, as SACModule hands them over
                self.metrics = {"critic_loss": torch.tensor(0.25 * self.updates)}

        def loss_scales(self):
            return {}

        def lowp_records(self):
            return {}, []

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    collector = SimpleNamespace(total_env_frames=0, total_agent_steps=0, finished=[Episode(8, 3.5, 8)])
    collector.drain_episodes = lambda: [collector.finished.pop()] if collector.finished else []
    bar = CountedBar(collector)
    trainer = L.Trainer(
        max_epochs=1,
        callbacks=[TrainingLogger(collector), bar],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Agent(), torch.utils.data.DataLoader([torch.zeros(1)] * 12, batch_size=None))
    assert CountReads.reads == 0
    assert bar.shown == {"frames": "0", "return": 3.5, "critic_loss": 3.0}


def test_a_resume_says_when_the_csv_logs_last_line_was_cut_off(tmp_path, capsys):
    """A write cut off mid-row left metrics.csv ending in a torn line, which a resume kept as a
    row of partial values without a word. It is dropped, and said."""
    from pixelsac.logs import LoggersAfterRestore

    metrics = tmp_path / "metrics.csv"
    whole = "step,env_frames,train/critic_loss\r\n160,160,0.5\r\n192,192,0.25\r\n"
    metrics.write_text(whole + "224,224,0.1", newline="")  # the last row's write cut off
    trainer = SimpleNamespace(is_global_zero=True, loggers=[])
    LoggersAfterRestore(tmp_path, resume_frames=256, pending_eval_frames=None).on_fit_start(trainer, None)
    out = capsys.readouterr().out
    assert f"pixelsac: {metrics}'s last line was cut off by a write that did not finish ('224,224,0.1'): dropped" in out
    assert metrics.read_bytes() == whole.encode()  # the whole rows, as they were
