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
    """Every ``NAME=${NAME:-number}`` default in the script (limits derived from START_S are not)."""
    return {k: int(v) for k, v in re.findall(r"(\w+)=\$\{\1:-(\d+)\}", SCRIPT.read_text())}


def plan_steps(text: str) -> dict[str, tuple[int, int]]:
    """``part -> (limit, total)`` from the plan's ``- NAME: LIMIT + GRACE + report R = TOTAL`` lines."""
    return {
        name: (int(limit), int(total))
        for name, limit, total in re.findall(r"^- (\w+): (\d+) \+ \d+ \+ report \d+ = (\d+)$", text, flags=re.M)
    }


DEFAULT_PARTS = ["gpu_tests", "bench512", "bench128", "syncfree", "ablations", "layout", "batchsrc", "fast"]


def test_the_default_parts_fit_the_stated_total_with_every_grace_counted():
    """Every step's limit, a kill-after grace for each `timeout -k GRACE` step, a report step
    after each part, the final step: within TOTAL, which the script's header states."""
    d = script_defaults()
    assert d["TOTAL"] == 585 and d["COMPILE"] == 0 and d["GPU_TESTS"] == 1 and d["FAST_FRAMES"] > 0
    result = plan()
    assert result.returncode == 0, result.stdout + result.stderr
    steps = plan_steps(result.stdout)
    assert list(steps) == DEFAULT_PARTS  # COMPILE=0: no compile part
    setup = int(re.search(r"first report \d+ = (\d+)", result.stdout).group(1))
    assert setup == d["T_GL"] + d["T_WHEELS"] + d["GRACE"] + d["START_S"] + d["GRACE"] + d["T_SMI"] + d["REPORT_S"]
    for limit, total in steps.values():
        assert total == limit + d["GRACE"] + d["REPORT_S"]
    final = int(re.search(r"final report, charts and archive: (\d+)", result.stdout).group(1))
    worst = setup + sum(total for _, total in steps.values()) + final
    assert worst <= d["TOTAL"]
    assert f"worst case {worst} s of TOTAL={d['TOTAL']} s: every part fits" in result.stdout
    # every step the script runs under `timeout -k` is one the plan counts
    text = SCRIPT.read_text()
    assert text.count('timeout -k "$GRACE"') == 3  # wheels, import check, each part (one call site)
    assert "MODES=fp32,fp16," in text  # the headline rows first in every benchmark part
    # the header says how long the script needs, and it is the default TOTAL
    assert f"at most TOTAL seconds, {d['TOTAL']} by default" in text


def test_the_compiled_optimizer_part_is_off_by_default_and_fits_when_a_part_makes_room():
    """OPTSTEP=1 adds a bench of fp16/bf16 with hAdam eager against compiled (perf.compile_optimizer):
    it does not fit beside every default part, so the plan shows it skipped; without the fast
    training run and the GPU tests it fits."""
    assert script_defaults()["OPTSTEP"] == 0
    crowded = plan(OPTSTEP="1")
    assert list(plan_steps(crowded.stdout)) == [*DEFAULT_PARTS, "optstep"]
    assert "does not fit" in crowded.stdout
    roomy = plan(OPTSTEP="1", FAST_FRAMES="0", GPU_TESTS="0")
    assert roomy.returncode == 0 and "every part fits" in roomy.stdout, roomy.stdout
    text = SCRIPT.read_text()
    assert "bench.modes=fp16,fp16-compiled,bf16,bf16-compiled" in text


def test_every_limit_allows_for_a_cold_start():
    """A cold GPU machine takes ~10 s to start a process and ~20 s to import the stack: the first
    H200 run's 15-s limits cut ablations, layout and batchsrc before their first row. Every
    process's limit is START_S (30 s) plus its own work, and moves with START_S."""
    d = script_defaults()
    assert d["START_S"] >= 10 + 20
    steps = plan_steps(plan().stdout)
    assert all(limit >= d["START_S"] + 15 for limit, _ in steps.values()), steps
    assert "import check 30 + 3" in plan().stdout
    longer = plan_steps(plan(START_S="60").stdout)
    assert all(longer[name][0] == steps[name][0] + 30 for name in steps)


def test_there_is_no_learning_part():
    """A few minutes of training gave ~250 updates, which show nothing about learning: no
    side-by-side learning part, no T_LEARN (learning curves need runs of their own)."""
    text = SCRIPT.read_text()
    assert "T_LEARN" not in text and "learning_runs" not in text and "LEARN_" not in text
    assert "learning" not in plan_steps(plan().stdout)
    assert all(not run.startswith("learn_") for run in gpu_report.RUNS)


@pytest.mark.parametrize(
    "rc,seconds,limit,state",
    [
        (0, 20, 60, "ok"),
        (124, 60, 60, "timed out"),  # timeout's own exit at the limit
        (137, 63, 60, "timed out"),  # still running GRACE s later: killed by timeout -k
        (137, 20, 60, "killed (signal 9)"),  # killed before its limit (by the kernel, by someone)
        (143, 20, 60, "killed (signal 15)"),
        (1, 5, 60, "crashed"),
        (2, 60, 60, "crashed"),
    ],
)
def test_a_part_ended_by_its_limit_is_timed_out_not_crashed(rc, seconds, limit, state):
    result = subprocess.run(
        ["bash", str(SCRIPT), "--state", str(rc), str(seconds), str(limit)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stdout.strip() == state


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


@pytest.mark.slow
def test_parts_cut_by_their_limits_are_reported_as_timed_out(tmp_path):
    """On the CPU with 1-s part limits (no process starts that fast): every part ends by its
    limit, and status.tsv and the report say "timed out" with timeout's exit 124, not "crashed"."""
    out, work = tmp_path / "out", tmp_path / "work"
    limits = {name: "1" for name in ("T_B512", "T_B128", "T_SF", "T_ABL", "T_CL", "T_SRC")}
    settings = dict(
        DEVICE="cpu",
        GPU_TESTS="0",
        FAST_FRAMES="0",
        PYTHON=sys.executable,
        WORK=str(work),
        TOTAL="3000",
        T_CHECK="300",  # imports take a while on a busy 2-core machine
        REPORT_S="60",
        FINAL_S="120",
        **limits,
    )
    result = subprocess.run(
        ["bash", str(SCRIPT), str(out)], env=cli_env(**settings), capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    status = gpu_report.read_status(work)
    assert [s["part"] for s in status] == ["bench512", "bench128", "syncfree", "ablations", "layout", "batchsrc"]
    assert all((s["state"], s["rc"]) == ("timed out", "124") for s in status), status
    report = (out / "report.md").read_text()
    assert report.count("| timed out | 124 |") == 6 and "crashed" not in report.lower()


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


@pytest.mark.parametrize(
    "rc,part_state,said",
    [
        (1, "crashed", "CRASHED (exit 1; see fast_fp16.log)"),
        (75, "timed out", "cut by its part's time limit (exit 75; see fast_fp16.log)"),  # saved on the part's TERM
        (143, "timed out", "cut by its part's time limit (exit 143"),
        (137, "timed out", "cut by its part's time limit (exit 137"),
        (75, "ok", "stopped early (exit 75"),
        (143, "killed (signal 15)", "killed (signal 15) (exit 143"),
    ],
)
def test_a_run_that_did_not_finish_says_how_and_its_summary_is_not_a_result(tmp_path, rc, part_state, said):
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "fast_fp16").mkdir(parents=True)
    (work / "fast_fp16" / "summary.json").write_text(_summary(11.11))
    (work / "fast_fp16.rc").write_text(str(rc))
    (work / "status.tsv").write_text(f"fast\t{part_state}\t{rc}\t50\t50\t\n")
    text = gpu_report.report(work, out)
    assert said in text and "its summary is not a result" in text
    assert "11.11" not in text
    if part_state == "timed out":
        assert "CRASHED" not in text
    assert (out / "report.md").read_text() == text and not (out / "report.md.tmp").exists()


def test_a_finished_run_is_reported_and_one_without_an_exit_code_did_not_finish(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "fast_fp16").mkdir(parents=True)
    (work / "fast_fp16" / "summary.json").write_text(_summary(22.22))
    (work / "fast_fp16.rc").write_text("0")
    (work / "status.tsv").write_text("fast\tok\t0\t35\t50\t\n")
    text = gpu_report.report(work, out)
    assert "22.22 ms/update" in text and "no speed-up figure (the device was shared" in text
    (work / "fast_fp16.rc").unlink()  # killed with its part: no exit code
    assert "did not finish (its part ran out of time): no result" in gpu_report.report(work, out)


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


LEARN_SCRIPT = REPO / "tools" / "gpu_learn.sh"


def test_the_learning_script_names_nothing_outside_the_repository_and_fits_ten_minutes():
    text = LEARN_SCRIPT.read_text()
    for outside in ("../shared", "/work/", "shared/tools", "device tool", "session"):
        assert outside not in text, outside
    defaults = {k: int(v) for k, v in re.findall(r"(\w+)=\$\{\1:-(\d+)\}", text)}
    worst = defaults["T_SETUP"] + defaults["DURATION"] + defaults["STOP_S"] + defaults["FINAL_S"]
    assert defaults["DURATION"] >= 480 and worst <= 590, defaults  # 8 minutes of learning in a 10-minute slot
    assert f"at most {worst} s with the defaults" in " ".join(line.lstrip("# ") for line in text.splitlines())


@pytest.mark.slow
def test_the_learning_script_archives_each_mode_as_it_goes(tmp_path):
    """On the CPU with the tiny agent: two modes side by side, stopped after their time; the
    archive holds each run's metrics, config and log tail, the curves and the returns table."""
    out, work = tmp_path / "out", tmp_path / "work"
    settings = dict(
        DEVICE="cpu",
        PYTHON=sys.executable,
        WORK=str(work),
        T_SETUP="300",  # imports take a while on a busy 2-core machine
        DURATION="60",
        PERIOD="15",
        STOP_S="60",
        FINAL_S="60",
        MODES="fp32 fp16",
        LEARN_ARGS="preset=tiny train.seed_steps=20 train.eval_every_frames=240 train.eval_episodes=1 "
        "train.eval_in_worker=false train.num_threads=1 env.episode_frames=160",
    )
    result = subprocess.run(
        ["bash", str(LEARN_SCRIPT), str(out)], env=cli_env(**settings), capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-3000:]
    with tarfile.open(out / "learn.tar.gz") as tar:
        names = set(tar.getnames())
    for mode in ("fp32", "fp16"):
        assert {f"{mode}/metrics.csv", f"{mode}/config.yaml", f"{mode}.tail.log"} <= names, names
    assert {"curves.png", "returns.md"} <= names, names
    returns = (out / "returns.md").read_text()
    assert re.search(r"\| fp16 \| 2\d\d: ", returns), returns  # an evaluation at 240 env frames
    assert "lowp/target_peak" in returns


def test_goals_runs_only_what_the_speed_goals_need_and_fits():
    """GOALS=1: the GPU tests (which decide whether CUDA graphs are timed), the goals bench (fp32,
    fp16 and fp16-compiled at batches 512 and 128, eager and graphed) and the fast run with the
    compiled optimizer and parallel environments; nothing else, within TOTAL."""
    result = plan(GOALS="1")
    assert result.returncode == 0 and "every part fits" in result.stdout, result.stdout
    assert list(plan_steps(result.stdout)) == ["gpu_tests", "goals", "fast"]
    text = SCRIPT.read_text()
    assert "bench.batch_sizes=512,128 bench.modes=fp32,fp16,fp16-compiled bench.cuda_graphs=$GRAPHS" in text
    assert "perf.compile_optimizer=true env.num_envs=$GOALS_ENVS" in text
    assert "train.overlap_collection=true $fast_goals" in text  # the fast run steps its envs during updates
    assert script_defaults()["GOALS"] == 0 and script_defaults()["GOALS_ENVS"] == 8


def _goals_work(tmp_path: Path, ms: dict[tuple[str, int], float], frames_per_s: list[float] | None) -> Path:
    import json

    work = tmp_path / "work"
    (work / "goals").mkdir(parents=True)
    rows = []
    for (mode, batch), value in ms.items():
        for variant, factor in (("sync_free", 3.0), ("sync_free+cuda_graphs", 1.0)):  # eager rows are slower
            row = {"mode": mode, "batch_size": batch, "variant": variant, "ms_mean": value * factor, "status": "ok"}
            row["gflop_per_update"] = batch * 0.96  # DrQ's agent: ~0.96 GFLOP a sample (pixelsac/perf/flops.py)
            rows.append(row)
    (work / "goals" / "bench.json").write_text(json.dumps({"rows": rows}))
    (work / "goals" / "bench.md").write_text("# pixelsac update-step benchmark\n\n| table |\n")
    (work / "status.tsv").write_text("gpu_tests\tok\t0\t40\t75\t\ngoals\tok\t0\t120\t180\t\nfast\tok\t0\t90\t110\t\n")
    if frames_per_s is not None:
        run = work / "fast_fp16"
        run.mkdir()
        (run / "summary.json").write_text(_summary(9.0))
        (run / "config.yaml").write_text("env:\n  num_envs: 8\nperf:\n  compile_optimizer: true\n")
        (run / "metrics.csv").write_text(
            "env_frames,perf/env_frames_per_s\n" + "".join(f"{i},{v}\n" for i, v in enumerate(frames_per_s))
        )
        (work / "fast_fp16.rc").write_text("0\n")
    return work


def test_the_report_opens_with_each_goal_its_figure_and_whether_it_is_met(tmp_path):
    """From the graphed rows only (eager rows here are 3x slower and must not count): batch 512
    fp16-compiled 5.5 ms (<= 6: met) at 2.36x fp32's 13 ms (< 2.5: not met); batch 128 fp16
    2.8 ms (<= 3: met), 2.14x (>= 2: met); end to end the median of the later half of the log
    intervals (compilation and capture in the first ones): 820 frames/s, met."""
    ms = {("fp32", 512): 13.0, ("fp16", 512): 7.0, ("fp16-compiled", 512): 5.5,
          ("fp32", 128): 6.0, ("fp16", 128): 2.8, ("fp16-compiled", 128): 3.1}  # fmt: skip
    work = _goals_work(tmp_path, ms, [90.0, 400.0, 780.0, 820.0, 830.0, 815.0])
    text = gpu_report.report(work, tmp_path / "out", final=True)
    goals = text.split("## Goals", 1)[1].split("## Parts", 1)[0]
    assert "batch 512, CUDA graphs: fp16 update <= 6 ms: met (fp16 7.00 ms, fp16-compiled 5.50 ms)" in goals
    assert "batch 512, CUDA graphs: fp16 >= 2.5x fp32 (13.00 ms): not met (fp16 1.86x, fp16-compiled 2.36x)" in goals
    assert "batch 128, CUDA graphs: fp16 update <= 3 ms: met" in goals
    assert "batch 128, CUDA graphs: fp16 >= 2x fp32 (6.00 ms): met" in goals
    # what the time goal asks of the GPU, beside what the fastest fp16 sustained (491.5 GFLOP / 5.5 ms)
    assert "batch 512: 491.5 GFLOP per update; 6 ms asks 81.9 TFLOP/s sustained, fp16-compiled sustained 89.4" in goals
    assert ">= 800 env frames/s: met (820)" in goals
    assert "(8 environments, compiled optimizer)" in text


def test_goals_not_measured_say_so(tmp_path):
    """A goals part cut before its graphed cells, and no finished fast run: every goal "not measured"."""
    work = _goals_work(tmp_path, {}, None)
    goals = gpu_report.report(work, tmp_path / "out").split("## Goals", 1)[1].split("## Parts", 1)[0]
    assert goals.count("not measured") == 3 and " met" not in goals
