"""The GPU run's tools on a CPU: tools/gpu/gpu_run.sh's time budget and a run cut halfway,
tools/gpu/gpu_report.py's report and archive, tools/gpu/gpu_wheels.py's list and wheel surgery."""

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

sys.path.insert(0, str(REPO / "tools" / "gpu"))
import gpu_report  # noqa: E402
import gpu_wheels  # noqa: E402

SCRIPT = REPO / "tools" / "gpu" / "gpu_run.sh"


def plan(**settings: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), "--plan"], env={**os.environ, **settings}, capture_output=True, text=True, timeout=60
    )


def script_defaults() -> dict[str, int]:
    """Every ``NAME=${NAME:-number}`` default in the script (limits derived from START_S are not)."""
    return {k: int(v) for k, v in re.findall(r"(\w+)=\$\{\1:-(\d+)\}", SCRIPT.read_text())}


def plan_steps(text: str) -> dict[str, tuple[int, int]]:
    """``part -> (limit, total)`` from the plan's ``- NAME: LIMIT + GRACE + report R [+ verdict V] = TOTAL``
    lines (the parts counted in the worst case; spare parts are listed apart)."""
    return {
        name: (int(limit), int(total))
        for name, limit, total in re.findall(
            r"^- (\w+): (\d+) \+ \d+ \+ report \d+(?: \+ verdict \d+)? = (\d+)$", text, flags=re.M
        )
    }


def spare_parts(text: str) -> list[str]:
    return re.findall(r"^- spare, only if the time left allows: (\w+) ", text, flags=re.M)


DEFAULT_PARTS = ["graphs", "bench512", "bench128", "syncfree", "ablations", "layout", "fast"]


def test_the_default_parts_fit_the_stated_total_with_every_grace_counted():
    """Every step's limit, a kill-after grace for each `timeout -k GRACE` step, a report step
    after each part, the final step: within TOTAL, which the script's header states."""
    d = script_defaults()
    assert d["TOTAL"] == 585 and d["COMPILE"] == 0 and d["GPU_TESTS"] == 1 and d["FAST_FRAMES"] > 0
    result = plan()
    assert result.returncode == 0, result.stdout + result.stderr
    steps = plan_steps(result.stdout)
    assert list(steps) == DEFAULT_PARTS  # COMPILE=0: no compile part
    assert spare_parts(result.stdout) == ["batchsrc", "gpu_tests"]  # run only if time is left
    setup = int(re.search(r"first report \d+ = (\d+)", result.stdout).group(1))
    t_check = d["START_S"] + 15  # imports and one triton kernel
    assert setup == d["T_GL"] + d["T_WHEELS"] + d["GRACE"] + t_check + d["GRACE"] + d["T_SMI"] + d["REPORT_S"]
    for name, (limit, total) in steps.items():
        assert total == limit + d["GRACE"] + d["REPORT_S"] + (d["GATE_S"] if name == "graphs" else 0)
    final = int(re.search(r"final report, brief and archive: (\d+)", result.stdout).group(1))
    worst = setup + sum(total for _, total in steps.values()) + final
    assert worst <= d["TOTAL"] < 600  # one call of the GPU tool: 600 s at most
    assert f"worst case {worst} s of TOTAL={d['TOTAL']} s: every part that is not spare fits" in result.stdout
    # every step the script runs under `timeout -k` is one the plan counts
    text = SCRIPT.read_text()
    assert text.count('timeout -k "$GRACE"') == 3  # wheels, import check, each part (one call site)
    assert text.count("timeout -k 1 ") == 6  # EGL, nvidia-smi, report, gate verdict, final report, brief
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
    assert spare_parts(crowded.stdout) == ["batchsrc", "gpu_tests"]
    assert "does not fit" in crowded.stdout
    roomy = plan(OPTSTEP="1", FAST_FRAMES="0", GPU_TESTS="0")
    assert roomy.returncode == 0 and "every part that is not spare fits" in roomy.stdout, roomy.stdout
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
    assert "import check 45 + 3" in plan().stdout  # START_S + 15: one triton kernel compiled
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
    for name in ("gpu_run.sh", "gpu_report.py", "gpu_wheels.py", "gpu_check.py", "gpu_learn.sh"):
        text = (REPO / "tools" / "gpu" / name).read_text()
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


GATE_MODES = ["fp16", "fp32", "fp16-kornia", "bf16", "fp16-six", "fp16-splitk", "fp16-compiled"]


def _gate_cases(**outcomes: str) -> dict[str, str]:
    return {f"{gpu_report.GRAPH_TEST}[{m}]": outcomes.get(m.replace("-", "_"), "passed") for m in GATE_MODES}


@pytest.mark.parametrize(
    "cases,verdict",
    [
        (_gate_cases(), "on"),
        (_gate_cases(fp16="failure"), "off"),
        (_gate_cases(fp16_compiled="failure"), "on-uncompiled"),  # compiled cells timed eagerly only
        (_gate_cases(fp16_compiled="skipped"), "on-uncompiled"),
        (_gate_cases(fp16_splitk="error"), "off"),
        ({"test_something_else": "passed"}, "off"),
        (None, "off"),  # cut before pytest wrote its XML
    ],
)
def test_graphs_are_timed_only_where_the_gate_showed_them_equal_to_eager(tmp_path, cases, verdict, capsys):
    """The gate reads its own XML, written by a part that runs the graph test alone: every mode
    but the compiled optimizer's in graphs.xml, that one in graphs_compiled.xml."""
    if cases is not None:
        compiled = {k: v for k, v in cases.items() if k.endswith("[fp16-compiled]")}
        _junit(tmp_path / "graphs.xml", {k: v for k, v in cases.items() if k not in compiled})
        _junit(tmp_path / "graphs_compiled.xml", compiled)
    _junit(tmp_path / "gpu_tests.xml", {"test_a_compile_heavy_one": "failure"})  # not the gate's business
    assert gpu_report.gate(tmp_path)[0] == verdict
    assert gpu_report.main(["gate", str(tmp_path)]) == 0 and capsys.readouterr().out.strip() == verdict


def test_a_compiled_gate_case_cut_by_the_limit_costs_only_its_own_verdict(tmp_path):
    """The compiled optimizer's case runs second, into its own XML: cut by the part's limit (no
    graphs_compiled.xml), the other modes' graphs are still timed and compiled cells run eagerly."""
    _junit(tmp_path / "graphs.xml", {k: v for k, v in _gate_cases().items() if "compiled" not in k})
    verdict, said = gpu_report.gate(tmp_path)
    assert verdict == "on-uncompiled" and "6 of 6 modes" in said


def test_the_gate_is_a_short_part_of_its_own_and_compile_heavy_tests_come_after_the_measurements():
    """Cut by its limit, a pytest of every GPU test wrote no XML and so turned off every graphed
    goal: the gate runs the graphs-equal-eager test alone (part graphs, graphs.xml) before the
    measurements; every other GPU test (triton compiles) runs last, as a spare part."""
    goals = plan(GOALS="1").stdout
    assert list(plan_steps(goals))[0] == "graphs" and spare_parts(goals)[-1] == "gpu_tests"
    assert list(plan_steps(plan().stdout))[0] == "graphs" and spare_parts(plan().stdout)[-1] == "gpu_tests"
    text = SCRIPT.read_text()
    gate_call = text[text.index("part graphs ") :].split("\n\n")[0].split("fi\n")[0]
    assert "-k 'not fp16-compiled' --junitxml='$WORK/graphs.xml' '$GRAPH_TEST'" in gate_call
    assert "--junitxml='$WORK/graphs_compiled.xml' '$GRAPH_TEST[fp16-compiled]'" in gate_call  # its own XML
    assert " tests" not in gate_call
    assert "GRAPH_TEST=tests/test_graphs.py::test_real_cuda_graphs_equal_eager_updates_on_a_gpu" in text
    rest = next(line for line in text.splitlines() if line.strip().startswith("part gpu_tests "))
    assert "gpu_tests.xml" in text and '--deselect "$GRAPH_TEST"' in text and "tests" in rest
    assert text.index("part gpu_tests ") > text.index('bench "goals$batch"') > text.index("part graphs ")


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


def test_install_takes_the_wheels_the_machine_lacks_or_has_in_another_version(tmp_path):
    """By name alone an older kornia, omegaconf or mujoco already on the machine won over the
    pinned wheel: a wheel is installed unless the machine has its project in its version."""
    numpy_version = importlib.metadata.version("numpy")
    names = (
        f"numpy-{numpy_version}-py3-none-any.whl",  # the same version: the machine's stays
        "kornia-0.0.1-py3-none-any.whl",  # another version: replaced
        "no_such_project_here-1.0-py3-none-any.whl",  # missing
    )
    for name in names:
        (tmp_path / name).write_bytes(b"")
    chosen = [(w.name, old) for w, old in gpu_wheels.wheels_to_install(tmp_path)]
    assert chosen == [(names[1], importlib.metadata.version("kornia")), (names[2], None)]
    assert gpu_wheels.main(["--python-version", "twelve"]) == 2


def test_lightning_travels_in_the_version_tested_here():
    """GradientAverage relies on lightning's strategy internals: the machine's lightning is
    replaced when its version differs from the one tested here (and with it its two packages)."""
    listed = dict(map(pinned, gpu_wheels.WHEELS))
    for name in ("lightning", "lightning-utilities", "torchmetrics"):
        assert listed[name] == importlib.metadata.version(name), name


LEARN_SCRIPT = REPO / "tools" / "gpu" / "gpu_learn.sh"


def learn_limits(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"(\w+)=\$\{\1:-(\d+)\}", text)}


def test_the_learning_script_names_nothing_outside_the_repository_and_fits_ten_minutes():
    """Every limit of tools/gpu/gpu_learn.sh added up, each kill-after grace counted: within TOTAL,
    below one call's 600 s. Its floors once reached ~675 s (a 30-s import check after the set-up's
    60 s ran out, a 5-s install, two 20-s and two 15-s archive steps past the training's end), so a
    call cut at 600 s lost the runs' summaries: the training now ends where the stop and the
    final archive still fit, and each archive is cut to the time left."""
    text = LEARN_SCRIPT.read_text()
    for outside in ("../shared", "/work/", "shared/tools", "device tool", "session"):
        assert outside not in text, outside
    d = learn_limits(text)
    setup = d["T_GL"] + d["T_WHEELS"] + d["GRACE"] + d["T_CHECK"] + d["GRACE"]
    train_end = d["TOTAL"] - d["STOP_S"] - d["FINAL_S"]
    # the final archive: (FINAL_S - 4) shared by three steps + 1 s grace each, + 1 s for the kills
    final = (d["FINAL_S"] - 4) + 3 + 1
    assert train_end + d["STOP_S"] + final <= d["TOTAL"] < 600
    assert train_end - setup >= 450  # about 8 minutes of learning after a set-up run to its limits
    result = subprocess.run(["bash", str(LEARN_SCRIPT), "--plan"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and f"worst case {d['TOTAL']} s of TOTAL={d['TOTAL']} s" in result.stdout
    assert f"at least {train_end - setup} s of it" in result.stdout
    # no step without a limit, and no floor that outlasts the budget
    assert "setup_deadline" not in text and "DURATION" not in text
    assert text.count('timeout -k "$GRACE"') == 2  # wheels, import check
    assert (
        'timeout -k 1 "$l_returns"' in text and 'timeout -k 1 "$l_plot"' in text and 'timeout -k 1 "$l_tar" tar' in text
    )
    assert "archive $(( left - 3 < 20 ? left - 3 : 20 ))" in text  # an archive on the way ends by train_end


def test_the_learning_script_refuses_a_budget_with_no_time_to_train():
    result = subprocess.run(
        ["bash", str(LEARN_SCRIPT), "--plan"],
        env={**os.environ, "TOTAL": "120"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and "leaves no time to train" in result.stdout


@pytest.mark.slow
def test_the_learning_script_archives_each_mode_as_it_goes(tmp_path):
    """On the CPU with the tiny agent: two modes side by side, stopped after their time; the
    archive holds each run's metrics, config and log tail, the curves and the returns table."""
    out, work = tmp_path / "out", tmp_path / "work"
    settings = dict(
        DEVICE="cpu",
        PYTHON=sys.executable,
        WORK=str(work),
        T_CHECK="100",  # imports take a while on a busy 2-core machine
        TOTAL="270",  # training ends 150 s after the start: about 100 s of it
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
    """GOALS=1: the CUDA-graph gate, then each batch size's goal cells in a part of its own (a slow
    batch 512 cannot cut batch 128), the fast run with the compiled optimizer and parallel
    environments; the eager rows and the other GPU tests only if time is left. Within TOTAL,
    below one call's 600 s."""
    result = plan(GOALS="1")
    assert result.returncode == 0 and "every part that is not spare fits" in result.stdout, result.stdout
    assert list(plan_steps(result.stdout)) == ["graphs", "goals512", "goals128", "fast"]
    assert spare_parts(result.stdout) == ["goals_eager", "gpu_tests"]
    worst = int(re.search(r"worst case (\d+) s", result.stdout).group(1))
    assert worst <= script_defaults()["TOTAL"] < 600
    text = SCRIPT.read_text()
    assert "GOAL_MODES=fp32,fp16,tf32,bf16,fp16-compiled " in text
    assert tuple(re.search(r"GOAL_MODES=([\w,-]+)", text).group(1).split(",")) == gpu_report.GOAL_MODES
    assert gpu_report.GOAL_MODES[-1] == "fp16-compiled"  # a cold compile that overruns cuts only itself
    assert 'bench.modes="$GRAPHED_GOAL_MODES" bench.cuda_graphs="$GRAPHS"' in text
    assert 'bench.batch="$GOAL_BATCH"' in text  # the batch on the device, as a GPU-resident replay hands it
    assert 'fast_goals="env.num_envs=$GOALS_ENVS"' in text and 'fast_goals+=" perf.compile_optimizer=true"' in text
    assert "train.overlap_collection=true $fast_goals" in text  # the fast run steps its envs during updates
    assert script_defaults()["GOALS"] == 0 and script_defaults()["GOALS_ENVS"] == 8


def _goals_work(
    tmp_path: Path,
    ms: dict[tuple[str, int], float],
    frames_per_s: list[float] | None,
    planned: dict[int, list[str]] | None = None,
) -> Path:
    import json

    work = tmp_path / "work"
    (work / "goals_eager").mkdir(parents=True)
    for batch in (512, 128):
        rows, eager = [], []
        for (mode, b), value in ms.items():
            if b != batch:
                continue
            for variant, factor, into in (("cuda_graphs+device_batch", 1.0, rows), ("device_batch", 3.0, eager)):
                row = {"mode": mode, "batch_size": b, "variant": variant, "ms_mean": value * factor, "status": "ok"}
                row["gflop_per_update"] = b * 0.96  # DrQ's agent: ~0.96 GFLOP a sample (pixelsac/perf/flops.py)
                row["peak_mem_bytes"] = (2 if mode == "fp32" else 1) * 2**30 * b // 512
                row["split_k"] = "mixed_gemm" if mode.startswith("fp16") else "off"
                row["device"] = "cuda"
                into.append(row)
        modes = (planned or {}).get(batch) or sorted({m for m, b in ms if b == batch})
        cells = [{"mode": m, "batch_size": batch, "variant": "cuda_graphs+device_batch"} for m in modes]
        (work / f"goals{batch}").mkdir()
        (work / f"goals{batch}" / "bench.json").write_text(json.dumps({"rows": rows, "planned": cells}))
        (work / f"goals{batch}" / "bench.md").write_text("# pixelsac update-step benchmark\n\n| table |\n")
        previous = json.loads((work / "goals_eager" / "bench.json").read_text())["rows"] if batch == 128 else []
        (work / "goals_eager" / "bench.json").write_text(json.dumps({"rows": previous + eager, "planned": []}))
    (work / "device.txt").write_text("- python 3.12.3, torch 2.11.0+cu128, lightning 2.6.0, NVIDIA H200 (140 GiB)\n")
    (work / "triton.txt").write_text("ok: torch.compile built and ran one kernel with triton\n")
    _junit(work / "graphs.xml", _gate_cases())
    (work / "status.tsv").write_text(
        "graphs\tok\t0\t40\t80\t\ngoals512\tok\t0\t120\t120\t\ngoals128\tok\t0\t60\t90\t\n"
        "fast\tok\t0\t90\t140\t\ngoals_eager\tok\t0\t50\t90\t\n"
    )
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


GOAL_MS = {("fp32", 512): 13.0, ("fp16", 512): 7.0, ("fp16-compiled", 512): 5.5, ("tf32", 512): 9.0,
           ("bf16", 512): 6.5, ("fp32", 128): 6.0, ("fp16", 128): 2.8, ("fp16-compiled", 128): 3.1,
           ("tf32", 128): 4.0, ("bf16", 128): 3.2}  # fmt: skip


def test_the_report_opens_with_each_goal_its_figure_and_whether_it_is_met(tmp_path):
    """From the graphed rows only (eager rows here are 3x slower and must not count): batch 512
    fp16-compiled 5.5 ms (<= 6: met) at 2.36x IEEE fp32's 13 ms (< 2.5: not met); batch 128 fp16
    2.8 ms (<= 3: met), 2.14x (>= 2: met); end to end the median of the later half of the log
    intervals (compilation and capture in the first ones): 820 frames/s, met. fp32 is named IEEE
    fp32, TF32 stands beside it, and every line says where the batch was."""
    work = _goals_work(tmp_path, GOAL_MS, [90.0, 400.0, 780.0, 820.0, 830.0, 815.0])
    text = gpu_report.report(work, tmp_path / "out", final=True)
    goals = text.split("## Goals", 1)[1].split("## Parts", 1)[0]
    assert (
        "batch 512, CUDA graphs, batch on the GPU: fp16 update <= 6 ms: met (fp16 7.00 ms, fp16-compiled 5.50 ms)"
        in goals
    )
    assert (
        "batch 512, CUDA graphs: fp16 >= 2.5x IEEE fp32 (13.00 ms): not met (fp16 1.86x, fp16-compiled 2.36x); "
        "TF32 9.00 ms, fp16 1.64x it" in goals
    )
    assert "batch 128, CUDA graphs, batch on the GPU: fp16 update <= 3 ms: met" in goals
    assert "batch 128, CUDA graphs: fp16 >= 2x IEEE fp32 (6.00 ms): met" in goals
    # what the time goal asks of the GPU, beside what the fastest fp16 sustained (491.5 GFLOP / 5.5 ms)
    assert "batch 512: 491.5 GFLOP per update; 6 ms asks 81.9 TFLOP/s sustained, fp16-compiled sustained 89.4" in goals
    assert ">= 800 env frames/s: met (820)" in goals
    assert "(8 environments, compiled optimizer)" in text
    assert "amp is not among the goal rows" in goals  # why AMP keeps its unsplit GEMM, said


def test_goals_not_measured_say_so(tmp_path):
    """Goals parts cut before their first cell, and no finished fast run: every goal "not measured"."""
    work = _goals_work(tmp_path, {}, None)
    goals = gpu_report.report(work, tmp_path / "out").split("## Goals", 1)[1].split("## Parts", 1)[0]
    assert goals.count("not measured") == 3 and " met" not in goals


def test_the_brief_has_every_goal_figure_the_gpu_torch_and_what_was_cut_in_15_lines(tmp_path, capsys):
    """A call whose files cannot be fetched still reports: the script's last output is the brief,
    at most 15 lines, with each goal mode's ms at both batches as graphs and eager, the ratios to
    IEEE fp32 and TF32, peak memory, end-to-end frames/s, the GPU, torch, the checks, the cut."""
    planned = {128: ["fp32", "fp16", "tf32", "bf16", "fp16-compiled", "fp16-extra"]}  # one cell never reached
    work = _goals_work(tmp_path, GOAL_MS, [700.0, 820.0, 820.0], planned=planned)
    with (work / "status.tsv").open("a") as f:
        f.write("gpu_tests\tskipped\t\t\t120\tnot started: 470 s elapsed + 137 s needed > TOTAL 585 s\n")
    assert gpu_report.main(["brief", str(work), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert len(lines) <= 15 and (tmp_path / "out" / "brief.txt").read_text() == printed
    assert "NVIDIA H200" in lines[0] and "torch 2.11.0+cu128" in lines[0]
    for batch in (512, 128):
        graphed = next(line for line in lines if line.startswith(f"batch {batch} graphs (batch on the GPU)"))
        eager = next(line for line in lines if line.startswith(f"batch {batch} eager"))
        for mode in ("IEEE fp32", "fp16", "TF32", "bf16", "fp16-compiled"):
            assert f"{mode} " in graphed and f"{mode} " in eager, (mode, graphed, eager)
    assert "IEEE fp32 13.00 | fp16 7.00 | TF32 9.00 | bf16 6.50 | fp16-compiled 5.50" in printed
    assert "fp16-compiled <= 6 ms: met; 2.36x IEEE fp32 (>= 2.5x: not met); 1.64x TF32" in printed
    assert "peak fp16-compiled 1,024 MiB, IEEE fp32 2,048 MiB (0.50x)" in printed
    assert "end to end: 820 env frames/s (>= 800: met; fast_fp16 (8 environments, compiled optimizer))" in printed
    assert "CUDA graphs on (7 of 7 modes" in printed and "triton ok" in printed and "split-K: mixed_gemm" in printed
    assert "cut: gpu_tests skipped; goals128: fp16-extra 128 (not reached: part ok)" in printed


def test_the_brief_says_what_was_dropped_and_cut_when_parts_ran_out_of_time(tmp_path):
    """triton unable to compile: the compiled cells and optimizer are dropped, said; a goals part
    cut by its limit before its first cell: "nothing measured (timed out)"; cells of a part cut
    halfway: each named. Long cut lists still end within 15 lines."""
    work = _goals_work(tmp_path, {k: v for k, v in GOAL_MS.items() if k[1] == 512}, None)
    (work / "triton.txt").write_text("failed: RuntimeError: Failed to find C compiler\n")
    for name in ("goals128", "goals_eager"):
        for f in (work / name).iterdir():
            f.unlink()
        (work / name).rmdir()
    (work / "status.tsv").write_text(
        "graphs\ttimed out\t124\t83\t80\t\ngoals512\tok\t0\t99\t120\t\ngoals128\ttimed out\t124\t93\t90\t\n"
        "fast\tcrashed\t1\t20\t140\t\n"
    )
    lines = gpu_report.brief(work)
    text = "\n".join(lines)
    assert len(lines) <= 15
    assert "dropped: fp16-compiled cells and the fast run's compiled optimizer (triton cannot compile)" in text
    assert "graphs timed out" in text and "goals128 timed out" in text and "fast crashed" in text
    assert "goals128: nothing measured (timed out)" in text and "batch 128 graphs: not measured" in text
    assert "triton failed: RuntimeError: Failed to find C compiler" in text


def _mock_python(tmp_path: Path) -> Path:
    """A stand-in for the GPU machine's python: the import check runs for real (on the CPU) and
    then reports what MOCK_TRITON says; pytest is mocked (the gate writes graphs.xml after
    MOCK_GATE_SLEEP seconds, every mode passing); everything else (the benchmarks) runs."""
    mock = tmp_path / "bin" / "python"
    mock.parent.mkdir()
    cases = "".join(f'<testcase name="{gpu_report.GRAPH_TEST}[{m}]"></testcase>' for m in GATE_MODES[:-1])
    compiled = f'<testcase name="{gpu_report.GRAPH_TEST}[{GATE_MODES[-1]}]"></testcase>'
    mock.write_text(
        f"""#!/usr/bin/env bash
real={sys.executable}
case " $* " in
  *" tools/gpu/gpu_check.py "*)
    "$real" "$@"; rc=$?
    [[ -n "${{MOCK_TRITON:-}}" ]] && echo "$MOCK_TRITON" > "${{@: -1}}"
    exit $rc ;;
  *" -m pytest "*)
    for a in "$@"; do case $a in --junitxml=*) xml=${{a#--junitxml=}} ;; esac; done
    [[ "$xml" == */graphs.xml ]] && sleep "${{MOCK_GATE_SLEEP:-0}}"
    body='{cases}'; [[ "$xml" == */graphs_compiled.xml ]] && body='{compiled}'
    echo "<?xml version=\"1.0\"?><testsuites><testsuite>$body</testsuite></testsuites>" > "$xml"
    exit 0 ;;
esac
exec "$real" "$@"
"""
    )
    mock.chmod(0o755)
    return mock


@pytest.mark.slow
def test_a_goals_call_rehearsed_on_the_cpu_keeps_its_goals_when_the_gate_hangs(tmp_path):
    """The whole GOALS=1 call on the CPU, the GPU steps mocked: the gate hangs past its limit
    (as a cold compile inside it would), triton cannot compile. The gate is cut and reported
    timed out, graphs are off, and both goals parts still measure (eagerly) every goal mode but
    the dropped compiled one; the end-to-end run (tiny, 2 environments) runs without the
    compiled optimizer; the spare GPU-test part does not fit and is skipped; the call ends
    within TOTAL and its last output is the brief (<= 15 lines) saying all of it."""
    out, work = tmp_path / "out", tmp_path / "work"
    total = 1500
    settings = dict(
        GOALS="1",
        DEVICE="cpu",
        PYTHON=str(_mock_python(tmp_path)),
        MOCK_TRITON="failed: RuntimeError: Failed to find C compiler (mock)",
        MOCK_GATE_SLEEP="60",
        WORK=str(work),
        TOTAL=str(total),
        T_CHECK="300",  # imports take a while on a busy 2-core machine
        T_GRAPHS="3",
        REPORT_S="60",
        GATE_S="30",
        FINAL_S="120",
        T_GOAL512="400",
        T_GOAL128="400",
        T_TESTS=str(total),  # spare: never fits
        T_FAST_GOALS="600",
        FAST_FRAMES="800",
        GOALS_ENVS="2",
        FAST_ARGS="preset=tiny train.num_threads=1 train.eval_in_worker=false train.log_every_updates=5",
        N_GOALS="1",
        WARMUP="0",
        BENCH_ARGS="env.image_size=24 agent.num_filters=4 agent.feature_dim=8 agent.hidden_dim=16 "
        "bench.isolate=false train.num_threads=1",
    )
    started = time.monotonic()
    result = subprocess.run(
        ["bash", str(SCRIPT), str(out)], env=cli_env(**settings), capture_output=True, text=True, timeout=total + 60
    )
    assert time.monotonic() - started <= total
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    status = {s["part"]: s for s in gpu_report.read_status(work)}
    assert (status["graphs"]["state"], status["graphs"]["rc"]) == ("timed out", "124")
    assert status["goals512"]["state"] == status["goals128"]["state"] == status["fast"]["state"] == "ok"
    assert status["gpu_tests"]["state"] == "skipped" and "goals_eager" not in status  # graphs off: no eager part
    rows = gpu_report.goal_rows(work)
    assert {(m, b) for m, b, _ in rows} == {(m, b) for m in ("fp32", "fp16", "bf16") for b in (512, 128)}
    brief = result.stdout[result.stdout.rindex("pixelsac on a GPU:") :].splitlines()
    assert len(brief) <= 15, brief
    text = "\n".join(brief)
    assert "torch " in brief[0] and "batch 512 eager" in text and "batch 128 eager" in text
    assert "cut: graphs timed out; gpu_tests skipped" in text and "CUDA graphs off" in text
    assert "dropped: fp16-compiled cells" in text
    assert re.search(r"end to end: [\d,]+ env frames/s \(>= 800: not met; fast_fp16 \(2 environments\)\)", text), text
    assert "compile_optimizer: false" in (work / "fast_fp16" / "config.yaml").read_text()
    report = (out / "report.md").read_text()
    assert report.startswith("# pixelsac on a GPU") and "## In brief" in report
    assert (out / "brief.txt").read_text().splitlines() == brief
