"""A run directory under attack or carelessness: trust comes from the command line only, one
process writes a directory, a failed resume keeps every logged row, ``overwrite`` leaves nothing
to resume, a value that makes a run meaningless is refused, a fault is one line with its exit
code, and a signal after the save does not change the exit code.

The end-to-end cases run ``python -m pixelsac.train`` on copies of the session's tiny fp32 run
(320 frames, evaluations at 160 and 320; ``best.ckpt`` from 160, ``last.ckpt`` at 320).
"""

import csv
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TESTS, TINY, cli_env, main_in, run_cli, start_cli
from overrides import merged

EXIT_BAD_INPUT, EXIT_NUMERICAL, EXIT_IO_FAULT, EXIT_STOPPED = 2, 3, 74, 75
FAST = [*TINY, "precision=fp32", "perf.calibrate_updates=0", "train.video_every_evals=0", "train.num_threads=1"]
AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def copy_run(trained, tmp_path: Path, name: str = "run") -> Path:
    run_dir = tmp_path / name
    shutil.copytree(trained.run_dir, run_dir)
    (run_dir / ".lock").unlink(missing_ok=True)
    return run_dir


def csv_rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def one_error_line(stderr: str) -> str:
    """The one ``error:`` line of a refusal or fault, with no traceback around it."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, stderr[-3000:]
    return errors[0]


# --- 1. trust: from the command line only, for one load ------------------------------------------

SWAP_THEN_TRAIN = """
import shutil, sys
import pixelsac.run as run_mod
import pixelsac.train as train_mod

hook, evil, target = sys.argv[1:4]
real = getattr(run_mod, hook)

def swapping(*args, **kwargs):  # after the checkpoint was checked, before fit restores it
    shutil.copy(evil, target)
    return real(*args, **kwargs)

setattr(run_mod, hook, swapping)
sys.exit(train_mod.main(sys.argv[4:]))
"""


class RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("swap_in", ["build_run", "write_run_dir"])
def test_a_stored_trust_flag_and_a_file_swapped_after_the_check_run_no_code(tiny_fp32_run, tmp_path, swap_in):
    """The pickle is swapped onto last.ckpt after resolve_run checked it: while the run is being
    built (before it locks the directory: refused, the file changed), or after the lock (the run
    restores from the dict it checked and never reads the file again)."""
    run_dir = copy_run(tiny_fp32_run, tmp_path)
    last = run_dir / "checkpoints" / "last.ckpt"
    stored = torch.load(last, map_location="cpu", weights_only=True)
    stored["hyper_parameters"]["config"]["trust_checkpoint"] = True  # still a weights-only file
    torch.save(stored, last)
    marker = tmp_path / "code-ran"
    evil = tmp_path / "evil.ckpt"
    torch.save({**stored, "payload": RunsCode(str(marker))}, evil)

    result = subprocess.run(
        [sys.executable, "-c", SWAP_THEN_TRAIN, swap_in, str(evil), str(last)]
        + [f"resume={run_dir}", "train.env_frames=400"],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert not marker.exists(), "the swapped-in pickle ran its code"
    assert f"warning: {last} stores trust_checkpoint=true; ignored" in result.stderr
    if swap_in == "build_run":
        assert result.returncode == EXIT_BAD_INPUT, result.stderr[-3000:]
        assert f"{last} changed after it was loaded" in one_error_line(result.stderr)
        return
    assert result.returncode == 0, result.stderr[-3000:]
    # never stored again: not in config.yaml, not in the new checkpoint
    assert "trust_checkpoint" not in (run_dir / "config.yaml").read_text()
    resumed = torch.load(last, map_location="cpu", weights_only=True)
    assert "trust_checkpoint" not in resumed["hyper_parameters"]["config"]
    assert resumed["callbacks"]["Checkpointer"]["collector"]["env_frames"] >= 400


# --- 2. one writer per run directory -------------------------------------------------------------


def test_a_second_process_on_a_run_directory_exits_2_naming_the_holder_and_a_killed_holder_frees_it(
    tiny_fp32_run, tmp_path
):
    run_dir = copy_run(tiny_fp32_run, tmp_path)
    command = [f"run_dir={run_dir}", "resume=auto", "train.env_frames=1280", "trainer.enable_progress_bar=false"]
    first = start_cli(*command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        for line in first.stdout:
            if line.startswith("run directory:"):  # printed once the directory is locked
                break
        second = run_cli(*command, cwd=tmp_path)
        first_running = first.poll() is None
    finally:
        first.send_signal(signal.SIGKILL)  # a hard kill: the kernel drops the lock
        first.wait()
    assert second.returncode == EXIT_BAD_INPUT, f"both ran (the first still running: {first_running})"
    assert first_running
    line = one_error_line(second.stderr)
    assert f"is in use by pid {first.pid} on host {socket.gethostname()}" in line, line
    from pixelsac.rundir import RunDirLock

    RunDirLock(run_dir).acquire().release()  # the requeued job gets it


def test_two_fresh_starts_on_one_directory_one_is_refused(tmp_path):
    """Both pass the "empty directory" check; the lock and the check made under it let one in."""
    from pixelsac.rundir import RunDirLock

    run_dir = tmp_path / "fresh"
    lock = RunDirLock(run_dir).acquire()
    try:
        result = run_cli(*FAST, f"run_dir={run_dir}", cwd=tmp_path)
    finally:
        lock.release()
    assert result.returncode == EXIT_BAD_INPUT, result.stderr[-3000:]
    assert f"is in use by pid {os.getpid()}" in one_error_line(result.stderr)
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]


# --- 3. resumes that cannot lose logs ------------------------------------------------------------


def test_an_older_best_ckpt_is_refused_as_a_resume_point_and_the_logs_stay(tiny_fp32_run, tmp_path):
    run_dir = copy_run(tiny_fp32_run, tmp_path)
    # an older best.ckpt: from the evaluation at 160, its replay file deleted with a later last.ckpt
    best = run_dir / "checkpoints" / "best.ckpt"
    stored = torch.load(best, map_location="cpu", weights_only=True)
    saved = stored["callbacks"]["Checkpointer"]
    saved["replay_file"], saved["collector"]["env_frames"] = "replay-0000000020.pt", 160
    stored["callbacks"]["Evaluator"]["last_eval_frames"] = 160
    torch.save(stored, best)
    before = (run_dir / "metrics.csv").read_bytes()
    result = run_cli(f"resume={run_dir / 'checkpoints' / 'best.ckpt'}", "train.env_frames=640", cwd=tmp_path)
    assert result.returncode == EXIT_BAD_INPUT, result.stderr[-3000:]
    line = one_error_line(result.stderr)
    assert "not a resume point" in line and f"resume from {run_dir / 'checkpoints' / 'last.ckpt'}" in line, line
    assert (run_dir / "metrics.csv").read_bytes() == before


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_resume_whose_replay_file_is_missing_or_truncated_keeps_every_logged_row(tiny_fp32_run, tmp_path, damage):
    run_dir = copy_run(tiny_fp32_run, tmp_path)
    stored = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    replay = run_dir / "checkpoints" / stored["callbacks"]["Checkpointer"]["replay_file"]
    if damage == "missing":
        replay.unlink()
    else:
        replay.write_bytes(replay.read_bytes()[: replay.stat().st_size // 2])
    rows = csv_rows(run_dir)
    result = run_cli(f"resume={run_dir}", "train.env_frames=640", cwd=tmp_path)
    assert result.returncode == EXIT_BAD_INPUT, result.stderr[-3000:]
    line = one_error_line(result.stderr)
    assert str(replay) in line and ("missing" in line if damage == "missing" else "truncated or corrupt" in line)
    assert csv_rows(run_dir) == rows and len(rows) > 0


def test_overwrite_removes_the_old_checkpoints_before_a_kill_so_resume_auto_cannot_continue_them(
    tiny_fp32_run, tmp_path
):
    run_dir = copy_run(tiny_fp32_run, tmp_path)
    config = run_dir / "config.yaml"
    written = config.stat().st_mtime_ns
    proc = start_cli(*FAST, f"run_dir={run_dir}", "overwrite=true", "seed=2", cwd=tmp_path, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while config.stat().st_mtime_ns == written and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the new run has written its config.yaml: it is past its start
    finally:
        proc.send_signal(signal.SIGKILL)  # before its first save (the first evaluation, at 160 frames)
        proc.wait()
    assert "seed: 2" in config.read_text()
    from pixelsac.checkpoint import in_run_dir

    assert in_run_dir(run_dir) is None, "the discarded run's checkpoints are still there"
    # resume=auto starts the new run afresh: a budget inside its seed phase is refused at once,
    # where a resume of the discarded run would have answered "already done"
    again = run_cli(*FAST, f"run_dir={run_dir}", "resume=auto", "seed=2", "train.env_frames=64", cwd=tmp_path)
    assert again.returncode == EXIT_BAD_INPUT and "already done" not in again.stdout, again.stdout + again.stderr
    assert "ends within the random seed phase" in one_error_line(again.stderr)


# --- 4. every value validated before anything is written -----------------------------------------


@pytest.mark.parametrize(
    "args,message",
    [
        (["agent.lr=.nan"], "agent.lr=nan must be a finite number"),
        (["lowp.init_scale=.inf"], "lowp.init_scale=inf must be a finite number"),
        (["safety.min_loss_scale=.nan"], "safety.min_loss_scale=nan must be a finite number"),
        (["agent.log_std_min=5", "agent.log_std_max=-5"], "agent.log_std_min=5.0 must be below agent.log_std_max=-5.0"),
        (["seed=-1"], "seed=-1 is out of range: choose 0..4294767295"),
        (["seed=4294967295"], "seed=4294967295 is out of range"),
        (
            ["replay.capacity=100000000000"],
            "replay.capacity=100,000,000,000 needs 280.31 TiB (100,000,000,000 slots x 3,082 B)",
        ),
        (["trainer.max_steps=30"], "trainer.max_steps=30 would end the run before train.env_frames=320"),
        (["trainer.max_time='00:00:01:00'"], "trainer.max_time=00:00:01:00 would end the run"),
    ],
)
def test_a_meaningless_value_exits_2_in_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, args, message):
    code, stderr = main_in(tmp_path, monkeypatch, capsys, *FAST, *args, "run_dir=out")
    assert code == EXIT_BAD_INPUT, stderr[-2000:]
    assert message in one_error_line(stderr)
    assert list(tmp_path.iterdir()) == []


def test_a_run_whose_every_update_was_skipped_exits_3_not_done(tmp_path):
    """A finite but absurd loss scale: fp16 overflows at every update, and 4 halvings from 1e38
    leave it absurd."""
    run_dir = tmp_path / "skipped"
    result = run_cli(
        *FAST, "precision=fp16", "lowp.init_scale=1.0e+38", "train.env_frames=160", f"run_dir={run_dir}", cwd=tmp_path
    )
    assert result.returncode == EXIT_NUMERICAL, result.stdout[-2000:] + result.stderr[-3000:]
    assert "every one of the" in one_error_line(result.stderr) and "done:" not in result.stdout


# --- 5. runtime faults in one line ---------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 600 KiB filesystem (root only): room for the logs and config, not for a checkpoint and
    its replay."""
    if not AS_ROOT:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_during_a_save_is_one_line_exit_74_and_leaves_no_temporary_file(small_tmpfs, tmp_path):
    run_dir = small_tmpfs / "run"
    result = run_cli(*FAST, f"run_dir={run_dir}", cwd=tmp_path)
    assert result.returncode == EXIT_IO_FAULT, result.stdout[-2000:] + result.stderr[-3000:]
    line = one_error_line(result.stderr)
    assert line.startswith("error: no space left on device: ") and str(run_dir) in line, line
    assert not [p for p in run_dir.rglob("*.tmp")], list(run_dir.rglob("*"))


def test_a_full_disk_at_resume_is_one_line_and_keeps_every_logged_row(tiny_fp32_run, tmp_path):
    if not AS_ROOT:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "full"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        run_dir = copy_run(tiny_fp32_run, mount)
        (run_dir / ".lock").write_text("pid 1 on host earlier\n")  # an earlier attempt's
        rows = csv_rows(run_dir)
        filler = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT)  # the disk fills up
        try:
            while True:
                os.write(filler, b"\0" * 4096)
        except OSError:
            pass
        finally:
            os.close(filler)
        result = run_cli(f"run_dir={run_dir}", "resume=auto", "train.env_frames=640", cwd=tmp_path)
        assert result.returncode == EXIT_IO_FAULT, result.stdout[-2000:] + result.stderr[-3000:]
        line = one_error_line(result.stderr)
        assert line.startswith("error: no space left on device: ") and str(run_dir) in line, line
        assert csv_rows(run_dir) == rows
        assert not [p for p in run_dir.rglob("*.tmp")], list(run_dir.rglob("*"))
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_read_only_run_directory_is_refused_in_one_line(tiny_fp32_run, tmp_path):
    if AS_ROOT:  # root writes through permissions: a read-only mount
        mount = tmp_path / "ro"
        mount.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        run_dir = copy_run(tiny_fp32_run, mount)
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        why = "mounted read-only"
    else:
        run_dir = copy_run(tiny_fp32_run, tmp_path)
        run_dir.chmod(0o555)
        why = "permission denied"
    try:
        result = run_cli(f"run_dir={run_dir}", "resume=auto", "train.env_frames=640", cwd=tmp_path)
    finally:
        if AS_ROOT:
            subprocess.run(["umount", "-l", str(mount)], check=False)
        else:
            run_dir.chmod(0o755)
    assert result.returncode == EXIT_BAD_INPUT, result.stderr[-3000:]
    line = one_error_line(result.stderr)
    assert f"run_dir {run_dir} cannot be written" in line and why in line, line


def test_checkpoints_are_written_in_place_not_under_the_system_temporary_folder(tmp_path, monkeypatch):
    """Lightning's default builds the file under tempfile's folder and copies it across."""
    import tempfile

    from pixelsac.run import RunDirCheckpointIO

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-folder"))
    path = tmp_path / "checkpoints" / ".last.ckpt.tmp"
    RunDirCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(3)}}, path)
    assert torch.equal(torch.load(path, weights_only=True)["state_dict"]["w"], torch.ones(3))


# --- 6. signals after the save ------------------------------------------------------------------


@pytest.mark.parametrize("gap", [0.0, 0.3])
def test_signals_after_the_stopped_line_keep_exit_75(tmp_path, gap):
    run_dir = tmp_path / "stopped"
    proc = start_cli(*FAST, "train.env_frames=640", f"run_dir={run_dir}", cwd=tmp_path, stdout=subprocess.PIPE)
    try:
        for line in proc.stdout:
            if line.startswith("run directory:"):
                proc.send_signal(signal.SIGINT)  # stop: saves, prints "stopped by SIGINT ...", exits 75
            if line.startswith("stopped by SIGINT"):
                proc.send_signal(signal.SIGINT)  # then one right after the line, and one `gap` later
                time.sleep(gap)
                proc.send_signal(signal.SIGINT)
                break
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_STOPPED, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    # "...after the run ended: ignored" is printed while Python still runs handlers; a signal that
    # lands in the last moments of the exit is ignored by the operating system without a note
    # (seen on a loaded machine), so only the exit code and the absence of a traceback are checked


def test_exit_codes_are_defined_once():
    from pixelsac import cli

    codes = [code for code, _, _ in cli.EXIT_CODES]
    assert codes == sorted(set(codes)) and {0, 2, 3, 4, 74, 75} <= set(codes)


# --- 7. small state runs for the checks below ----------------------------------------------------

# SAC from states: no rendering, a few seconds a run. 160 frames at action repeat 8: 20 agent steps,
# evaluations at 80 and 160, replay-0000000020.pt beside last.ckpt.
STATE = [
    "task=cartpole_swingup",
    "env.obs=state",
    "env.episode_frames=64",
    "replay.capacity=400",
    "agent.batch_size=8",
    "agent.hidden_dim=32",
    "train.seed_steps=16",
    "train.env_frames=160",
    "train.eval_every_frames=80",
    "train.eval_episodes=1",
    "train.log_every_updates=4",
    "trainer.enable_progress_bar=false",
    "precision=fp32",
    "perf.calibrate_updates=0",
    "train.video_every_evals=0",
    "train.num_threads=1",
]


def train_state_run(tmp_path_factory, name: str, *overrides: str):
    from conftest import TrainedRun

    run_dir = tmp_path_factory.mktemp("state") / name
    result = run_cli(*STATE, *overrides, f"run_dir={run_dir}", cwd=run_dir.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return TrainedRun(run_dir, result.stdout)


@pytest.fixture(scope="module")
def state_run(tmp_path_factory):
    """A finished 160-frame state run (copy it before changing anything)."""
    return train_state_run(tmp_path_factory, "state_s1")


@pytest.fixture(scope="module")
def other_state_run(tmp_path_factory):
    """Another run of the same configuration (seed 2): its replay file has the same name."""
    return train_state_run(tmp_path_factory, "state_s2", "seed=2")


def replay_of(run_dir: Path) -> Path:
    stored = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    return run_dir / "checkpoints" / stored["callbacks"]["Checkpointer"]["replay_file"]


def file_contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --- 8. nothing written through a link ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_lock_that_is_a_link_or_not_a_regular_file_is_refused_and_its_target_kept(
    tmp_path, monkeypatch, capsys, kind
):
    run_dir, victim = tmp_path / "D", tmp_path / "victim"
    run_dir.mkdir()
    victim.write_text("precious\n")
    if kind == "link":
        (run_dir / ".lock").symlink_to(victim)
    else:
        os.mkfifo(run_dir / ".lock")
    code, stderr = main_in(tmp_path, monkeypatch, capsys, *STATE, f"run_dir={run_dir}", "resume=auto")
    assert code == EXIT_BAD_INPUT, stderr[-3000:]
    line = one_error_line(stderr)
    why = "is a symbolic link" if kind == "link" else "is not a regular file"
    assert f"{run_dir / '.lock'} {why}" in line, line
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]


@pytest.mark.parametrize(
    "name",
    ["metrics.csv", "config.yaml", "summary.json", "hparams.yaml", "checkpoints", "tb", "videos", "tb/hparams.yaml"],
)
def test_a_file_or_folder_the_run_writes_that_is_a_link_is_refused_and_its_target_kept(
    state_run, tmp_path, monkeypatch, capsys, name
):
    run_dir = copy_run(state_run, tmp_path)
    inside, elsewhere = run_dir / name, tmp_path / "elsewhere"
    if inside.exists():
        shutil.move(inside, elsewhere)
    else:
        elsewhere.mkdir()
        (elsewhere / "precious").write_text("precious\n")
    inside.symlink_to(elsewhere)
    before = file_contents(elsewhere) if elsewhere.is_dir() else elsewhere.read_bytes()
    code, stderr = main_in(tmp_path, monkeypatch, capsys, f"run_dir={run_dir}", "resume=auto", "train.env_frames=320")
    assert code == EXIT_BAD_INPUT, stderr[-3000:]
    line = one_error_line(stderr)
    assert f"{inside} is a symbolic link" in line, line
    assert (file_contents(elsewhere) if elsewhere.is_dir() else elsewhere.read_bytes()) == before


# --- 9. a run_dir that cannot be a directory ----------------------------------------------------


@pytest.mark.parametrize("kind", ["dangling", "loop", "proc"])
def test_a_run_dir_that_cannot_be_made_exits_2_saying_what_is_wrong_with_the_path(tmp_path, monkeypatch, capsys, kind):
    if kind == "dangling":
        (tmp_path / "out").symlink_to(tmp_path / "gone")
        run_dir, why = "out", f"out is a symbolic link to {tmp_path / 'gone'}, which does not exist"
    elif kind == "loop":
        (tmp_path / "a").symlink_to(tmp_path / "b")
        (tmp_path / "b").symlink_to(tmp_path / "a")
        run_dir, why = "a", "a is a symbolic link that loops"
    else:
        if not Path("/proc/self").is_dir():
            pytest.skip("no /proc here")
        run_dir, why = "/proc/pixelsac-run", "/proc is a proc filesystem"
    before = sorted(p.name for p in tmp_path.iterdir())
    code, stderr = main_in(tmp_path, monkeypatch, capsys, *STATE, f"run_dir={run_dir}")
    assert code == EXIT_BAD_INPUT, stderr[-3000:]
    line = one_error_line(stderr)
    assert line.startswith(f"error: run_dir {run_dir}") and why in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == before


# --- 10. a replay file is its checkpoint's -------------------------------------------------------


@pytest.mark.parametrize("trust", [False, True])
def test_a_replay_file_holding_pickled_objects_is_refused_in_one_line_before_anything_is_written(
    state_run, tmp_path, monkeypatch, capsys, trust
):
    import fractions

    run_dir = copy_run(state_run, tmp_path)
    replay = replay_of(run_dir)
    state = torch.load(replay, map_location="cpu", weights_only=True)
    torch.save({**state, "payload": fractions.Fraction(1, 3)}, replay)
    before = file_contents(run_dir)
    args = [f"resume={run_dir}", "train.env_frames=320"] + (["trust_checkpoint=true"] if trust else [])
    code, stderr = main_in(tmp_path, monkeypatch, capsys, *args)
    assert code == EXIT_BAD_INPUT, stderr[-3000:]
    line = one_error_line(stderr)
    assert f"replay file {replay}" in line and "pickled Python objects" in line, line
    assert file_contents(run_dir) == before


def test_a_replay_file_from_another_run_is_refused_before_anything_is_written(
    state_run, other_state_run, tmp_path, monkeypatch, capsys
):
    run_dir = copy_run(state_run, tmp_path)
    replay = replay_of(run_dir)
    shutil.copy(replay_of(other_state_run.run_dir), replay)  # the same name: the same step of another run
    before = file_contents(run_dir)
    code, stderr = main_in(tmp_path, monkeypatch, capsys, f"resume={run_dir}", "train.env_frames=320")
    assert code == EXIT_BAD_INPUT, stderr[-3000:]
    line = one_error_line(stderr)
    assert f"replay file {replay}" in line and "another run" in line, line
    assert file_contents(run_dir) == before


def test_a_checkpoint_from_before_run_ids_resumes_with_a_warning_and_then_names_its_run(state_run, tmp_path):
    from pixelsac.checkpoint import REPLAY_OWNER

    run_dir = copy_run(state_run, tmp_path)
    last, replay = run_dir / "checkpoints" / "last.ckpt", replay_of(run_dir)
    stored = torch.load(last, map_location="cpu", weights_only=True)
    del stored["callbacks"]["Checkpointer"]["run_id"]  # as an older pixelsac wrote them
    torch.save(stored, last)
    state = torch.load(replay, map_location="cpu", weights_only=True)
    del state[REPLAY_OWNER]
    torch.save(state, replay)
    result = run_cli(f"resume={run_dir}", "train.env_frames=240", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"warning: {last} was written before checkpoints named their run" in result.stderr
    resumed = torch.load(last, map_location="cpu", weights_only=True)["callbacks"]["Checkpointer"]
    written_by = torch.load(replay_of(run_dir), map_location="cpu", weights_only=True)[REPLAY_OWNER]
    assert written_by["run_id"] == resumed["run_id"] and written_by["agent_steps"] == 30


# --- 11. a full disk under every writer -----------------------------------------------------------

FILL_THEN_LOG = """
import os, sys
import pixelsac.callbacks as callbacks
import pixelsac.train as train_mod

where = sys.argv[1]
real = callbacks.TrainingLogger.on_train_batch_end
filled = []

def filling(self, trainer, *args):  # the first update done: every log file exists, the disk fills
    if not filled:
        filled.append(1)
        fd = os.open(os.path.join(where, "filler"), os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, b"\\0" * 4096)
        except OSError:
            pass
        finally:
            os.close(fd)
        for logger in reversed(trainer.loggers):  # the next scalar: to TensorBoard's writer first
            logger.log_metrics({f"train/filled_{i}": 1.0 for i in range(200)}, step=0)  # more than a page
            logger.save()
    return real(self, trainer, *args)

callbacks.TrainingLogger.on_train_batch_end = filling
sys.exit(train_mod.main(sys.argv[2:]))
"""


def test_a_full_disk_under_the_loggers_is_one_line_naming_the_file_and_leaves_no_partial_file(small_tmpfs, tmp_path):
    run_dir = small_tmpfs / "run"
    result = subprocess.run(
        [sys.executable, "-c", FILL_THEN_LOG, str(small_tmpfs), *STATE, f"run_dir={run_dir}"],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == EXIT_IO_FAULT, result.stdout[-2000:] + result.stderr[-3000:]
    line = one_error_line(result.stderr)  # no thread's traceback either
    assert "Exception in thread" not in result.stderr, result.stderr[-3000:]
    assert line.startswith(f"error: no space left on device: {run_dir / 'tb' / 'events.out.tfevents.'}"), line
    empty = [p for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock" and p.stat().st_size == 0]
    assert not empty, empty
    assert not [p for p in run_dir.rglob("*.tmp")], list(run_dir.rglob("*"))


# --- 12. interrupted starts, leftovers, damaged checkpoints --------------------------------------


def test_ctrl_c_while_the_libraries_load_is_one_line_and_writes_nothing(tmp_path):
    """The import of lightning is held (tests/hold_import) so that the signal lands while the
    libraries load on a machine of any speed (polling for torch in the process's maps missed the
    window under load: the run had installed its own handlers and finished its budget).

    The child starts with SIGINT at its default disposition. A shell without job control starts
    background commands with SIGINT ignored, children inherit that, and Python then installs no
    KeyboardInterrupt handler: in CI (``make test`` in such a job) the signal was lost while the
    libraries loaded, and the run went on to finish its budget with exit 0. Run with ``trap '' INT``,
    this test failed that way every time before the disposition was reset."""
    run_dir, held = tmp_path / "run", tmp_path / "held"
    held.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pixelsac.train", *merged(*STATE, f"run_dir={run_dir}")],
        cwd=tmp_path,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        env=cli_env(TESTS / "hold_import", PYTHONUNBUFFERED="1", HOLD_IMPORT_DIR=str(held)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None and not (held / "holding").exists():
            time.sleep(0.05)
        assert (held / "holding").exists(), "the held import was never reached"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert [line for line in err.splitlines() if line.strip()] == [
        "pixelsac: SIGINT while starting (loading libraries, checking the configuration): stopped before "
        "anything was written"
    ], err
    assert not run_dir.exists()


def test_already_done_removes_the_temporary_file_of_a_killed_save(state_run, tmp_path, monkeypatch, capsys):
    run_dir = copy_run(state_run, tmp_path)
    left = run_dir / "checkpoints" / ".replay-0000000020.pt.tmp"  # a save SIGKILLed mid-write
    left.write_bytes(b"PK\3\4 half a replay")
    code, stderr = main_in(tmp_path, monkeypatch, capsys, f"run_dir={run_dir}", "resume=auto")
    assert code == 0, stderr[-3000:]
    assert not left.exists()


@pytest.mark.parametrize("damage", ["zeroed", "empty"])
def test_a_zeroed_or_empty_checkpoint_is_refused_in_one_plain_line(state_run, tmp_path, monkeypatch, capsys, damage):
    run_dir = copy_run(state_run, tmp_path)
    last = run_dir / "checkpoints" / "last.ckpt"
    last.write_bytes(b"\0" * last.stat().st_size if damage == "zeroed" else b"")
    code, stderr = main_in(tmp_path, monkeypatch, capsys, f"resume={run_dir}", "train.env_frames=320")
    assert code == EXIT_BAD_INPUT, stderr[-3000:]
    line = one_error_line(stderr)
    what = "holds only zero bytes" if damage == "zeroed" else "is empty"
    assert f"{last} {what}" in line, line
    assert "legacy" not in line and "weights_only" not in line, line
