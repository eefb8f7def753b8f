#!/usr/bin/env bash
# One shot on a GPU machine without network: what half precision buys there.
#
#   tools/gpu_run.sh OUT_DIR          # or: OUT=OUT_DIR tools/gpu_run.sh
#
# Run from anywhere; it works in the repository that holds this script. Missing packages come
# from wheels in .whl/ (built with ../shared/tools/gpu-wheelhouse.sh), installed with
# `pip install --no-index --no-deps --target /tmp/site`; torch and lightning are the machine's.
# If .gl/*.deb exist (EGL loaders, see the device notes) they are unpacked first.
#
# Parts, each under its own `timeout` (a part that fails or runs out of time is reported and the
# next one runs); see the knobs below for the limits:
#   1 bench512   python -m pixelsac.bench at batch 512: fp32 tf32 amp bf16 fp16-naive fp16   (T_B512 s)
#   2 bench128   the same modes at batch 128                                                  (T_B128 s)
#   3 ablations  fp16 minus each of the six switches, batch 512                               (T_ABL s)
#   4 layout     fp32 and fp16 with channels_last off/on, batch 512                           (T_CL s)
#   5 syncfree   fp32 and fp16: host decisions, sync-free, sync-free + CUDA graphs, batch 512 (T_SF s)
#   6 batchsrc   fp16 with the batch in pageable / pinned host memory / on the GPU, batch 512 (T_SRC s)
#   7 learning   cartpole_swingup, fp16 + six vs fp32, two runs side by side, LEARN_FRAMES    (T_LEARN s)
#   8 fast       one fp16 run with CUDA graphs and GPU-resident replay: end-to-end frames/s  (T_FAST s)
#   9 compile    fp32 and fp16 with torch.compile on, batch 512 (last: compiling can be slow) (T_COMPILE s)
#
# OUT_DIR receives few files (the device tool returns at most 8): report.md (every table),
# results.tar.gz (the whole tree: CSV, JSON, markdown, PNG, logs, run directories), bench512.png,
# bench128.png, learning.png and gpu_run.log. The tree itself is built in $WORK (default: a
# fresh folder under /tmp).
#
# Knobs (environment): N512=200 N128=100 N_ABL=50 N_CL=100 N_SF=100 N_COMPILE=100 WARMUP=20
#   LEARN_FRAMES=20000 LEARN_TASK=cartpole_swingup FAST_FRAMES=10000 COMPILE=1 (0 skips part 9)
#   T_B512=90 T_B128=40 T_ABL=50 T_CL=30 T_SF=60 T_SRC=30 T_LEARN=120 T_FAST=60 T_COMPILE=60
#   PYTHON=python3
#   DEVICE=cuda, BENCH_ARGS and LEARN_ARGS (extra key=value overrides) -- for a CPU smoke test:
#   DEVICE=cpu BENCH_ARGS='env.image_size=24 agent.num_filters=4 bench.isolate=false' \
#     LEARN_ARGS='preset=tiny' N512=1 N128=1 N_ABL=1 N_CL=1 N_SF=1 WARMUP=0 COMPILE=0 FAST_FRAMES=0 \
#     tools/gpu_run.sh /tmp/smoke
# The limits add up to 540 s; with start-up and wheels the worst case is about 9.5 minutes.
set -uo pipefail

OUT=${1:-${OUT:-}}
if [[ -z "$OUT" ]]; then
  echo "usage: tools/gpu_run.sh OUT_DIR   (or set OUT)" >&2
  exit 2
fi
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=${WORK:-$(mktemp -d /tmp/pixelsac_gpu_run.XXXXXX)}
mkdir -p "$WORK"
PY=${PYTHON:-python3}
N512=${N512:-200}; N128=${N128:-100}; N_ABL=${N_ABL:-50}; N_CL=${N_CL:-100}; N_SF=${N_SF:-100}
N_COMPILE=${N_COMPILE:-100}; WARMUP=${WARMUP:-20}
LEARN_FRAMES=${LEARN_FRAMES:-20000}; LEARN_TASK=${LEARN_TASK:-cartpole_swingup}; COMPILE=${COMPILE:-1}
FAST_FRAMES=${FAST_FRAMES:-10000}
T_B512=${T_B512:-90}; T_B128=${T_B128:-40}; T_ABL=${T_ABL:-50}; T_CL=${T_CL:-30}; T_SF=${T_SF:-60}
T_SRC=${T_SRC:-30}; T_LEARN=${T_LEARN:-120}; T_FAST=${T_FAST:-60}; T_COMPILE=${T_COMPILE:-60}
LOG="$WORK/gpu_run.log"
MODES=fp32,tf32,amp,bf16,fp16-naive,fp16
DEVICE=${DEVICE:-cuda}; BENCH_ARGS=${BENCH_ARGS:-}; LEARN_ARGS=${LEARN_ARGS:-}

cd "$REPO"
exec > >(tee -a "$LOG") 2>&1
started=$(date +%s)
say() { echo "[gpu_run +$(( $(date +%s) - started ))s] $*"; }

# --- environment: wheels, EGL, paths ---------------------------------------------------------
if compgen -G ".gl/*.deb" > /dev/null; then
  say "unpacking EGL loaders from .gl/"
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig || true
fi
for f in /usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json; do
  [[ -f "$f" ]] && export __EGL_VENDOR_LIBRARY_FILENAMES="$f"
done
if compgen -G ".whl/*.whl" > /dev/null; then
  say "installing $(ls .whl/*.whl | wc -l) wheels from .whl/ into /tmp/site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || say "warning: wheel install failed"
  export PYTHONPATH="/tmp/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
export MUJOCO_GL=egl
export PYTHONUNBUFFERED=1
"$PY" - <<'EOF' || { say "error: the packages pixelsac needs are not importable (build .whl/ with gpu-wheelhouse.sh)"; exit 2; }
import torch, lightning, kornia, omegaconf, dm_control  # noqa: F401
print(f"python ok: torch {torch.__version__}, lightning {lightning.__version__}, "
      f"cuda {torch.cuda.is_available()} {torch.cuda.get_device_name(0) if torch.cuda.is_available() else ''}")
EOF
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader || true

status=()
part() {  # part NAME SECONDS command...
  local name=$1 limit=$2; shift 2
  say "part $name (limit ${limit}s): $*"
  local t0=$(date +%s)
  timeout --signal=TERM --kill-after=10 "$limit" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  local took=$(( $(date +%s) - t0 ))
  if [[ $rc -eq 0 ]]; then status+=("$name: ok in ${took}s")
  elif [[ $rc -eq 124 || $rc -eq 137 ]]; then status+=("$name: TIMED OUT after ${limit}s (partial results kept)")
  else status+=("$name: failed (exit $rc) after ${took}s, see $name.log"); fi
  say "${status[-1]}"
  tail -n 3 "$WORK/$name.log" | sed 's/^/    /'
}

bench() {  # bench NAME SECONDS overrides...
  local name=$1 limit=$2; shift 2
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of key=value words
  part "$name" "$limit" "$PY" -m pixelsac.bench bench.device="$DEVICE" bench.warmup="$WARMUP" \
    bench.out="$WORK/$name" bench.overwrite=true $BENCH_ARGS "$@"
}

# --- 1-4: the benchmark ----------------------------------------------------------------------
bench bench512 "$T_B512" bench.batch_sizes=512 bench.modes=$MODES bench.updates="$N512"
bench bench128 "$T_B128" bench.batch_sizes=128 bench.modes=$MODES bench.updates="$N128"
bench ablations "$T_ABL" bench.batch_sizes=512 bench.modes=fp16 bench.ablations=true bench.updates="$N_ABL"
bench layout "$T_CL" bench.batch_sizes=512 bench.modes=fp32,fp16 bench.channels_last=both bench.updates="$N_CL"
bench syncfree "$T_SF" bench.batch_sizes=512 bench.modes=fp32,fp16 bench.sync_free=both bench.cuda_graphs=both \
  bench.updates="$N_SF"
bench batchsrc "$T_SRC" bench.batch_sizes=512 bench.modes=fp16 bench.batch=all bench.updates="$N_SF"

# --- 5: a short learning comparison, fp16 + six vs fp32, side by side on the one GPU ----------
learn_run() {  # learn_run PRECISION
  "$PY" -m pixelsac.train task="$LEARN_TASK" precision="$1" seed=1 train.env_frames="$LEARN_FRAMES" \
    train.eval_every_frames=5000 train.eval_episodes=5 train.video_every_evals=0 train.num_threads=4 \
    trainer.enable_progress_bar=false run_dir="$WORK/learn_$1" overwrite=true $LEARN_ARGS
}
export -f learn_run
export PY LEARN_TASK LEARN_FRAMES WORK LEARN_ARGS
part learning "$T_LEARN" bash -c 'learn_run fp16 > "$WORK/learn_fp16.log" 2>&1 & p16=$!
                                  learn_run fp32 > "$WORK/learn_fp32.log" 2>&1 & p32=$!
                                  trap "kill $p16 $p32 2>/dev/null" TERM
                                  wait $p16; r16=$?; wait $p32; r32=$?
                                  echo "fp16 exit $r16, fp32 exit $r32"; exit $(( r16 | r32 ))'

# --- 8: end to end with every switch on: CUDA graphs, GPU-resident replay (one run alone) ------
if [[ "$FAST_FRAMES" != 0 ]]; then
  part fast "$T_FAST" "$PY" -m pixelsac.train task="$LEARN_TASK" precision=fp16 seed=1 \
    train.env_frames="$FAST_FRAMES" train.eval_every_frames="$FAST_FRAMES" train.eval_episodes=2 \
    train.video_every_evals=0 train.num_threads=4 perf.cuda_graphs=true replay.device=auto \
    trainer.enable_progress_bar=false run_dir="$WORK/fast_fp16" overwrite=true $LEARN_ARGS
fi

# --- 9: torch.compile (may be slow to compile; last so a timeout costs nothing else) ----------
if [[ "$COMPILE" != 0 ]]; then
  bench compile "$T_COMPILE" bench.batch_sizes=512 bench.modes=fp32,fp16 bench.compile=on bench.updates="$N_COMPILE"
fi

# --- the report ------------------------------------------------------------------------------
say "writing the report"
"$PY" - "$WORK" "$OUT" "${status[@]}" <<'EOF' || say "warning: report step failed"
import csv, json, math, shutil, sys
from pathlib import Path

work, out, statuses = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
lines = ["# pixelsac on a GPU: what half precision buys", "", "Parts:", *(f"- {s}" for s in statuses), ""]
for name in ("bench512", "bench128", "ablations", "layout", "syncfree", "batchsrc", "compile"):
    md = work / name / "bench.md"
    if md.is_file():
        lines += [f"## {name}", "", md.read_text().replace("# pixelsac update-step benchmark", "").strip(), ""]
    png = work / name / "bench.png"
    if png.is_file() and name in ("bench512", "bench128"):
        shutil.copy(png, out / f"{name}.png")

def eval_curve(run: Path) -> list[tuple[int, float]]:
    path = run / "metrics.csv"
    if not path.is_file():
        return []
    rows = list(csv.DictReader(path.open()))
    return [(int(float(r["env_frames"] or r["step"])), float(r["eval/return"]))
            for r in rows if r.get("eval/return") not in (None, "")]

curves = {p: eval_curve(work / f"learn_{p}") for p in ("fp16", "fp32")}
lines += ["## learning: fp16 + six vs fp32", ""]
if any(curves.values()):
    frames = sorted({f for c in curves.values() for f, _ in c})
    lines += ["| env frames | fp16 + six | fp32 |", "|---|---|---|"]
    for f in frames:
        cell = lambda p: next((f"{r:.1f}" for g, r in curves[p] if g == f), "")
        lines.append(f"| {f:,} | {cell('fp16')} | {cell('fp32')} |")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for p, c in curves.items():
            if c:
                ax.plot([f for f, _ in c], [r for _, r in c], marker="o", label=p)
        ax.set_xlabel("env frames"); ax.set_ylabel("eval return"); ax.legend()
        fig.tight_layout(); fig.savefig(out / "learning.png", dpi=110)
    except Exception as exc:  # a chart is a nicety; the table above carries the numbers
        lines.append(f"(learning.png not drawn: {exc})")
else:
    lines.append("no eval returns found (see learn_fp16.log / learn_fp32.log in results.tar.gz)")
for p, run in (("fp16", "learn_fp16"), ("fp32", "learn_fp32"), ("fp16, CUDA graphs + GPU replay, alone", "fast_fp16")):
    summary = work / run / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        fmt = lambda x, f: "n/a" if x is None else format(x, f)
        lines.append(f"- {p}: {fmt(s.get('ms_per_update'), '.2f')} ms/update, "
                     f"{fmt(s.get('env_frames_per_s'), '.0f')} env frames/s, speed-up vs fp32 "
                     f"{fmt(s.get('speedup_vs_fp32'), '.2f')}, state vs fp32 {fmt(s.get('memory_vs_fp32'), '.2f')}, "
                     f"skipped {s.get('skipped')}, best eval return {fmt(s.get('best_eval_return'), '.1f')}")
(out / "report.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
cp "$LOG" "$OUT/gpu_run.log" 2>/dev/null || true
# checkpoints and replay snapshots are large and say nothing about speed: leave them out
tar -czf "$OUT/results.tar.gz" -C "$WORK" --exclude='*.ckpt' --exclude='*.npz' --exclude='*replay*' . \
  || say "warning: could not pack results"
say "done: $OUT ($(ls "$OUT" | tr '\n' ' '))"
