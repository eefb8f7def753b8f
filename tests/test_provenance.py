"""A run records the code it ran: pixelsac's commit and the libraries' versions."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

import pixelsac
from pixelsac.provenance import code_version, describe, git_state

ROOT = Path(pixelsac.__file__).resolve().parent.parent


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="pixelsac is not a git checkout"
)
def test_the_commit_is_the_checkouts_head():
    code = code_version()
    assert code["commit"] == _git(ROOT, "rev-parse", "HEAD").strip()
    assert code["changed"] == bool(_git(ROOT, "status", "--porcelain", "--untracked-files=no").strip())
    assert code["pixelsac"] == pixelsac.__version__
    assert code["torch"] and code["python"]


@pytest.mark.skipif(shutil.which("git") is None, reason="no git")
def test_a_changed_tracked_file_is_noted_and_a_folder_outside_git_has_no_commit(tmp_path):
    assert git_state(tmp_path) == (None, None)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = _git(tmp_path, "rev-parse", "HEAD").strip()
    assert git_state(tmp_path) == (head, False)
    (tmp_path / "b.py").write_text("untracked\n")
    assert git_state(tmp_path) == (head, False)  # untracked files are not the code that ran
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_state(tmp_path) == (head, True)


def _repo(root: Path, text: str = "x = 1\n") -> str:
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / "a.py").write_text(text)
    _git(root, "add", "a.py")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    return _git(root, "rev-parse", "HEAD").strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="no git")
@pytest.mark.parametrize("variable", ["GIT_DIR", "GIT_WORK_TREE"])
def test_git_variables_of_the_caller_do_not_point_at_another_repository(tmp_path, monkeypatch, variable):
    mine, other = tmp_path / "mine", tmp_path / "other"
    head = _repo(mine)
    _repo(other, "y = 2\n")
    monkeypatch.setenv(variable, str(other / ".git" if variable == "GIT_DIR" else other))
    assert git_state(mine) == (head, False)


@pytest.mark.skipif(shutil.which("git") is None, reason="no git")
def test_the_index_is_never_written_and_a_corrupt_one_keeps_the_commit(tmp_path):
    head = _repo(tmp_path)
    index = tmp_path / ".git" / "index"
    (tmp_path / "a.py").touch()  # a new mtime, same content: a status would refresh the index
    before = (index.read_bytes(), index.stat().st_mtime_ns)
    assert git_state(tmp_path) == (head, False)
    assert (index.read_bytes(), index.stat().st_mtime_ns) == before
    index.write_bytes(b"not an index")
    assert git_state(tmp_path) == (head, None)  # the status cannot be read; the commit still is


def test_the_line_names_the_commit_and_the_libraries():
    code = {"pixelsac": "0.1.0", "commit": "4b4eb93595d8", "changed": True, "python": "3.12.3", "torch": "2.11.0"}
    line = describe(code)
    assert line.startswith("pixelsac 0.1.0 (git 4b4eb93, with uncommitted changes), torch 2.11.0")
    assert line.endswith("python 3.12.3") and "kornia" not in line
    assert describe({**code, "commit": None, "changed": None}).startswith("pixelsac 0.1.0, torch")
    assert describe({**code, "changed": None}).startswith("pixelsac 0.1.0 (git 4b4eb93, status unreadable), torch")


def test_a_run_says_which_code_it_ran(tiny_fp16_run):
    assert f"code: {describe(code_version())}" in tiny_fp16_run.stdout
    summary = json.loads((tiny_fp16_run.run_dir / "summary.json").read_text())
    assert summary["code"] == code_version()
