#!/usr/bin/env bash
# fp32, fp16 and bf16 learning side by side on one GPU: the full DrQ agent on cartpole_swingup from
# pixels, one seed, to 100k env frames or as far as the time allows. Without network.
#
#   tools/gpu/gpu_learn.sh OUT_DIR        # or: OUT=OUT_DIR tools/gpu/gpu_learn.sh
#
# How long: at most TOTAL seconds (585 by default: 9 min 45 s, inside a 10-minute slot; `--plan`
# prints the sum). Every step has a limit and the training gets what the others leave: the set-up
# (EGL loaders T_GL, wheels T_WHEELS, an import check T_CHECK that takes ~20 s on a cold machine,
# each with its kill-after GRACE), then training until TOTAL - STOP_S - FINAL_S seconds after the
# start (the archives on the way are cut to the time left), at most STOP_S (25 s) for the runs
# to stop gracefully and save, then FINAL_S (15 s) for the last archive. With the defaults the
# runs train for at least 585 - 89 - 25 - 15 = 456 s, about 8 minutes after a fast set-up.
#
# The three runs share the GPU (perf.shared_device=true: no speed-up figures, which would mean
# nothing with three processes on one device), replay on the GPU (replay.device=auto) and CUDA
# graphs (perf.cuda_graphs=true). They are the same configuration but for `precision`.
#
# As it goes, every PERIOD seconds (30), OUT_DIR/learn.tar.gz is rewritten with each run's
# metrics.csv, config.yaml, the tail of its log and (at the end) summary.json, plus curves.png /
# curves.svg from tools/plot.py and returns.md (every evaluation of every run, and the loss
# scales, skipped steps and headroom columns of fp16 at its latest log row). A script cut at any
# moment keeps what was measured until the last rewrite. Checkpoints and replay stay in $WORK.
#
# Missing packages come from wheels in .whl/ (`python tools/gpu/gpu_wheels.py --python-version 3.12`
# on a machine with network) installed into /tmp/site; .gl/*.deb (EGL loaders) are unpacked
# first when present.
#
# Knobs (environment): TOTAL=585 PERIOD=30 STOP_S=25 FINAL_S=15 T_GL=10 T_WHEELS=30 T_CHECK=45
#   GRACE=2 FRAMES=100000 TASK=cartpole_swingup SEED=1 MODES="fp32 fp16 bf16" PYTHON=python3
#   DEVICE=cuda LEARN_ARGS (extra key=value overrides for every run). A CPU smoke run (the tests
#   do this): DEVICE=cpu TOTAL=120 PERIOD=10 LEARN_ARGS='preset=tiny' tools/gpu/gpu_learn.sh /tmp/smoke
set -uo pipefail

TOTAL=${TOTAL:-585}; PERIOD=${PERIOD:-30}; STOP_S=${STOP_S:-25}; FINAL_S=${FINAL_S:-15}; GRACE=${GRACE:-2}
T_GL=${T_GL:-10}; T_WHEELS=${T_WHEELS:-30}; T_CHECK=${T_CHECK:-45}
FRAMES=${FRAMES:-100000}; TASK=${TASK:-cartpole_swingup}; SEED=${SEED:-1}
MODES=${MODES:-fp32 fp16 bf16}; PY=${PYTHON:-python3}; DEVICE=${DEVICE:-cuda}; LEARN_ARGS=${LEARN_ARGS:-}
SETUP_S=$(( T_GL + T_WHEELS + GRACE + T_CHECK + GRACE ))
TRAIN_END=$(( TOTAL - STOP_S - FINAL_S ))  # seconds after the start at which the runs are told to stop

if [[ "${1:-}" == "--plan" ]]; then  # the worst case, step by step; exit 1 when it does not fit
  echo "Time budget (seconds; every step under a limit, each kill-after grace $GRACE s counted):"
  echo "- set-up: EGL loaders $T_GL, wheels $T_WHEELS + $GRACE, import check $T_CHECK + $GRACE = $SETUP_S"
  echo "- training: until $TRAIN_END s after the start, archives cut to the time left:" \
    "at least $(( TRAIN_END - SETUP_S )) s of it"
  echo "- stop: $STOP_S"
  echo "- final archive: $FINAL_S"
  if (( TRAIN_END - SETUP_S > 0 )); then
    echo "worst case $(( TRAIN_END + STOP_S + FINAL_S )) s of TOTAL=$TOTAL s"
  else
    echo "worst case: the set-up alone ($SETUP_S s) leaves no time to train within TOTAL=$TOTAL s"
    exit 1
  fi
  exit 0
fi

OUT=${1:-${OUT:-}}
if [[ -z "$OUT" ]]; then
  echo "usage: tools/gpu/gpu_learn.sh OUT_DIR   (or set OUT)" >&2
  exit 2
fi
started=$SECONDS
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=${WORK:-$(mktemp -d /tmp/pixelsac_gpu_learn.XXXXXX)}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
LOG="$WORK/gpu_learn.log"
cd "$REPO"
exec > >(tee -a "$LOG") 2>&1
say() { echo "[gpu_learn +$(( SECONDS - started ))s] $*"; }

# --- set-up ------------------------------------------------------------------------------------
if compgen -G ".gl/*.deb" > /dev/null; then
  timeout -k 1 "$(( T_GL - 1 ))" bash -c 'for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig' \
    || say "warning: unpacking .gl/ failed"
fi
for f in /usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json; do
  [[ -f "$f" ]] && export __EGL_VENDOR_LIBRARY_FILENAMES="$f"
done
if compgen -G ".whl/*.whl" > /dev/null; then
  timeout -k "$GRACE" "$T_WHEELS" "$PY" tools/gpu/gpu_wheels.py --install .whl --target /tmp/site \
    || say "warning: installing the wheels failed"
  export PYTHONPATH="/tmp/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
export MUJOCO_GL=egl PYTHONUNBUFFERED=1
if ! timeout -k "$GRACE" "$T_CHECK" "$PY" -c "import torch, lightning, kornia, dm_control, matplotlib; print('torch', torch.__version__)"; then
  say "error: the packages pixelsac needs are not importable here (build .whl/ with tools/gpu/gpu_wheels.py)"
  cp "$LOG" "$OUT/gpu_learn.log"
  exit 2
fi

# --- the runs ----------------------------------------------------------------------------------
common=(task="$TASK" seed="$SEED" train.env_frames="$FRAMES" train.eval_every_frames=10000 train.eval_episodes=10
  train.video_every_evals=0 trainer.enable_progress_bar=false stop.max_wait_steps=0 stop.max_wait_seconds=5
  checkpoint.save_replay=false overwrite=true)
if [[ "$DEVICE" == cuda ]]; then
  common+=(perf.shared_device=true perf.cuda_graphs=true replay.device=auto trainer.accelerator=gpu)
else
  common+=(trainer.accelerator=cpu perf.calibrate_updates=0)
fi
# LEARN_ARGS (key=value words) replace the keys above that they name: a key given twice is refused
for arg in $LEARN_ARGS; do
  kept=()
  for item in "${common[@]}"; do [[ "${item%%=*}" == "${arg%%=*}" ]] || kept+=("$item"); done
  common=("${kept[@]}" "$arg")
done
declare -A pids
for mode in $MODES; do
  "$PY" -m pixelsac.train "${common[@]}" precision="$mode" run_dir="$WORK/$mode" > "$WORK/$mode.log" 2>&1 &
  pids[$mode]=$!
  say "started $mode (pid ${pids[$mode]})"
done

archive() {  # archive LIMIT RUN_DIRS...: learn.tar.gz, curves and returns.md in OUT, from what the
  # runs have written so far, in at most LIMIT + 3 s: returns.md, the chart and the tarball each get
  # a share of LIMIT (at least 1 s) and 1 s of kill-after grace
  local limit=$1 files=() mode
  local l_returns=$(( limit / 4 > 1 ? limit / 4 : 1 )) l_plot=$(( limit / 2 > 1 ? limit / 2 : 1 ))
  local l_tar=$(( limit - l_returns - l_plot > 1 ? limit - l_returns - l_plot : 1 ))
  timeout -k 1 "$l_returns" "$PY" - "$WORK" $MODES > "$WORK/returns.md" <<'EOF' || true
import csv, sys
from pathlib import Path
work, modes = Path(sys.argv[1]), sys.argv[2:]
print("| mode | env frames: eval return |")
print("|---|---|")
latest = {}
for mode in modes:
    path = work / mode / "metrics.csv"
    rows = list(csv.DictReader(path.open())) if path.exists() else []
    evals = [f"{int(float(r['env_frames'])):,}: {float(r['eval/return']):.1f}" for r in rows if r.get("eval/return")]
    print(f"| {mode} | {', '.join(evals) or 'none yet'} |")
    logged = [r for r in rows if r.get("train/critic_loss")]
    if logged:
        latest[mode] = logged[-1]
print()
for mode, row in latest.items():
    keys = ["env_frames", "updates", "train/q", "train/critic_loss"] + sorted(k for k in row if k.startswith("lowp/"))
    print(f"- {mode} at its latest log row: " + ", ".join(f"{k} {row[k]}" for k in keys if row.get(k)))
EOF
  for mode in $MODES; do
    tail -n 40 "$WORK/$mode.log" > "$WORK/$mode.tail.log" 2>/dev/null || true
    [[ -f "$WORK/$mode/metrics.csv" ]] && files+=("$mode/metrics.csv" "$mode/config.yaml")
    [[ -f "$WORK/$mode/summary.json" ]] && files+=("$mode/summary.json")
    [[ -f "$WORK/$mode/failure.json" ]] && files+=("$mode/failure.json")
    files+=("$mode.tail.log")
  done
  if compgen -G "$WORK/*/metrics.csv" > /dev/null; then
    timeout -k 1 "$l_plot" "$PY" tools/plot.py "${@:2}" --out "$WORK/curves.png" > /dev/null 2>&1 \
      && files+=(curves.png curves.svg)
  fi
  cp "$LOG" "$WORK/gpu_learn.log.copy" 2>/dev/null && files+=(gpu_learn.log.copy)
  files+=(returns.md)
  (cd "$WORK" && timeout -k 1 "$l_tar" tar -czf "$OUT/learn.tar.gz.tmp" --ignore-failed-read "${files[@]}" 2>/dev/null) \
    && mv "$OUT/learn.tar.gz.tmp" "$OUT/learn.tar.gz"
  cp "$WORK/returns.md" "$OUT/returns.md" 2>/dev/null || true
}

run_dirs=()
for mode in $MODES; do run_dirs+=("$WORK/$mode"); done
train_end=$(( started + TRAIN_END ))  # the stop and the final archive fit after it, within TOTAL
say "training until +${TRAIN_END}s ($(( train_end - SECONDS )) s from now)"
while (( SECONDS < train_end )); do
  alive=0
  for mode in $MODES; do kill -0 "${pids[$mode]}" 2> /dev/null && alive=1; done
  (( alive )) || break
  left=$(( train_end - SECONDS ))
  sleep $(( PERIOD < left ? PERIOD : left ))
  left=$(( train_end - SECONDS ))
  (( left >= 7 )) || break  # too little left for an archive: the final one follows the stop
  archive $(( left - 3 < 20 ? left - 3 : 20 )) "${run_dirs[@]}"
  say "archived: $(tr '\n' ' ' < "$WORK/returns.md" | cut -c1-300)"
done

# --- stop: SIGTERM asks each run to save and exit 75; after STOP_S, SIGKILL -------------------------
for mode in $MODES; do kill -TERM "${pids[$mode]}" 2> /dev/null || true; done
stop_deadline=$(( SECONDS + STOP_S ))
for mode in $MODES; do
  while kill -0 "${pids[$mode]}" 2> /dev/null && (( SECONDS < stop_deadline )); do sleep 1; done
  kill -KILL "${pids[$mode]}" 2> /dev/null || true
  wait "${pids[$mode]}"
  say "$mode exit $? ($(grep -E '^(error|stopped|done|training)' "$WORK/$mode.log" | tail -n 1 | cut -c1-200))"
done
archive $(( FINAL_S > 8 ? FINAL_S - 4 : 4 )) "${run_dirs[@]}"  # + 3 s of graces, + 1 s for the kills above
cat "$WORK/returns.md"
say "done: $OUT/learn.tar.gz, $OUT/returns.md (runs kept in $WORK)"
