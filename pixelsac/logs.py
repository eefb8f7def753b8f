"""A training run's logs: ``metrics.csv``, ``hparams.yaml`` and TensorBoard's ``tb/``.

Lightning's CSV and TensorBoard loggers, with what they write changed in three ways:

* They are attached once ``fit`` has restored the checkpoint and its replay
  (:class:`LoggersAfterRestore`): a resume that fails to load leaves the logs as they were. On
  resume the CSV keeps its rows up to the checkpoint's frame (later ones were never
  checkpointed), less the row of an evaluation the checkpoint holds as in flight.
* Every file is written through :mod:`pixelsac.files`: ``hparams.yaml`` and a ``metrics.csv``
  whose columns change are replaced whole (temporary file, rename); rows and TensorBoard's event
  records are appended whole or cut off again. None is written through a link.
* TensorBoard's event file is written in the calling thread (:class:`EventFile`). TensorBoard's
  own writer hands records to a thread, whose failure on a full disk printed that thread's
  traceback and reached the run as an error that named no file; here the failed write is an
  OSError naming the event file, raised where the run logged.
"""

from __future__ import annotations

import csv
import io
import itertools
import os
import socket
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from pixelsac import files


class LoggersAfterRestore(L.Callback):
    """Gives the Trainer its loggers in ``on_fit_start``: after ``fit`` restored the module and
    callbacks (the Checkpointer's replay included) and before anything logs. Until then the run
    directory's ``metrics.csv`` and ``tb/`` are untouched. The kept rows are written atomically
    (temporary file, rename), so a fault mid-write leaves the old file whole."""

    def __init__(self, run_dir: Path, resume_frames: int | None, pending_eval_frames: int | None) -> None:
        self.run_dir, self.resume_frames, self.pending_eval_frames = Path(run_dir), resume_frames, pending_eval_frames

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        metrics = self.run_dir / "metrics.csv"
        header: list[str] = []
        if trainer.is_global_zero:
            header, kept_rows = rows_until(metrics, self.resume_frames) if self.resume_frames is not None else ([], [])
            torn = torn_line(metrics) if self.resume_frames is not None else None
            if torn is not None:
                print(
                    f"pixelsac: {metrics}'s last line was cut off by a write that did not finish ({torn!r}): "
                    "dropped; the resumed run logs what it held again if it came after the checkpoint",
                    flush=True,
                )
            if self.pending_eval_frames is not None:
                kept_rows = [
                    row
                    for row in kept_rows
                    if not (row.get("eval/return") and float(row["step"]) >= self.pending_eval_frames)
                ]
            if header:
                files.write_atomically(metrics, csv_text(header, kept_rows, with_header=True))
            else:
                metrics.unlink(missing_ok=True)  # a fresh start: rows of an attempt that saved nothing go
        csv_logger = RunCSVLogger(self.run_dir, name="", version="")
        if header:
            csv_logger.experiment.metrics_keys = sorted(header)
        trainer.loggers = [csv_logger, RunTensorBoardLogger(self.run_dir, name="tb", version="")]


def log_metrics(trainer: L.Trainer, metrics: dict[str, float], step: int) -> None:
    """``metrics`` to every logger of ``trainer`` at ``step`` (env frames)."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


def rows_until(metrics: Path, frames: int) -> tuple[list[str], list[dict[str, str]]]:
    """The CSV log's header and its rows logged at env frames up to ``frames`` (later rows were
    never checkpointed: a resumed run logs them again)."""
    header, rows = read_rows(metrics)
    return header, [row for row in rows if row.get("step") and float(row["step"]) <= frames]


def read_rows(metrics: Path) -> tuple[list[str], list[dict[str, str]]]:
    """The CSV log's header and whole rows (a last line without its line end, cut off by a write
    that did not finish, is not one: :func:`torn_line`); none when there is no log yet."""
    if not metrics.is_file():
        return [], []
    with open(metrics, newline="") as f:
        text = f.read()
    if not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    reader = csv.DictReader(io.StringIO(text, newline=""))
    return list(reader.fieldnames or []), list(reader)


def torn_line(metrics: Path) -> str | None:
    """The start of the CSV log's last line when it lacks its line end (a write cut off), else None."""
    try:
        with open(metrics, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            tail = f.read()
    except FileNotFoundError:
        return None
    if not tail or tail.endswith(b"\n"):
        return None
    last = tail.rsplit(b"\n", 1)[-1].decode(errors="replace")
    return last if len(last) <= 40 else last[:40] + "..."


def csv_text(header: list[str], rows: list[dict[str, Any]], with_header: bool) -> str:
    """Rows as Lightning's CSV logger writes them (``csv`` defaults: ``\\r\\n`` line ends)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=header)
    if with_header:
        writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def hparams_text(hparams: dict[str, Any]) -> str:
    """``hparams.yaml`` as Lightning writes it (OmegaConf's YAML; a run's are plain values)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(dict(hparams)))


class RunCSVWriter(ExperimentWriter):
    """Lightning's CSV writer, writing through :mod:`pixelsac.files`: rows are appended whole, a
    new column rewrites the file atomically, ``hparams.yaml`` is replaced whole. And it does not
    delete an existing ``metrics.csv`` when it is created: :class:`LoggersAfterRestore` has just
    written there the rows a resumed run keeps."""

    def _check_log_dir_exists(self) -> None:
        pass

    def log_hparams(self, params: dict[str, Any]) -> None:
        self.hparams.update(params)
        files.write_atomically(Path(self.log_dir) / self.NAME_HPARAMS_FILE, hparams_text(self.hparams))

    def save(self) -> None:
        if not self.metrics:
            return
        path = Path(self.metrics_file_path)
        new_keys = self._record_new_keys()
        if new_keys or not path.is_file():  # a new header: the whole file again, atomically
            _, old_rows = read_rows(path)
            files.write_atomically(path, csv_text(self.metrics_keys, old_rows + self.metrics, with_header=True))
        else:
            log = files.RecordFile(path)
            try:
                log.write(csv_text(self.metrics_keys, self.metrics, with_header=False).encode())
            finally:
                log.close()
        self.metrics = []


class RunCSVLogger(CSVLogger):
    """Lightning's CSV logger with :class:`RunCSVWriter`."""

    @property
    def experiment(self) -> Any:
        if self._experiment is None:
            Path(self.root_dir).mkdir(parents=True, exist_ok=True)
            self._experiment = RunCSVWriter(log_dir=self.log_dir)
        return self._experiment


_EVENT_FILES = itertools.count()  # several event files of one process get different names


class EventFile:
    """A TensorBoard event file written in the calling thread, one whole record at a time
    (:class:`pixelsac.files.RecordFile`); what torch's ``FileWriter`` calls its event writer.
    Named as TensorBoard names them: ``events.out.tfevents.<time>.<host>.<pid>.<n>``."""

    def __init__(self, log_dir: str, filename_suffix: str = "") -> None:
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._log_dir = str(log_dir)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
        self.path = Path(log_dir) / f"{name}.{next(_EVENT_FILES)}{filename_suffix}"
        self._file = files.RecordFile(self.path, new=True)
        self._records = RecordWriter(self)  # frames each record (length, CRCs) and calls write() once
        self.add_event(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def write(self, record: bytes) -> None:
        self._file.write(record)

    def add_event(self, event: Any) -> None:
        self._records.write(event.SerializeToString())

    def flush(self) -> None:
        pass  # every record is in the file once add_event returns

    def close(self) -> None:
        self._file.close()

    def reopen(self) -> None:
        pass  # never closed while the run logs

    def get_logdir(self) -> str:
        return self._log_dir


def _summary_writer(log_dir: str) -> Any:
    """torch's ``SummaryWriter`` over an :class:`EventFile` (a torch ``FileWriter`` whose event
    writer is one): everything Lightning calls on it works as before, in this thread."""
    from torch.utils.tensorboard.writer import FileWriter, SummaryWriter

    class InThreadFileWriter(FileWriter):
        def __init__(self, log_dir: str, filename_suffix: str = "") -> None:  # no queue, no thread
            self.event_writer = EventFile(log_dir, filename_suffix)

    class InThreadSummaryWriter(SummaryWriter):
        def _get_file_writer(self) -> Any:
            if self.all_writers is None or self.file_writer is None:
                self.file_writer = InThreadFileWriter(self.log_dir, self.filename_suffix)
                self.all_writers = {self.file_writer.get_logdir(): self.file_writer}
            return self.file_writer

    return InThreadSummaryWriter(log_dir=log_dir)


class RunTensorBoardLogger(TensorBoardLogger):
    """Lightning's TensorBoard logger over an :class:`EventFile`, its ``hparams.yaml`` replaced
    whole through :mod:`pixelsac.files`."""

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._experiment is None:
            Path(self.log_dir).mkdir(parents=True, exist_ok=True)
            self._experiment = _summary_writer(self.log_dir)
        return self._experiment

    @rank_zero_only
    def log_metrics(self, metrics: Any, step: int | None = None) -> None:
        try:
            super().log_metrics(metrics, step)
        except ValueError as exc:  # Lightning calls every failure of add_scalar a value it cannot log
            if isinstance(exc.__cause__, OSError):
                raise exc.__cause__ from None  # a failed write: the OSError naming the event file
            raise

    @rank_zero_only
    def save(self) -> None:
        self.experiment.flush()
        hparams = Path(self.log_dir) / self.NAME_HPARAMS_FILE
        if Path(self.log_dir).is_dir() and not hparams.is_file():
            files.write_atomically(hparams, hparams_text(self.hparams))
