#!/usr/bin/env bash
# fp32, fp16 and bf16 learning side by side on one GPU: the full DrQ agent on cartpole_swingup from
# pixels, one seed, to 100k env frames or as far as the time allows. Without network.
#
#   tools/gpu_learn.sh OUT_DIR        # or: OUT=OUT_DIR tools/gpu_learn.sh
#
# How long: DURATION seconds of training (480 by default: 8 minutes), plus the set-up (at most
# T_SETUP = 60 s: EGL loaders, wheels, and an import check that takes ~20 s on a cold machine),
# plus at most STOP_S (25 s) for the runs to stop gracefully and save, plus FINAL_S (15 s) for the
# last archive: at most 580 s with the defaults, inside a 10-minute slot.
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
# Missing packages come from wheels in .whl/ (`python tools/gpu_wheels.py --python-version 3.12`
# on a machine with network) installed into /tmp/site; .gl/*.deb (EGL loaders) are unpacked
# first when present.
#
# Knobs (environment): DURATION=480 PERIOD=30 STOP_S=25 FINAL_S=15 T_SETUP=60 FRAMES=100000
#   TASK=cartpole_swingup SEED=1 MODES="fp32 fp16 bf16" PYTHON=python3 DEVICE=cuda
#   LEARN_ARGS (extra key=value overrides for every run). A CPU smoke run (the tests do this):
#   DEVICE=cpu DURATION=40 PERIOD=10 LEARN_ARGS='preset=tiny' tools/gpu_learn.sh /tmp/smoke
set -uo pipefail

DURATION=${DURATION:-480}; PERIOD=${PERIOD:-30}; STOP_S=${STOP_S:-25}; FINAL_S=${FINAL_S:-15}
T_SETUP=${T_SETUP:-60}; FRAMES=${FRAMES:-100000}; TASK=${TASK:-cartpole_swingup}; SEED=${SEED:-1}
MODES=${MODES:-fp32 fp16 bf16}; PY=${PYTHON:-python3}; DEVICE=${DEVICE:-cuda}; LEARN_ARGS=${LEARN_ARGS:-}

OUT=${1:-${OUT:-}}
if [[ -z "$OUT" ]]; then
  echo "usage: tools/gpu_learn.sh OUT_DIR   (or set OUT)" >&2
  exit 2
fi
started=$SECONDS
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
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
setup_deadline=$(( SECONDS + T_SETUP ))
if compgen -G ".gl/*.deb" > /dev/null; then
  timeout -k 1 10 bash -c 'for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig' || say "warning: unpacking .gl/ failed"
fi
for f in /usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json; do
  [[ -f "$f" ]] && export __EGL_VENDOR_LIBRARY_FILENAMES="$f"
done
if compgen -G ".whl/*.whl" > /dev/null; then
  timeout -k 2 $(( setup_deadline - SECONDS > 5 ? setup_deadline - SECONDS : 5 )) \
    "$PY" tools/gpu_wheels.py --install .whl --target /tmp/site || say "warning: installing the wheels failed"
  export PYTHONPATH="/tmp/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
export MUJOCO_GL=egl PYTHONUNBUFFERED=1
if ! timeout -k 2 $(( setup_deadline - SECONDS > 30 ? setup_deadline - SECONDS : 30 )) \
    "$PY" -c "import torch, lightning, kornia, dm_control, matplotlib; print('torch', torch.__version__)"; then
  say "error: the packages pixelsac needs are not importable here (build .whl/ with tools/gpu_wheels.py)"
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

archive() {  # learn.tar.gz, curves and returns.md in OUT, from what the runs have written so far
  local limit=$1 files=() mode
  timeout -k 1 "$limit" "$PY" - "$WORK" $MODES > "$WORK/returns.md" <<'EOF' || true
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
    timeout -k 1 "$limit" "$PY" tools/plot.py "${@:2}" --out "$WORK/curves.png" > /dev/null 2>&1 \
      && files+=(curves.png curves.svg)
  fi
  cp "$LOG" "$WORK/gpu_learn.log.copy" 2>/dev/null && files+=(gpu_learn.log.copy)
  files+=(returns.md)
  (cd "$WORK" && tar -czf "$OUT/learn.tar.gz.tmp" --ignore-failed-read "${files[@]}" 2>/dev/null) \
    && mv "$OUT/learn.tar.gz.tmp" "$OUT/learn.tar.gz"
  cp "$WORK/returns.md" "$OUT/returns.md" 2>/dev/null || true
}

run_dirs=()
for mode in $MODES; do run_dirs+=("$WORK/$mode"); done
deadline=$(( SECONDS + DURATION ))
while (( SECONDS < deadline )); do
  alive=0
  for mode in $MODES; do kill -0 "${pids[$mode]}" 2> /dev/null && alive=1; done
  (( alive )) || break
  sleep $(( PERIOD < deadline - SECONDS ? PERIOD : (deadline - SECONDS > 0 ? deadline - SECONDS : 1) ))
  archive 20 "${run_dirs[@]}"
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
archive "$FINAL_S" "${run_dirs[@]}"
cat "$WORK/returns.md"
say "done: $OUT/learn.tar.gz, $OUT/returns.md (runs kept in $WORK)"
