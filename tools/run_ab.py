"""Two training configurations, end to end, interleaved round by round: env frames/s and wall time.

    python tools/run_ab.py --a train.overlap_collection=false --b train.overlap_collection=true \\
        --rounds 3 --out docs/results/overlap_cpu/tiny_fp16 -- preset=tiny train.num_threads=1

Each round runs ``pixelsac-train`` once with the shared ``key=value`` arguments and ``--a``'s, once
with ``--b``'s (``--a`` first in odd rounds, ``--b`` first in even ones), one run at a time, each in
a fresh run directory under ``--work`` (a temporary folder unless given). A shared machine's speed
drifts; runs that alternate see the same drift, so the ratio of a round holds where two absolute
times from two separate runs would not. Per run: the fit's wall time and env frames/s from its summary
(start-up and evaluation included), and the steady rate (the median of the logged
``perf/env_frames_per_s`` over the later half of the run's log intervals). The table gives each
round's B ÷ A and their median; ``--out`` writes ``OUT.md`` / ``OUT.json``. A run that fails stops
the tool with its exit code and the tail of its log.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from gpu_report import steady_frames_per_s  # noqa: E402  (the GPU report's end-to-end figure)
from table_files import write_table_files  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def _overrides(text: str) -> list[str]:
    words = shlex.split(text)
    for word in words:
        if "=" not in word:
            raise argparse.ArgumentTypeError(f"{word!r} is not a key=value override")
    return words


def run_once(label: str, overrides: list[str], run_dir: Path, python: str) -> dict[str, Any]:
    """One training run; its summary's figures and the steady rate."""
    command = [python, "-m", "pixelsac.train", *overrides, f"run_dir={run_dir}", "trainer.enable_progress_bar=false"]
    log = run_dir.with_suffix(".log")
    with log.open("w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if code != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise SystemExit(f"run_ab: the {label} run exited {code} ({log}):\n{tail}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "wall_s": summary["wall_s"],
        "env_frames": summary["env_frames"],
        "env_frames_per_s": summary["env_frames_per_s"],
        "steady_env_frames_per_s": steady_frames_per_s(run_dir),
        "ms_per_update": summary.get("ms_per_update"),
    }


def machine() -> str:
    """The grid tool's hardware line (CPU model and 16-bit float extensions, cores, torch, the
    CUDA device) and the code version the runs train with."""
    from experiment import code_version, hardware_line

    return f"{hardware_line()}; code {code_version()}"


def _ratio(b: float | None, a: float | None) -> float | None:
    return b / a if a and b is not None else None


def table(rounds: list[dict[str, dict[str, Any]]], a: list[str], b: list[str]) -> str:
    def num(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [
        f"A: {' '.join(a) or '(the shared arguments only)'}; B: {' '.join(b) or '(the shared arguments only)'}.",
        "",
        "| round | A: wall s, env frames/s, steady | B: wall s, env frames/s, steady "
        "| B ÷ A, env frames/s | B ÷ A, steady |",
        "|---|---|---|---|---|",
    ]
    whole, steady = [], []
    for i, each in enumerate(rounds, 1):
        ra, rb = each["a"], each["b"]
        whole.append(_ratio(rb["env_frames_per_s"], ra["env_frames_per_s"]))
        steady.append(_ratio(rb["steady_env_frames_per_s"], ra["steady_env_frames_per_s"]))
        cells = [
            ", ".join(num(r[key], ".1f") for key in ("wall_s", "env_frames_per_s", "steady_env_frames_per_s"))
            for r in (ra, rb)
        ]
        lines.append(f"| {i} | {cells[0]} | {cells[1]} | {num(whole[-1], '.3f')} | {num(steady[-1], '.3f')} |")
    known_whole = [r for r in whole if r is not None]
    known_steady = [r for r in steady if r is not None]
    lines.append(
        f"| median | | | {num(statistics.median(known_whole) if known_whole else None, '.3f')} "
        f"| {num(statistics.median(known_steady) if known_steady else None, '.3f')} |"
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", type=_overrides, default=[], help="A's overrides (quoted, space-separated)")
    parser.add_argument("--b", type=_overrides, default=[], help="B's overrides")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, help="where the runs go (default: a temporary folder, removed)")
    parser.add_argument("--out", type=Path, help="write OUT.md and OUT.json")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs pixelsac.train")
    args, shared = parser.parse_known_args(argv)
    shared = [word for word in shared if word != "--"]
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.a == args.b:
        parser.error("--a and --b are the same configuration")
    bad = [word for word in shared if "=" not in word]
    if bad:
        parser.error(f"not key=value overrides: {' '.join(bad)}")
    from pixelsac import cli
    from pixelsac.config import load_config

    # a mistyped key or value: one line and exit 2 before any run starts
    def check(_: list[str]) -> int:
        load_config([*shared, *args.a])
        load_config([*shared, *args.b])
        return 0

    code = cli.run_command(check, [], __doc__ or "")
    if code != 0:
        return code
    where = machine()  # before the runs: the code they train with
    with tempfile.TemporaryDirectory(prefix="run_ab-") as scratch:
        work = args.work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        rounds = []
        for i in range(1, args.rounds + 1):
            order = ("a", "b") if i % 2 else ("b", "a")
            each = {}
            for which in order:
                extra = args.a if which == "a" else args.b
                each[which] = run_once(which.upper(), [*shared, *extra], work / f"round{i}_{which}", args.python)
                print(f"round {i} {which.upper()}: {each[which]}", flush=True)
            rounds.append(each)
    text = f"Machine: {where}. Shared: {' '.join(shared) or '(none)'}.\n" + table(rounds, args.a, args.b)
    print(text, end="")
    if args.out:
        data = {"machine": where, "shared": shared, "a": args.a, "b": args.b, "rounds": rounds}
        write_table_files(args.out, "run_ab.py", argv, text, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
