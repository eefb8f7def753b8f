"""How a run writes its files (pixelsac/files.py) and its logs (pixelsac/logs.py): whole or not at
all, never through a link, and a failed write is an OSError naming its file -- TensorBoard's event
file included, written in the calling thread."""

import errno
import os
import subprocess
import threading

import pytest

from pixelsac import files

AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


@pytest.fixture
def full_disk(tmp_path):
    """A 256 KiB tmpfs (root only) and a function that fills it up."""
    if not AS_ROOT:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")

    def fill() -> None:
        fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError:
            pass
        finally:
            os.close(fd)

    yield mount, fill
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("planted", ["final", "temporary"])
def test_an_atomic_write_replaces_a_planted_link_and_never_writes_its_target(tmp_path, planted):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    path = tmp_path / "summary.json"
    (path if planted == "final" else files.temporary_name(path)).symlink_to(victim)
    files.write_atomically(path, "{}\n")
    assert victim.read_text() == "precious\n"
    assert not path.is_symlink() and path.read_text() == "{}\n"
    assert not files.temporary_name(path).exists()


def test_appending_to_a_link_is_refused(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "metrics.csv").symlink_to(victim)
    with pytest.raises(OSError) as caught:
        files.RecordFile(tmp_path / "metrics.csv")
    assert caught.value.errno == errno.ELOOP and caught.value.filename == str(tmp_path / "metrics.csv")
    assert victim.read_text() == "precious\n"


def test_a_full_disk_leaves_the_old_file_whole_and_no_temporary(full_disk):
    mount, fill = full_disk
    path = mount / "summary.json"
    files.write_atomically(path, "old\n")
    fill()
    with pytest.raises(OSError) as caught:
        files.write_atomically(path, "x" * 100_000)
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(files.temporary_name(path))
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in mount.iterdir()) == ["filler", "summary.json"]


def test_a_record_that_does_not_fit_is_cut_off_again(full_disk):
    mount, fill = full_disk
    log = files.RecordFile(mount / "metrics.csv", new=True)
    log.write(b"a,b\r\n1,2\r\n")
    fill()
    with pytest.raises(OSError) as caught:
        log.write(b"3,4\r\n" * 20_000)
    log.close()
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(mount / "metrics.csv")
    assert (mount / "metrics.csv").read_bytes() == b"a,b\r\n1,2\r\n"


def test_a_full_disk_under_tensorboard_is_an_error_naming_the_event_file_in_this_thread(full_disk, monkeypatch):
    from pixelsac.logs import RunTensorBoardLogger

    mount, fill = full_disk
    died = []
    monkeypatch.setattr(threading, "excepthook", died.append)  # a writer thread's failure would land here
    logger = RunTensorBoardLogger(mount, name="tb", version="")
    logger.log_metrics({"train/critic_loss": 1.0}, step=8)
    events = sorted((mount / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1
    written = events[0].stat().st_size
    fill()
    with pytest.raises(OSError) as caught:
        for step in range(10_000):
            logger.log_metrics({"train/critic_loss": 1.0, "train/actor_loss": 2.0}, step=step)
        logger.save()
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(events[0])
    assert events[0].stat().st_size >= written and not died
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    assert len(list(EventFileLoader(str(events[0])).Load())) > 2  # whole records, readable to the end
