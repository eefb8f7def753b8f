"""The update-step benchmark: tiny CPU runs write their tables and chart, ratios are arithmetic on
measured values, fresh-process cells measure their own memory, and bad input is refused."""

import csv
import json
import subprocess
import sys

import pytest
import torch
from conftest import cli_env

from pixelsac import bench, nets
from pixelsac.bench import cells, report
from pixelsac.bench import plan as plan_mod
from pixelsac.config import load_config, to_plain
from pixelsac.module import SACModule
from pixelsac.precision import native_half_kernels

TINY = [
    "task=cartpole_swingup",
    "env.image_size=24",
    "agent.num_filters=4",
    "agent.feature_dim=8",
    "agent.hidden_dim=16",
    "bench.batch_sizes=4",
    "bench.updates=2",
    "bench.warmup=1",
]


def row(mode, ms, state, peak=None, batch=128, variant="", kind="cuda_max_allocated", status="ok", **extra):
    return {
        "mode": mode,
        "batch_size": batch,
        "variant": variant,
        "ms_mean": ms,
        "state_bytes": state,
        "peak_mem_bytes": peak,
        "peak_mem_kind": kind,
        "status": status,
        **extra,
    }


def test_ratios_are_computed_from_the_measured_values():
    rows = report.add_ratios(
        [
            row("fp32", 40.0, 1200, peak=9000),
            row("fp16", 16.0, 800, peak=3000),
            row("fp32", 100.0, 1200, peak=20000, batch=512),
            row("fp16", 25.0, 800, peak=None, batch=512),  # peak not measured: no peak ratio
            row("fp16", 10.0, 800, peak=3000, variant="channels_last"),  # no fp32 with channels_last
            row("bf16", 5.0, 600, status="failed: out of memory"),
        ]
    )
    fp32, fp16, fp32_512, fp16_512, fp16_cl, failed = rows
    assert fp32["speedup_vs_fp32"] == 1.0 and fp32["state_vs_fp32"] == 1.0
    assert fp16["speedup_vs_fp32"] == pytest.approx(40.0 / 16.0)  # fp32 ms / mode ms
    assert fp16["state_vs_fp32"] == pytest.approx(800 / 1200)  # mode bytes / fp32 bytes
    assert fp16["peak_vs_fp32"] == pytest.approx(3000 / 9000)
    assert fp16_512["speedup_vs_fp32"] == pytest.approx(100.0 / 25.0)  # paired with fp32 at its own batch size
    assert fp16_512["peak_vs_fp32"] is None
    assert fp16_cl["speedup_vs_fp32"] is None and fp16_cl["state_vs_fp32"] is None
    assert failed["speedup_vs_fp32"] is None
    # what a switch buys: the same mode and batch with every switch off (its first row) / this row
    assert fp16_cl["speedup_vs_base"] == pytest.approx(16.0 / 10.0) and fp16_cl["base_variant"] == ""
    assert fp16["speedup_vs_base"] == 1.0 and failed["speedup_vs_base"] is None


def test_memory_ratios_pair_each_emulation_form_with_fp32():
    groups32 = {"parameters": {"critic.trunk": 400}, "optimizer": {"exp_avg": 400, "exp_avg_sq": 400}}
    groups16 = {"parameters": {"critic.trunk": 200}, "optimizer": {"exp_avg": 200, "exp_avg_root": 200}}
    rows = report.add_ratios(
        [
            row("fp32", 40.0, 1200, saved_bytes=1000, tensor_peak_bytes=3000, state_groups=groups32),
            row(
                "fp16",
                50.0,
                800,
                variant="saves_fp32",
                speed_variant="",
                saved_bytes=1500,
                tensor_peak_bytes=2900,
                state_groups=groups16,
            ),
            row(
                "fp16",
                52.0,
                800,
                variant="saves_low",
                speed_variant="",
                saved_bytes=500,
                tensor_peak_bytes=1800,
                state_groups=groups16,
            ),
        ]
    )
    _, old, new = rows
    assert old["saved_vs_fp32"] == 1.5 and new["saved_vs_fp32"] == 0.5 and new["tensor_peak_vs_fp32"] == 0.6
    assert new["speedup_vs_fp32"] == pytest.approx(40 / 52) and new["speedup_vs_base"] == pytest.approx(50 / 52)
    assert new["state_groups_vs_fp32"] == {
        "parameters": {"critic.trunk": 0.5},
        "optimizer": {"exp_avg": 0.5, "exp_avg_root": None},
    }


def test_sync_free_is_measured_on_and_off(tmp_path):
    out = tmp_path / "bench"
    assert (
        bench.main(
            [
                *TINY,
                "bench.modes=fp32,fp16",
                "bench.sync_free=both",
                "bench.batch=all",
                "bench.isolate=false",
                f"bench.out={out}",
            ]
        )
        == 0
    )
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert [(r["mode"], r["variant"]) for r in rows] == [
        ("fp32", "host_sync"),
        ("fp16", "host_sync"),
        ("fp32", "sync_free"),
        ("fp16", "sync_free"),
    ]
    assert all(r["status"] == "ok" for r in rows)
    on = {r["mode"]: r for r in rows if r["variant"] == "sync_free"}
    off = {r["mode"]: r for r in rows if r["variant"] == "host_sync"}
    for mode in ("fp32", "fp16"):
        assert float(on[mode]["speedup_vs_base"]) == pytest.approx(
            float(off[mode]["ms_mean"]) / float(on[mode]["ms_mean"])
        )
        assert on[mode]["base_variant"] == "host_sync"
    text = (out / "bench.md").read_text()
    assert "batch sources pinned and device: skipped on a CPU" in text and "vs switches off" in text
    # what each update dispatches, in the GPU's form: the same ops on and off, host reads only off
    for r in rows:
        assert int(r["ops_full"]) > int(r["ops_critic"]) > 0 and int(r["casts_full"]) >= int(r["casts_critic"]) > 0
    for mode in ("fp32", "fp16"):
        assert on[mode]["host_reads_full"] == on[mode]["host_reads_critic"] == "0"
    assert int(off["fp16"]["host_reads_full"]) >= 3 and int(off["fp16"]["host_reads_critic"]) >= 1
    assert float(on["fp32"]["ops_vs_fp32"]) == 1.0
    assert float(on["fp16"]["ops_vs_fp32"]) == pytest.approx(int(on["fp16"]["ops_full"]) / int(on["fp32"]["ops_full"]))
    assert float(on["fp16"]["kernels_vs_fp32"]) == pytest.approx(
        int(on["fp16"]["kernels_full"]) / int(on["fp32"]["kernels_full"])
    )
    assert all(int(r["ops_full"]) > int(r["kernels_full"]) > 0 for r in rows)  # views launch nothing
    assert "What one update dispatches" in text
    assert "| aten ops | ops × fp32 (full) | kernels | kernels × fp32 (full) | casts | host reads |" in text


def test_tiny_cpu_benchmark_writes_csv_markdown_json_and_png(tmp_path, capsys):
    out = tmp_path / "bench"
    code = bench.main(
        [*TINY, "bench.modes=fp32,fp16-naive,fp16,fp16-native", "bench.isolate=false", f"bench.out={out}"]
    )
    assert code == 0
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert [r["mode"] for r in rows] == ["fp32", "fp16-naive", "fp16", "fp16-native"]
    assert all(r["status"] == "ok" and float(r["ms_mean"]) > 0 and r["updates"] == "2" for r in rows)
    by_mode = {r["mode"]: r for r in rows}
    for r in rows:  # every ratio is fp32's figure over (or under) the row's own measured one
        assert float(r["speedup_vs_fp32"]) == pytest.approx(float(by_mode["fp32"]["ms_mean"]) / float(r["ms_mean"]))
        assert float(r["state_vs_fp32"]) == pytest.approx(int(r["state_bytes"]) / int(by_mode["fp32"]["state_bytes"]))
    for r in rows:  # one arithmetic for every mode; the rate is it over the row's own time
        assert r["gflop_per_update"] == by_mode["fp32"]["gflop_per_update"] and float(r["gflop_full"]) > 0
        assert float(r["tflops_achieved"]) == pytest.approx(float(r["gflop_per_update"]) / float(r["ms_mean"]))
    assert by_mode["fp16-naive"]["finite_after_first_update"] == "False"  # naive fp16 fails at once, timed anyway
    assert by_mode["fp16"]["finite_at_end"] == "True"
    assert by_mode["fp16"]["emulated"] == "True" and by_mode["fp16-native"]["emulated"] == "False"
    assert by_mode["fp16"]["peak_mem_kind"].startswith("not measured")  # in-process on a CPU: said, not guessed
    for r in rows:  # memory where it is spent: saved for backward and the update's tensor peak, each vs fp32
        for key in ("saved_bytes", "tensor_peak_bytes"):
            assert float(r[key.replace("bytes", "vs_fp32")]) == pytest.approx(int(r[key]) / int(by_mode["fp32"][key]))
    for mode in ("fp16", "fp16-native"):  # emulated or native fp16: fp16 saved, as on a GPU
        assert float(by_mode[mode]["saved_vs_fp32"]) <= 0.55

    text = (out / "bench.md").read_text()
    assert "This ran on a CPU" in text and "not the speed-ups a GPU gives" in text and "emulated" in text
    assert "fp32-accumulate on vs off" in text  # this machine's own speed-up, fp16 emulated vs native
    assert "non-finite after update 1" in text
    assert "bytes per transition" in text
    for what in (
        "saved for backward MiB (× fp32)",
        "tensor peak MiB",
        "Which memory figure is which",
        "saved_tensors_hooks",
        "State by group",
        "| optimizer | exp_avg_root |",
        "| optimizer | exp_avg_sq |",
        "GFLOP full / critic-only",
        "achieved TFLOP/s",
    ):
        assert what in text, what
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    meta = json.loads((out / "bench.json").read_text())
    assert meta["replay"]["bytes_per_transition"] > 3 * 24 * 24 and len(meta["rows"]) == 4
    assert "fp16-native" in capsys.readouterr().out


def test_a_compiled_cell_is_timed_without_the_saved_tensor_meter(tmp_path):
    """``bench.compile=on`` cells failed on torch 2.13 ("Guard failed on the same frame it was
    created"): dynamo traced the saved-tensor meter's pack hook into the first compile. Compiled
    cells now leave that meter out (saved for backward: n/a); the eager backend shows the wiring."""
    out = tmp_path / "bench"
    args = ["bench.modes=fp32,fp16", "bench.compile=on", "bench.compile_backend=eager", "bench.isolate=false"]
    assert bench.main([*TINY, *args, f"bench.out={out}"]) == 0
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert [(r["mode"], r["status"]) for r in rows] == [("fp32", "ok"), ("fp16", "ok")], rows
    assert all(float(r["ms_mean"]) > 0 and r["saved_bytes"] == "" for r in rows)


def test_a_fresh_process_cell_measures_its_own_peak_rss(tmp_path):
    plan = plan_mod.make_plan([*TINY, "bench.modes=fp32", f"bench.out={tmp_path / 'unused'}"])
    assert plan.isolate  # the default on a CPU
    result = cells.run_cell_isolated(plan.cells[0])
    assert result["status"] == "ok" and result["mode"] == "fp32"
    assert result["peak_mem_kind"].startswith("rss_peak_above_baseline")
    assert result["saved_bytes"] > 0 and result["tensor_peak_bytes"] > 0 and result["state_groups"]["parameters"]
    assert 0 < result["peak_mem_bytes"] < result["rss_peak_bytes"]
    assert not (tmp_path / "unused").exists()  # planning and measuring write nothing


def test_the_emulations_two_forms_are_measured_apart_and_interleaved(tmp_path):
    out = tmp_path / "bench"
    assert (
        bench.main(
            [*TINY, "bench.modes=fp32,fp16", "bench.emulation_saves=both", "bench.isolate=false", f"bench.out={out}"]
        )
        == 0
    )
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert [(r["mode"], r["variant"], r["emulation"]) for r in rows] == [
        ("fp32", "", ""),
        ("fp16", "saves_fp32", "saves_fp32"),
        ("fp16", "saves_low", "saves_low"),
    ]
    fp32, old, new = rows
    assert float(new["saved_vs_fp32"]) <= 0.55 and float(old["saved_vs_fp32"]) > 1.0  # fp32 copies beside fp16
    assert old["state_bytes"] == new["state_bytes"] and float(new["speedup_vs_fp32"]) > 0
    meta = json.loads((out / "bench.json").read_text())
    (interleaved,) = meta["interleaved"]
    forms = interleaved["ms_by_form"]
    assert interleaved["status"] == "ok" and len(forms["saves_low"]) == len(forms["saves_fp32"]) == 2
    text = (out / "bench.md").read_text()
    assert "interleaved update by update in one process" in text and "fp16-saving ÷ fp32-saving" in text


def test_speed_switches_keep_the_networks_output():
    cfg = load_config(
        ["env.image_size=24", "agent.num_filters=4", "agent.feature_dim=8", "agent.hidden_dim=16", "precision=fp32"]
    )
    torch.manual_seed(0)
    plain = SACModule(to_plain(cfg), (9, 24, 24), 2)
    torch.manual_seed(0)
    fast = SACModule(to_plain(cfg), (9, 24, 24), 2)
    nets.apply_speed_options(fast, channels_last=True, compile=True, compile_backend="eager")
    conv = fast.critic.trunk.convs[0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    assert fast.critic_target.trunk.convs[2].weight.is_contiguous(memory_format=torch.channels_last)
    assert [n for n, _ in fast.named_parameters()] == [n for n, _ in plain.named_parameters()]  # checkpoints unchanged
    obs = torch.randint(0, 256, (3, 9, 24, 24)).float()
    action = torch.rand(3, 2)
    for expected, got in zip(plain.critic(obs, action), fast.critic(obs, action)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_help_documents_every_bench_option(capsys):
    assert bench.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "pixelsac-bench" in text
    for name in plan_mod.OPTIONS:
        assert f"bench.{name}" in text, name


@pytest.mark.parametrize(
    "args,message",
    [
        (["bench.mode=fp16"], "unknown option 'bench.mode' (did you mean 'bench.modes'?)"),
        (["bench.modes=fp16,fp99"], "unknown mode 'fp99'"),
        (["bench.batch_sizes=128,0"], "bench.batch_sizes=0 must be a positive integer"),
        (["bench.updates=0"], "bench.updates=0 must be positive"),
        (["bench.updates=many"], "bench.updates='many' has the wrong type; it takes an integer"),
        (["bench.channels_last=sideways"], "choose one of auto, off, on, both"),
        (["bench.sync_free=maybe"], "choose one of auto, off, on, both"),
        (["bench.batch=gpu"], "choose from auto, all, host, pinned, device"),
        (["bench.emulation_saves=fp8"], "bench.emulation_saves='fp8'; choose one of low, fp32, both"),
        (["agent.batchsize=3"], "unknown key 'agent.batchsize' (did you mean 'agent.batch_size'?)"),
        (["task=cheeta_run"], "unknown task 'cheeta_run'"),
        (["bench.modes=tf32", "bench.device=cpu"], "nothing to run on a cpu: tf32: skipped"),
    ],
)
def test_bad_input_is_one_error_line_and_writes_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "out"
    assert bench.main([*args, f"bench.out={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_an_existing_output_folder_is_not_clobbered(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("precious")
    assert bench.main([*TINY, f"bench.out={tmp_path}"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_command_line_refuses_bad_input_with_exit_code_2(tmp_path):
    env = cli_env()
    result = subprocess.run(
        [sys.executable, "-m", "pixelsac.bench", "bench.modes=fp99"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and result.stderr.startswith("error: ")
    assert list(tmp_path.iterdir()) == []


def test_the_sync_free_part_changes_perf_sync_free_alone(tmp_path):
    """bench.sync_free=both: each host_sync cell's overrides are its sync_free twin's but for
    perf.sync_free (it also switched the random shift, index against kornia, so the 'gain' was
    not sync-freedom's); and fp32 on CUDA builds the same fused Adam both ways."""
    plan = plan_mod.make_plan(
        [*TINY, "bench.modes=fp32,fp16", "bench.sync_free=both", f"bench.out={tmp_path / 'unused'}"]
    )
    by_variant = {}
    for cell in plan.cells:
        by_variant.setdefault(cell.speed_variant, {})[cell.mode] = cell.overrides
    assert set(by_variant) == {"host_sync", "sync_free"}
    for mode in ("fp32", "fp16"):
        off, on = by_variant["host_sync"][mode], by_variant["sync_free"][mode]
        assert [o for o in off if o != "perf.sync_free=false"] == [o for o in on if o != "perf.sync_free=true"]
        assert "perf.sync_free=false" in off and "perf.sync_free=true" in on
        assert not any(o.startswith("perf.aug_backend") for o in on + off)

    from pixelsac.config import load_config
    from pixelsac.precision import PrecisionPolicy

    def adam(overrides, device):
        policy = PrecisionPolicy.from_config(load_config(overrides), device)
        group = policy.make_optimizer([torch.nn.Parameter(torch.zeros(2))], 1e-3, (0.9, 0.999), kahan=False)
        return group.param_groups[0]

    cuda_off, cuda_on = adam(by_variant["host_sync"]["fp32"], "cuda"), adam(by_variant["sync_free"]["fp32"], "cuda")
    assert cuda_off["fused"] and cuda_on["fused"]  # the same kernels; only the step count's place differs
    assert (cuda_off["capturable"], cuda_on["capturable"]) == (False, True)
    # a CPU has no capturable Adam: fused is what keeps fp32's step off the host there
    assert adam(by_variant["sync_free"]["fp32"], "cpu")["fused"]
    assert adam(by_variant["host_sync"]["fp32"], "cpu")["foreach"]


def test_a_report_write_that_fails_leaves_the_previous_reports_whole(tmp_path, monkeypatch):
    """The reports are rewritten after every cell, so a benchmark cut or failing mid-write must
    leave each file as it was: written beside it and renamed (pixelsac.files), never in place. A
    failure after the bytes are written (here: fsync) keeps the old bench.csv/md/json/png and
    leaves no temporary."""
    import os

    args = [*TINY, "bench.modes=fp32", "bench.isolate=false", f"bench.out={tmp_path / 'bench'}"]
    assert bench.main(args) == 0
    plan = plan_mod.make_plan([*args, "bench.overwrite=true"])
    before = {p.name: p.read_bytes() for p in plan.out.iterdir()}
    assert set(before) == {"bench.csv", "bench.md", "bench.json", "bench.png"}
    meta = json.loads(before["bench.json"])
    rows = [{**r, "ms_mean": r["ms_mean"] * 2} for r in meta["rows"]]

    def failing_fsync(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError):
        report.write_outputs(plan, rows, meta["header"], with_chart=False)
    with pytest.raises(OSError):
        report.chart(rows, plan.out / "bench.png", "title")
    assert {p.name: p.read_bytes() for p in plan.out.iterdir()} == before


def test_each_row_says_which_path_the_split_k_products_took(tmp_path):
    """A split projection (the tiny agent's K = 100 in chunks of 25) runs on a CPU as fp32 copies,
    and the row says so with the reason; fp32 splits nothing ("off"). On a GPU the row says
    mixed_gemm, or fp32_copies with the failure that ruled the mixed GEMM out."""
    out = tmp_path / "bench"
    args = ["bench.modes=fp32,fp16", "perf.split_k=25", "bench.isolate=false", f"bench.out={out}"]
    assert bench.main([*TINY, *args]) == 0
    rows = {r["mode"]: r for r in csv.DictReader((out / "bench.csv").open())}
    assert rows["fp32"]["split_k"] == "off"
    assert rows["fp16"]["split_k"] == "fp32_copies (no mixed-dtype GEMM on a CPU)"


NATIVE_FP16 = native_half_kernels(torch.float16)


@pytest.mark.skipif(NATIVE_FP16 is not None, reason="this CPU has native fp16 kernels: nothing is left out")
def test_a_cpu_without_native_fp16_leaves_the_80x_modes_out_unless_named(tmp_path):
    """The default modes ran amp and fp16-native on torch's reference fp16 CPU kernels (~80x
    fp32's time: amp at batch 512 took 85 s an update), so pixelsac-bench with no arguments did not
    finish on such a CPU. They are left out, said in a note, and run when bench.modes names them."""
    plan = plan_mod.make_plan([*TINY, f"bench.out={tmp_path / 'unused'}"])
    assert [cell.mode for cell in plan.cells] == ["fp32", "bf16", "fp16-naive", "fp16"]
    assert not any(cell.reference_fp16 for cell in plan.cells)
    note = next(note for note in plan.notes if note.startswith("amp, fp16-native: left out on this CPU"))
    assert "name them in bench.modes" in note and "fp16 autocast" in note
    named = plan_mod.make_plan([*TINY, "bench.modes=fp32,amp,fp16-native", f"bench.out={tmp_path / 'unused'}"])
    assert [(cell.mode, cell.reference_fp16) for cell in named.cells] == [
        ("fp32", False),
        ("amp", True),
        ("fp16-native", True),
    ]


def test_each_cells_expected_time_is_printed_before_the_first_cell(tmp_path, monkeypatch, capsys):
    plan = plan_mod.make_plan([*TINY, "bench.modes=fp32,fp16", "bench.device=cpu", f"bench.out={tmp_path / 'b'}"])
    amp = plan_mod.make_plan([*TINY, "bench.modes=amp", "bench.device=cpu", f"bench.out={tmp_path / 'c'}"]).cells
    plan.cells += amp

    def measure(plan, spec):
        print("measuring", spec.mode)
        return {"mode": spec.mode, "variant": "", "speed_variant": "", "batch_size": 4, "device": "cpu", "status": "x"}

    monkeypatch.setattr(cells, "_measure", measure)
    cells.run_plan(plan)
    out = capsys.readouterr().out
    assert out.index("expected times on this CPU") < out.index("measuring fp32")
    lines = {line.split(":")[0].strip(): line for line in out.splitlines() if ": about " in line}
    assert set(lines) == {"fp32 batch 4", "fp16 batch 4", "amp batch 4", "in all"}
    gflop = cells._plan_flops(plan.cells[0], {}).gflop_per_update
    fp32, reference = (
        plan_mod.expected_seconds(cell, gflop, torch.get_num_threads()) for cell in (plan.cells[0], amp[0])
    )
    start = plan_mod.CELL_START_SECONDS
    if amp[0].reference_fp16:  # the reference kernels' update time is ~80x fp32's
        assert reference - start == pytest.approx((fp32 - start) * plan_mod.REFERENCE_FP16_SLOWDOWN)
