"""The GPU run's tools on a CPU: tools/gpu_run.sh's time budget and a run cut halfway,
tools/gpu_report.py's report and archive, tools/gpu_wheels.py's list and wheel surgery."""

from __future__ import annotations

import importlib.metadata
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
from conftest import REPO, cli_env

sys.path.insert(0, str(REPO / "tools"))
import gpu_report  # noqa: E402
import gpu_wheels  # noqa: E402

SCRIPT = REPO / "tools" / "gpu_run.sh"


def plan(**settings: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), "--plan"], env={**os.environ, **settings}, capture_output=True, text=True, timeout=60
    )


def script_defaults() -> dict[str, int]:
    """Every ``NAME=${NAME:-number}`` default in the script."""
    return {k: int(v) for k, v in re.findall(r"(\w+)=\$\{\1:-(\d+)\}", SCRIPT.read_text())}


def test_the_default_parts_fit_the_stated_total_with_every_grace_counted():
    """Read from the script's own defaults: every step's limit, a kill-after grace for each
    `timeout -k GRACE` step, a report step after each part, the final step: within TOTAL."""
    d = script_defaults()
    assert d["TOTAL"] == 420
    parts = ["T_TESTS", "T_B512", "T_B128", "T_SF", "T_ABL", "T_CL", "T_SRC", "T_LEARN", "T_FAST"]  # COMPILE=0
    assert d["COMPILE"] == 0 and d["GPU_TESTS"] == 1 and d["FAST_FRAMES"] > 0
    setup = d["T_GL"] + d["T_WHEELS"] + d["GRACE"] + d["T_CHECK"] + d["GRACE"] + d["T_SMI"] + d["REPORT_S"]
    worst = setup + sum(d[p] + d["GRACE"] + d["REPORT_S"] for p in parts) + d["FINAL_S"]
    assert worst <= d["TOTAL"]
    result = plan()
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"worst case {worst} s of TOTAL=420 s: every part fits" in result.stdout
    # the part lines add up to what the plan says
    steps = [int(n) for n in re.findall(r"= (\d+)$", result.stdout, flags=re.M)]
    final = int(re.search(r"final report, charts and archive: (\d+)", result.stdout).group(1))
    assert sum(steps) + final == worst
    # every step the script runs under `timeout -k` is one the plan counts
    text = SCRIPT.read_text()
    assert text.count('timeout -k "$GRACE"') == 3  # wheels, import check, each part (one call site)
    assert "MODES=fp32,fp16," in text  # the headline rows first in every benchmark part


def test_a_plan_that_does_not_fit_says_so():
    result = plan(TOTAL="300")
    assert result.returncode == 1 and "does not fit" in result.stdout


def test_the_gpu_tools_name_nothing_outside_the_repository():
    for name in ("gpu_run.sh", "gpu_report.py", "gpu_wheels.py"):
        text = (REPO / "tools" / name).read_text()
        for outside in ("../shared", "/work/", "shared/tools", "device tool", "session"):
            assert outside not in text, (name, outside)


@pytest.mark.slow
def test_a_smoke_run_cut_halfway_already_has_its_report(tmp_path):
    """On the CPU with tiny limits: killed (SIGKILL, the whole process group, as a lent machine
    going back would) once its first benchmark part is done, OUT already holds report.md with
    that part's table and an archive."""
    out, work = tmp_path / "out", tmp_path / "work"
    settings = dict(
        DEVICE="cpu",
        GPU_TESTS="0",
        PYTHON=sys.executable,
        WORK=str(work),
        TOTAL="3000",
        T_CHECK="300",  # imports take a while on a busy 2-core machine
        REPORT_S="60",
        FINAL_S="120",
        T_B512="600",
        T_B128="600",
        BENCH_ARGS="env.image_size=24 agent.num_filters=4 agent.feature_dim=8 agent.hidden_dim=16 "
        "bench.isolate=false train.num_threads=1",
        N512="1",
        N128="1",
        WARMUP="0",
        FAST_FRAMES="0",
    )
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), str(out)],
        env=cli_env(**settings),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 600
        status = work / "status.tsv"
        report_file = out / "report.md"
        while time.monotonic() < deadline and proc.poll() is None:
            # the part's status comes first, then the report is rewritten: cut after both
            if status.is_file() and "bench512\t" in status.read_text():
                if report_file.is_file() and "| bench512 |" in report_file.read_text():
                    break
            time.sleep(0.5)
        assert status.is_file() and "bench512\tok" in status.read_text(), (work / "bench512.log").read_text()[-2000:]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        running = work / "part.pgid"  # the part under way runs in a process group of its own
        if running.is_file():
            try:
                os.killpg(int(running.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    report = (out / "report.md").read_text()
    assert "## bench512" in report and "| bench512 | ok |" in report
    assert "fp32" in report and "fp16" in report
    assert "still going" in report  # not the final report: the run was cut
    with tarfile.open(out / "results.tar.gz") as tar:
        assert "bench512/bench.md" in tar.getnames()


def _summary(ms: float) -> str:
    import json

    return json.dumps(
        {
            "ms_per_update": ms,
            "timed_updates": 10,
            "env_frames_per_s": 100.0,
            "speedup_vs_fp32": None,
            "speedup_basis": "none: the device was shared with other runs (perf.shared_device)",
            "memory_vs_fp32": 0.5,
            "skipped": {},
            "best_eval_return": 1.0,
        }
    )


def test_a_crashed_run_is_named_and_its_summary_is_not_a_result(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    for run, rc, ms in (("learn_fp16", "1", 11.11), ("learn_fp32", "0", 22.22)):
        (work / run).mkdir(parents=True)
        (work / run / "summary.json").write_text(_summary(ms))
        (work / f"{run}.rc").write_text(rc)
    (work / "fast_fp16").mkdir()  # killed with its part: no exit code
    (work / "status.tsv").write_text("learning\tcrashed\t1\t30\t35\tfp16 exit 1, fp32 exit 0\n")
    text = gpu_report.report(work, out)
    assert "CRASHED (exit 1; see learn_fp16.log): its summary is not a result" in text
    assert "11.11" not in text
    assert "22.22 ms/update" in text and "no speed-up figure (the device was shared" in text
    assert "did not finish (its part ran out of time): no result" in text
    assert (out / "report.md").read_text() == text and not (out / "report.md.tmp").exists()


def test_the_archive_is_bounded_and_leaves_out_temporary_and_large_files(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "learn_fp16" / "checkpoints").mkdir(parents=True)
    out.mkdir()
    (work / "learn_fp16" / "checkpoints" / "last.ckpt").write_bytes(b"x" * 1000)
    (work / "learn_fp16" / "checkpoints" / ".last.ckpt.tmp").write_bytes(b"x" * 1000)
    (work / "learn_fp16" / "metrics.csv.tmp").write_text("a,b\n")
    (work / "learn_fp16" / "replay.npz").write_bytes(b"x" * 1000)
    (work / "bench512").mkdir()
    (work / "bench512" / "bench.md").write_text("| mode |\n")
    (work / "huge.log").write_bytes(b"x" * (gpu_report.LARGEST_ARCHIVED + 1))
    for i in range(5):
        (work / f"table{i}.csv").write_bytes(b"y" * 600_000)
    count, total = gpu_report.archive(work, out, max_mb=2.0)
    with tarfile.open(out / "results.tar.gz") as tar:
        names = set(tar.getnames())
    assert "bench512/bench.md" in names and total <= 2_000_000 and count == len(names)
    assert sum(name.startswith("table") for name in names) == 3  # 3 x 0.6 MB fit in 2 MB, 4 do not
    assert not any(name.endswith((".tmp", ".ckpt", ".npz")) or name == "huge.log" for name in names)


def _junit(path: Path, cases: dict[str, str]) -> None:
    body = "".join(
        f'<testcase name="{name}">' + ("" if outcome == "passed" else f"<{outcome}/>") + "</testcase>"
        for name, outcome in cases.items()
    )
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite>{body}</testsuite></testsuites>')


@pytest.mark.parametrize(
    "cases,ok",
    [
        ({f"{gpu_report.GRAPH_TEST}[fp16]": "passed", f"{gpu_report.GRAPH_TEST}[fp32]": "passed"}, True),
        ({f"{gpu_report.GRAPH_TEST}[fp16]": "failure", f"{gpu_report.GRAPH_TEST}[fp32]": "passed"}, False),
        ({f"{gpu_report.GRAPH_TEST}[fp16]": "skipped"}, False),
        ({"test_something_else": "passed"}, False),  # -x stopped before the graph check: not shown
        (None, False),
    ],
)
def test_graphs_are_timed_only_when_the_gpu_tests_showed_them_equal_to_eager(tmp_path, cases, ok):
    if cases is not None:
        _junit(tmp_path / "gpu_tests.xml", cases)
    assert gpu_report.gpu_tests(tmp_path)[1] is ok
    assert gpu_report.main(["graphs-ok", str(tmp_path)]) == (0 if ok else 1)


def _closure(roots: list[str], environment: dict[str, str]) -> dict[str, str | None]:
    from packaging.requirements import Requirement

    seen: dict[str, str | None] = {}
    visited: set[tuple[str, tuple[str, ...]]] = set()  # a package again with other extras is read again
    todo = [(root, ("",)) for root in roots]
    while todo:
        name, extras = todo.pop()
        key = gpu_wheels.normalize(name)
        if (key, extras) in visited:
            continue
        visited.add((key, extras))
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            seen[key] = None
            continue
        seen[key] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if any(req.marker is None or req.marker.evaluate({**environment, "extra": e}) for e in extras):
                todo.append((req.name, ("", *req.extras)))
    return seen


def test_the_wheel_list_covers_what_the_packages_declare_for_the_gpu_python():
    """Every requirement of dm_control, mujoco, kornia, omegaconf, imageio and pytest (as installed here,
    markers read for CPython 3.12 on Linux) is in the list, pinned to the version tested here,
    unless torch or lightning bring it, the GPU machine has it, or it is left out on purpose."""
    environment = {
        "python_version": "3.12",
        "python_full_version": "3.12.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "os_name": "posix",
    }
    on_the_machine = set(_closure(["torch", "lightning"], environment)) | set(gpu_wheels.GPU_MACHINE_HAS)
    needed = _closure(["dm_control", "mujoco", "kornia", "omegaconf", "pytest", "imageio"], environment)
    listed = dict(map(pinned, gpu_wheels.WHEELS))
    missing = set(needed) - on_the_machine - set(gpu_wheels.LEFT_OUT) - set(listed)
    assert not missing
    for name, version in needed.items():
        if name in listed and version is not None:
            assert listed[name] == version, name
    assert listed["mujoco"] == "3.17.0" and {"dm-control", "kornia", "omegaconf", "tensorboardx"} <= set(listed)
    command = gpu_wheels.download_command("3.12", Path("/tmp/x"))
    assert {"--only-binary=:all:", "--no-deps"} <= set(command) and command[command.index("--python-version") + 1] == (
        "3.12"
    )


def pinned(requirement: str) -> tuple[str, str]:
    name, _, version = requirement.partition("==")
    return gpu_wheels.normalize(name), version


def test_stripping_a_wheel_drops_the_folders_and_their_record_lines(tmp_path):
    wheel = tmp_path / "dm_control-1.0-py3-none-any.whl"
    record = "dm_control/suite/cartpole.py,sha256=a,1\ndm_control/locomotion/soccer.py,sha256=b,2\n"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("dm_control/suite/cartpole.py", "suite")
        z.writestr("dm_control/locomotion/soccer.py", "soccer")
        z.writestr("dm_control-1.0.dist-info/RECORD", record)
    assert gpu_wheels.strip_wheel(wheel) == 1
    with zipfile.ZipFile(wheel) as z:
        assert z.namelist() == ["dm_control/suite/cartpole.py", "dm_control-1.0.dist-info/RECORD"]
        assert z.read("dm_control-1.0.dist-info/RECORD").decode() == "dm_control/suite/cartpole.py,sha256=a,1\n"


def test_install_takes_only_the_wheels_the_machine_lacks(tmp_path):
    for name in ("numpy-1.0-py3-none-any.whl", "no_such_project_here-1.0-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"")
    assert [w.name for w in gpu_wheels.missing_wheels(tmp_path)] == ["no_such_project_here-1.0-py3-none-any.whl"]
    assert gpu_wheels.main(["--python-version", "twelve"]) == 2
