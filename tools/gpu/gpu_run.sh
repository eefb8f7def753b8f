#!/usr/bin/env bash
# What half precision buys on a GPU, measured in a few minutes of one, without network.
#
#   tools/gpu/gpu_run.sh OUT_DIR          # or: OUT=OUT_DIR tools/gpu/gpu_run.sh
#   tools/gpu/gpu_run.sh --plan           # the time budget of the parts below; exit 1 if it does not fit
#   GOALS=1 tools/gpu/gpu_run.sh OUT_DIR  # only what the speed goals need (below)
#
# How long: at most TOTAL seconds, 585 by default (9 min 45 s: it fits a 10-minute slot), the
# worst case of every step running to its limit (`--plan` adds it up). Typically about 5 minutes:
# on the first H200 run (2026-12-04, main 51051ef) the parts that finished took 21-35 s each.
# It ends by printing a brief of at most 15 lines (every goal figure, the GPU, torch, what was
# cut), so a call whose files cannot be fetched still reports; OUT_DIR/brief.txt holds it too.
#
# Run from anywhere; it works in the repository that holds this script. Missing packages come
# from wheels in .whl/, built beforehand on a machine with network by
# `python tools/gpu/gpu_wheels.py --python-version 3.12` (the GPU machine's Python) and installed
# here into /tmp/site (those the machine lacks or has in another version). If .gl/*.deb
# exist (EGL loaders) they are unpacked first.
#
# Set-up: EGL loaders (T_GL), wheels (T_WHEELS), then one import check (T_CHECK: torch,
# lightning, kornia, omegaconf, dm_control, the device, and on CUDA one trivial kernel compiled
# by torch.compile through Triton, which needs a C compiler and Python's headers: where that
# fails or runs out of time, the compiled cells and the compiled optimizer are dropped and the
# report says so), nvidia-smi (T_SMI).
#
# Parts, in this order, each under `timeout -k GRACE LIMIT` (one that fails or runs out of time
# is reported and the next one runs). A part marked "spare" runs only if the time left allows it
# after the others (it is not in the worst case: the budget skips it):
#   graphs     the CUDA-graph gate alone, pytest's JUnit XML in graphs.xml: replayed graphs equal
#              eager updates in every mode that is timed (fp16-splitk: split-K), then the compiled
#              optimizer's mode (fp16-compiled) in graphs_compiled.xml, so that its cold compile
#              cannot cost the others their verdict. Graphs are timed below only where this
#              showed it                                                              (T_GRAPHS)
#   bench512   python -m pixelsac.bench at batch 512: fp32 fp16 tf32 amp bf16 fp16-naive (T_B512)
#   bench128   the same modes at batch 128                                               (T_B128)
#   syncfree   fp32 and fp16 with perf.sync_free off / on (+ CUDA graphs), batch 512     (T_SF)
#   ablations  fp16 minus each of the six switches, batch 512                            (T_ABL)
#   layout     fp32 and fp16 with channels_last off/on, batch 512                        (T_CL)
#   fast       one fp16 training run alone: CUDA graphs (if checked), GPU-resident replay,
#              the environment stepping in a worker during the updates
#              (train.overlap_collection), 10% seed steps: end-to-end env frames/s        (T_FAST)
#   compile    fp32 and fp16 with torch.compile, batch 512 (off unless COMPILE=1)    (T_COMPILE)
#   optstep    fp16 and bf16, hAdam eager vs compiled (perf.compile_optimizer), batches 512
#              and 128, as CUDA graphs (off unless OPTSTEP=1; drop a part to fit it)  (T_OPTSTEP)
#   batchsrc   spare: fp16 with the batch in pageable / pinned host memory / on the GPU (T_SRC)
#   gpu_tests  spare: every other `pytest -m gpu` test, the compile-heavy ones included (triton
#              compiles their kernels first), JUnit XML in gpu_tests.xml               (T_TESTS)
# With GOALS=1 the parts are graphs, then
#   goals512   GOAL_MODES (IEEE fp32, fp16, TF32, bf16, fp16-compiled: the compiled one last, so
#              a cold compile that overruns cuts only itself) at batch 512 as CUDA graphs (eager
#              where the gate did not pass), the batch already on the GPU as a GPU-resident
#              replay hands it over: the update-time goals (<= 6 ms, >= 2.5x fp32)   (T_GOAL512)
#   goals128   the same at batch 128 (<= 3 ms, >= 2x fp32), a part of its own so that a slow
#              batch 512 cannot cut it                                                (T_GOAL128)
#   fast       as above, with the compiled optimizer and GOALS_ENVS parallel environments: the
#              end-to-end goal (>= 800 env frames/s)                                     (T_FAST)
#   goals_eager spare: GOAL_MODES at both batches without CUDA graphs                (T_GOAL_EAGER)
#   gpu_tests  spare, as above
# and report.md and the brief open with each goal, the measured figure and whether it is met.
# fp32 and fp16 come first in every part, so a part cut short still has the headline rows.
# Learning curves are not part of it: a few minutes give a few hundred updates, which show nothing.
#
# Limits: every process this script starts pays START_S (30 s: measured on a cold GPU machine,
# ~10 s to start a process and ~20 s to import torch, lightning, kornia and dm_control; 15-s
# limits cut three parts of the first H200 run before their first row) plus its own work, which
# each part's default adds to START_S. A part ended by its limit is reported as "timed out" (exit
# 124, or 137 when it had to be killed after GRACE), apart from a crash (any other exit) and
# from a kill by someone else (a signal before the limit).
#
# Time: the set-up, every part, every report step (report.md and the archive: REPORT_S) and the
# gate's verdict (GATE_S) run under a limit, and a part starts only if the time elapsed plus its
# limit, its kill-after GRACE, one report step and the final step (FINAL_S: the last report and
# the brief) stay within TOTAL, otherwise it is skipped and the report says so. So the script
# ends within TOTAL seconds (plus bash's own milliseconds), and with the defaults every part that
# is not spare fits: see --plan.
#
# OUT_DIR receives few files: report.md (rewritten after every part, so a run cut at any moment
# keeps every finished part), brief.txt, results.tar.gz (tables, logs and charts of the whole
# tree, at most ARCHIVE_MB, no checkpoints or *.tmp; rewritten after every part too), a chart
# per benchmark part and gpu_run.log. The tree is built in $WORK (default: a fresh folder
# under /tmp).
#
# Knobs (environment): TOTAL=585 GRACE=3 REPORT_S=4 GATE_S=3 FINAL_S=10 ARCHIVE_MB=20 START_S=30
#   T_GL=10 T_WHEELS=30 T_CHECK=START_S+15 T_SMI=5, and START_S plus: T_GRAPHS +60 T_TESTS +90
#   T_B512 +25 T_B128 +15 T_SF +25 T_ABL +25 T_CL +15 T_SRC +15 T_FAST +20 T_COMPILE +60
#   T_OPTSTEP +90; COMPILE=0 OPTSTEP=0 GOALS=0 (GOALS=1: T_GOAL512 +90, T_GOAL128 +60,
#   T_GOAL_EAGER +60, T_FAST_GOALS +110 for T_FAST, GOALS_ENVS=8)
#   N512=60 N128=60 N_ABL=20 N_CL=40 N_SF=40 N_COMPILE=40 N_OPTSTEP=40 N_GOALS=60 WARMUP=10
#   FAST_FRAMES=6000 (0 skips it) FAST_TASK=cartpole_swingup
#   PYTHON=python3 DEVICE=cuda, BENCH_ARGS and FAST_ARGS (extra key=value overrides),
#   GPU_TESTS=1 (0 skips parts graphs and gpu_tests). A CPU smoke run (the tests do this):
#   DEVICE=cpu GPU_TESTS=0 BENCH_ARGS='env.image_size=24 agent.num_filters=4 bench.isolate=false' \
#     FAST_ARGS='preset=tiny' N512=1 N128=1 N_ABL=1 N_CL=1 N_SF=1 WARMUP=0 FAST_FRAMES=0 \
#     tools/gpu/gpu_run.sh /tmp/smoke
set -uo pipefail

TOTAL=${TOTAL:-585}; GRACE=${GRACE:-3}; REPORT_S=${REPORT_S:-4}; GATE_S=${GATE_S:-3}; FINAL_S=${FINAL_S:-10}
ARCHIVE_MB=${ARCHIVE_MB:-20}
START_S=${START_S:-30}  # one process's start and imports on a cold machine (~10 s + ~20 s, measured)
# the import check also compiles one trivial kernel with triton on CUDA (a few seconds cold)
T_WHEELS=${T_WHEELS:-30}; T_CHECK=${T_CHECK:-$(( START_S + 15 ))}; T_GL=${T_GL:-10}; T_SMI=${T_SMI:-5}
T_GRAPHS=${T_GRAPHS:-$(( START_S + 60 ))}; T_TESTS=${T_TESTS:-$(( START_S + 90 ))}  # the gate: two pytest runs
T_B512=${T_B512:-$(( START_S + 25 ))}; T_B128=${T_B128:-$(( START_S + 15 ))}
T_SF=${T_SF:-$(( START_S + 25 ))}; T_ABL=${T_ABL:-$(( START_S + 25 ))}; T_CL=${T_CL:-$(( START_S + 15 ))}
T_SRC=${T_SRC:-$(( START_S + 15 ))}; T_FAST=${T_FAST:-$(( START_S + 20 ))}; T_COMPILE=${T_COMPILE:-$(( START_S + 60 ))}
T_OPTSTEP=${T_OPTSTEP:-$(( START_S + 90 ))}  # triton compiles each form of the step once (not measured)
COMPILE=${COMPILE:-0}; OPTSTEP=${OPTSTEP:-0}; GPU_TESTS=${GPU_TESTS:-1}; GOALS=${GOALS:-0}
# the goals' compiled cells and run compile hAdam's step, the scalers' bookkeeping and the target
# update with triton first (not measured: tens of seconds on a cold machine, allowed for at batch
# 512; batch 128 finds inductor's on-disk cache warm)
T_GOAL512=${T_GOAL512:-$(( START_S + 90 ))}; T_GOAL128=${T_GOAL128:-$(( START_S + 60 ))}
T_GOAL_EAGER=${T_GOAL_EAGER:-$(( START_S + 60 ))}; N_GOALS=${N_GOALS:-60}; GOALS_ENVS=${GOALS_ENVS:-8}
if [[ "$GOALS" != 0 ]]; then T_FAST=${T_FAST_GOALS:-$(( START_S + 110 ))}; fi
N512=${N512:-60}; N128=${N128:-60}; N_ABL=${N_ABL:-20}; N_CL=${N_CL:-40}; N_SF=${N_SF:-40}
N_COMPILE=${N_COMPILE:-40}; N_OPTSTEP=${N_OPTSTEP:-40}; WARMUP=${WARMUP:-10}
FAST_FRAMES=${FAST_FRAMES:-6000}; FAST_TASK=${FAST_TASK:-cartpole_swingup}
PY=${PYTHON:-python3}; DEVICE=${DEVICE:-cuda}; BENCH_ARGS=${BENCH_ARGS:-}; FAST_ARGS=${FAST_ARGS:-}
MODES=fp32,fp16,tf32,amp,bf16,fp16-naive
GOAL_MODES=fp32,fp16,tf32,bf16,fp16-compiled  # tools/gpu/gpu_report.py's GOAL_MODES, the compiled one last
GRAPH_TEST=tests/test_graphs.py::test_real_cuda_graphs_equal_eager_updates_on_a_gpu

# name:limit[:spare] of every part that this configuration runs, in order
PARTS=()
[[ "$GPU_TESTS" != 0 ]] && PARTS+=("graphs:$T_GRAPHS")
if [[ "$GOALS" != 0 ]]; then
  PARTS+=("goals512:$T_GOAL512" "goals128:$T_GOAL128")
  [[ "$FAST_FRAMES" != 0 ]] && PARTS+=("fast:$T_FAST")
  PARTS+=("goals_eager:$T_GOAL_EAGER:spare")
else
  PARTS+=("bench512:$T_B512" "bench128:$T_B128" "syncfree:$T_SF" "ablations:$T_ABL" "layout:$T_CL")
  [[ "$FAST_FRAMES" != 0 ]] && PARTS+=("fast:$T_FAST")
  [[ "$COMPILE" != 0 ]] && PARTS+=("compile:$T_COMPILE")
  [[ "$OPTSTEP" != 0 ]] && PARTS+=("optstep:$T_OPTSTEP")
  PARTS+=("batchsrc:$T_SRC:spare")
fi
[[ "$GPU_TESTS" != 0 ]] && PARTS+=("gpu_tests:$T_TESTS:spare")

plan() {  # the worst case, step by step; exit status 1 when it does not fit TOTAL
  local setup=$(( T_GL + T_WHEELS + GRACE + T_CHECK + GRACE + T_SMI + REPORT_S )) sum=0 entry name limit rest extra
  echo "Time budget (seconds; every step under a limit, each kill-after grace $GRACE s counted):"
  echo "- set-up: EGL loaders $T_GL, wheels $T_WHEELS + $GRACE, import check $T_CHECK + $GRACE, nvidia-smi $T_SMI," \
    "first report $REPORT_S = $setup"
  for entry in "${PARTS[@]}"; do
    name=${entry%%:*}; rest=${entry#*:}; limit=${rest%%:*}
    if [[ "$rest" == *:spare ]]; then
      echo "- spare, only if the time left allows: $name $limit + $GRACE + report $REPORT_S"
      continue
    fi
    extra=0; [[ "$name" == graphs ]] && extra=$GATE_S
    echo "- $name: $limit + $GRACE + report $REPORT_S$( (( extra )) && echo " + verdict $GATE_S") =" \
      "$(( limit + GRACE + REPORT_S + extra ))"
    sum=$(( sum + limit + GRACE + REPORT_S + extra ))
  done
  echo "- final report, brief and archive: $FINAL_S"
  local worst=$(( setup + sum + FINAL_S ))
  if (( worst <= TOTAL )); then
    echo "worst case $worst s of TOTAL=$TOTAL s: every part that is not spare fits"
  else
    echo "worst case $worst s of TOTAL=$TOTAL s: does not fit; the last parts are skipped when time runs out"
    return 1
  fi
}

part_state() {  # part_state RC SECONDS LIMIT: how a part under `timeout -k GRACE LIMIT` ended
  local rc=$1 seconds=$2 limit=$3
  if (( rc == 0 )); then echo ok
  elif (( rc == 124 )); then echo "timed out"  # timeout's own exit: the limit was reached
  elif (( rc == 137 && seconds >= limit )); then echo "timed out"  # killed GRACE s after the limit
  elif (( rc > 128 )); then echo "killed (signal $(( rc - 128 )))"  # by someone else, before the limit
  else echo crashed; fi
}

if [[ "${1:-}" == "--plan" ]]; then
  plan
  exit $?
fi
if [[ "${1:-}" == "--state" ]]; then  # --state RC SECONDS LIMIT: the label a part gets (for the tests)
  part_state "$2" "$3" "$4"
  exit 0
fi

OUT=${1:-${OUT:-}}
if [[ -z "$OUT" ]]; then
  echo "usage: tools/gpu/gpu_run.sh OUT_DIR   (or set OUT; --plan prints the time budget)" >&2
  exit 2
fi
started=$SECONDS
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=${WORK:-$(mktemp -d /tmp/pixelsac_gpu_run.XXXXXX)}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
LOG="$WORK/gpu_run.log"
: > "$WORK/status.tsv"

cd "$REPO"
exec > >(tee -a "$LOG") 2>&1
elapsed() { echo $(( SECONDS - started )); }
say() { echo "[gpu_run +$(elapsed)s] $*"; }

write_report() {  # report.md and results.tar.gz in OUT, now (bounded: REPORT_S)
  timeout -k 1 "$(( REPORT_S > 1 ? REPORT_S - 1 : 1 ))" "$PY" tools/gpu/gpu_report.py report "$WORK" "$OUT" \
    --archive-mb "$ARCHIVE_MB" || say "warning: the report step failed or ran out of time"
  cp "$LOG" "$OUT/gpu_run.log" 2>/dev/null || true
}

finish() {  # the final report and the brief within FINAL_S; the brief is the last thing printed
  say "writing the final report"
  timeout -k 1 "$(( FINAL_S > 6 ? FINAL_S - 5 : 1 ))" "$PY" tools/gpu/gpu_report.py report "$WORK" "$OUT" \
    --archive-mb "$ARCHIVE_MB" --final || say "warning: the final report failed or ran out of time"
  say "done in $(elapsed) s: $OUT ($(ls "$OUT" | tr '\n' ' '))"
  cp "$LOG" "$OUT/gpu_run.log" 2>/dev/null || true
  timeout -k 1 2 "$PY" tools/gpu/gpu_report.py brief "$WORK" --out "$OUT" \
    || echo "brief: not written in time (see $OUT/report.md)"
}

plan > "$WORK/plan.txt"
cat "$WORK/plan.txt"

# --- set-up: EGL loaders, wheels, paths, the import check -----------------------------------------
if compgen -G ".gl/*.deb" > /dev/null; then
  say "unpacking EGL loaders from .gl/"
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
# device.txt gets its line before triton is tried, so a hanging compile still leaves the packages
# shown importable; triton.txt says whether one kernel compiled (none: it ran out of time)
rm -f "$WORK/triton.txt"
timeout -k "$GRACE" "$T_CHECK" "$PY" tools/gpu/gpu_check.py "$DEVICE" "$WORK/triton.txt" > "$WORK/device.txt"
rc=$?
cat "$WORK/device.txt"
if ! grep -q "^- python" "$WORK/device.txt"; then
  why=$([[ $rc == 124 || $rc == 137 ]] && echo "timed out" || echo "failed")
  printf 'set-up\t%s\t%s\t\t%s\timporting torch, lightning, kornia, omegaconf, dm_control: see gpu_run.log\n' \
    "$why" "$rc" "$T_CHECK" >> "$WORK/status.tsv"
  say "error: the packages pixelsac needs are not importable here (build .whl/ with tools/gpu/gpu_wheels.py)"
  finish
  exit 2
fi
[[ -s "$WORK/triton.txt" ]] || echo "failed: the import check ran out of time compiling one kernel" > "$WORK/triton.txt"
TRITON=$(head -n 1 "$WORK/triton.txt")
say "triton: $TRITON"
COMPILED=1
if [[ "$TRITON" != ok* ]]; then
  COMPILED=0
  GOAL_MODES=${GOAL_MODES/,fp16-compiled/}
  say "compiled cells and the compiled optimizer dropped: triton cannot compile here"
fi
timeout -k 1 "$(( T_SMI - 1 ))" nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm \
  --format=csv,noheader >> "$WORK/device.txt" 2>/dev/null || true
write_report

# --- parts ----------------------------------------------------------------------------------------
limit_of() {
  local entry rest
  for entry in "${PARTS[@]}"; do
    rest=${entry#*:}
    [[ ${entry%%:*} == "$1" ]] && echo "${rest%%:*}"
  done
}

part() {  # part NAME command...: runs it if it fits the budget, records how it ended, rewrites the report
  local name=$1 limit; shift
  limit=$(limit_of "$name")
  local need=$(( limit + GRACE + REPORT_S + FINAL_S ))
  if (( $(elapsed) + need > TOTAL )); then
    printf '%s\tskipped\t\t\t%s\tnot started: %s s elapsed + %s s needed > TOTAL %s s\n' \
      "$name" "$limit" "$(elapsed)" "$need" "$TOTAL" >> "$WORK/status.tsv"
    say "part $name skipped: $(elapsed) s elapsed + $need s needed > TOTAL $TOTAL s"
    return 0
  fi
  say "part $name (limit ${limit}s): $*"
  local t0=$SECONDS state
  # timeout runs the part in a process group of its own: its id is kept in part.pgid, so whoever
  # ends this script early can end the part too (kill -- -$(cat WORK/part.pgid))
  timeout -k "$GRACE" "$limit" "$@" > "$WORK/$name.log" 2>&1 &
  local pgid=$!
  echo "$pgid" > "$WORK/part.pgid"
  wait "$pgid"
  local rc=$?
  rm -f "$WORK/part.pgid"
  state=$(part_state "$rc" "$(( SECONDS - t0 ))" "$limit")
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$state" "$rc" "$(( SECONDS - t0 ))" "$limit" \
    "$(tail -n 1 "$WORK/$name.log" | tr '\t|' '  ' | cut -c1-160)" >> "$WORK/status.tsv"
  say "part $name: $state (exit $rc) after $(( SECONDS - t0 ))s"
  tail -n 3 "$WORK/$name.log" | sed 's/^/    /'
  write_report
}

bench() {  # bench NAME overrides...
  local name=$1; shift
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of key=value words
  part "$name" "$PY" -m pixelsac.bench bench.device="$DEVICE" bench.warmup="$WARMUP" \
    bench.out="$WORK/$name" bench.overwrite=true $BENCH_ARGS "$@"
}

train_run() {  # train_run NAME PRECISION overrides...: a training run whose exit code is kept in NAME.rc
  local name=$1 precision=$2 pid rc; shift 2
  # shellcheck disable=SC2086  # FAST_ARGS is a list of key=value words
  "$PY" -m pixelsac.train task="$FAST_TASK" precision="$precision" seed=1 train.video_every_evals=0 \
    trainer.enable_progress_bar=false stop.max_wait_steps=0 stop.max_wait_seconds=2 \
    run_dir="$WORK/$name" overwrite=true "$@" $FAST_ARGS > "$WORK/$name.log" 2>&1 &
  pid=$!
  # told to stop (the part's time is up): pass it on and still wait, so the exit code is kept
  trap 'kill -TERM "$pid" 2>/dev/null' TERM
  while true; do wait "$pid"; rc=$?; kill -0 "$pid" 2>/dev/null || break; done
  echo "$rc" > "$WORK/$name.rc"
  return "$rc"
}
export -f train_run
export PY FAST_TASK WORK FAST_ARGS

# The gate: only the graphs-equal-eager test, in a part of its own with its own XML, so a slow
# compile in another test cannot take the gate (and with it every graphed goal) down. Its
# verdict: "on" (every mode passed), "on-uncompiled" (every mode but the compiled optimizer's:
# compiled cells are then timed eagerly only) or "off".
GRAPHS=off; GATE=off
if [[ "$GPU_TESTS" != 0 ]]; then
  # every mode but the compiled optimizer's first, with its XML; then that one (triton compiles its
  # step first), with its own: cut by the part's limit, it loses its own verdict only
  gate_pytest="\"\$PY\" -m pytest -m gpu -q -p no:cacheprovider"
  part graphs bash -c "$gate_pytest -k 'not fp16-compiled' --junitxml='$WORK/graphs.xml' '$GRAPH_TEST'; \
    $gate_pytest --junitxml='$WORK/graphs_compiled.xml' '$GRAPH_TEST[fp16-compiled]'"
  GATE=$(timeout -k 1 "$(( GATE_S > 1 ? GATE_S - 1 : 1 ))" "$PY" tools/gpu/gpu_report.py gate "$WORK") || GATE=off
  [[ "$GATE" == on || "$GATE" == on-uncompiled ]] && GRAPHS=on
fi
say "CUDA graphs: $GATE"
GRAPHED_GOAL_MODES=$GOAL_MODES
[[ "$GATE" == on-uncompiled ]] && GRAPHED_GOAL_MODES=${GOAL_MODES/,fp16-compiled/}
# on a GPU the batch is on the device, as a GPU-resident replay hands it over (no copy timed)
GOAL_BATCH=$([[ "$DEVICE" == cuda ]] && echo device || echo auto)

if [[ "$GOALS" != 0 ]]; then
  for batch in 512 128; do
    bench "goals$batch" bench.batch_sizes="$batch" bench.modes="$GRAPHED_GOAL_MODES" bench.cuda_graphs="$GRAPHS" \
      bench.batch="$GOAL_BATCH" bench.updates="$N_GOALS"
  done
else
  bench bench512 bench.batch_sizes=512 bench.modes=$MODES bench.updates="$N512"
  bench bench128 bench.batch_sizes=128 bench.modes=$MODES bench.updates="$N128"
  syncfree_graphs=$([[ "$GRAPHS" == on ]] && echo both || echo off)
  bench syncfree bench.batch_sizes=512 bench.modes=fp32,fp16 bench.sync_free=both bench.cuda_graphs="$syncfree_graphs" \
    bench.updates="$N_SF"
  bench ablations bench.batch_sizes=512 bench.modes=fp16 bench.ablations=true bench.updates="$N_ABL"
  bench layout bench.batch_sizes=512 bench.modes=fp32,fp16 bench.channels_last=both bench.updates="$N_CL"
fi

if [[ "$FAST_FRAMES" != 0 ]]; then
  # seed steps (random actions, no updates) a tenth of the agent steps (cartpole repeats each
  # action 8 times), so the figure is about updates: the default would be 80% of this budget
  seed_steps=$(( FAST_FRAMES / 8 / 10 ))
  fast_graphs=$([[ "$GRAPHS" == on && "$DEVICE" == cuda ]] && echo true || echo false)
  fast_goals=""
  if [[ "$GOALS" != 0 ]]; then
    fast_goals="env.num_envs=$GOALS_ENVS"
    # the compiled optimizer where triton compiles and, with graphs, where the gate passed it
    if (( COMPILED )) && [[ "$GRAPHS" == off || "$GATE" == on ]]; then
      fast_goals+=" perf.compile_optimizer=true"
    fi
  fi
  part fast bash -c "train_run fast_fp16 fp16 train.env_frames=$FAST_FRAMES train.seed_steps=$seed_steps \
    train.eval_every_frames=$FAST_FRAMES train.eval_episodes=2 perf.cuda_graphs=$fast_graphs replay.device=auto \
    train.overlap_collection=true $fast_goals"
fi

if [[ "$GOALS" == 0 ]]; then
  if [[ "$COMPILE" != 0 ]]; then
    bench compile bench.batch_sizes=512 bench.modes=fp32,fp16 bench.compile=on bench.updates="$N_COMPILE"
  fi
  if [[ "$OPTSTEP" != 0 ]]; then
    bench optstep bench.batch_sizes=512,128 bench.modes=fp16,fp16-compiled,bf16,bf16-compiled \
      bench.cuda_graphs="$GRAPHS" bench.updates="$N_OPTSTEP"
  fi
  bench batchsrc bench.batch_sizes=512 bench.modes=fp16 bench.batch=all bench.updates="$N_SF"
elif [[ "$GRAPHS" == on ]]; then  # the goals were timed as graphs: their eager rows, if time allows
  bench goals_eager bench.batch_sizes=512,128 bench.modes="$GOAL_MODES" bench.cuda_graphs=off \
    bench.batch="$GOAL_BATCH" bench.updates="$N_GOALS"
fi

if [[ "$GPU_TESTS" != 0 ]]; then
  # every other GPU test after the measurements: the compile-heavy ones (triton compiles hAdam's
  # step, the scalers' bookkeeping and the target update first) and the compiled ops on CUDA
  part gpu_tests "$PY" -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors \
    --deselect "$GRAPH_TEST" --junitxml="$WORK/gpu_tests.xml" tests
fi

finish
