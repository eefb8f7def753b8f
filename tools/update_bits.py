"""Train each precision mode for a few hundred tiny updates on random batches and save, or compare,
the state it ends in: every weight, optimizer moment, step count and loss scale.

    python tools/update_bits.py save OUT [--modes fp16,bf16] [--updates 200] [--resume CKPT_DIR]
    python tools/update_bits.py compare A B

``save`` runs, per mode and per form of the optimizer step (``eager``, ``compiled`` =
``perf.compile_optimizer=true``, each with host step counts and with ``perf.sync_free=true``), a
``SACModule`` under a bare Trainer on the CPU (no environment, no rendering): ``--updates``
updates on random replay batches (seeded), then writes its Lightning checkpoint
``OUT/<mode>-<form>.ckpt``. ``--resume DIR`` starts each from ``DIR/<mode>-<form>.ckpt`` (written
by this tool, possibly by older code) and trains ``--updates`` more on other batches. ``compare``
holds two such folders to each other: every tensor of every checkpoint ``torch.equal``, every
other value ``==``; it prints one line per checkpoint and exits 1 if any differs. Run ``save``
once with the code before a change and once after (``PYTHONPATH`` picks the checkout) and
``compare`` the folders: a refactoring that is meant to change nothing must show ``equal``
everywhere.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
if str(REPO) not in sys.path:  # last: the checkout under test is the one PYTHONPATH names (experiment.py
    sys.path.append(str(REPO))  # would put this one first)
from experiment import MODES  # noqa: E402  (the grid's modes: fp16-six is the published six)

#: small sizes in the spirit of the tests' TINY settings: a real update, a second or so per 10
SIZES = [
    "preset=tiny",
    "env.image_size=32",
    "agent.batch_size=8",
    "agent.num_filters=8",
    "agent.feature_dim=16",
    "agent.hidden_dim=32",
    "train.num_threads=1",
]
DEFAULT_MODES = ("fp32", "fp16", "bf16", "fp16-six", "amp")
FORMS = {
    "eager": ["perf.compile_optimizer=false", "perf.sync_free=false"],
    "eager_sync_free": ["perf.compile_optimizer=false", "perf.sync_free=true"],
    "compiled": ["perf.compile_optimizer=true", "perf.sync_free=false"],
    "compiled_sync_free": ["perf.compile_optimizer=true", "perf.sync_free=true"],
}
OBS_SHAPE, ACTION_DIM = (9, 32, 32), 1  # cartpole_swingup: 3 stacked RGB frames, one action


def batches(count: int, first_seed: int) -> list[dict[str, torch.Tensor]]:
    """``count`` random replay batches; large rewards now and then, so fp16's scaler backs off."""
    from pixelsac.perf import synthetic_batch

    out = []
    for index in range(count):
        batch = synthetic_batch(8, OBS_SHAPE, ACTION_DIM, seed=first_seed + index)
        if index % 37 == 5:
            batch["reward"] = batch["reward"] * 3e4
        out.append(batch)
    return out


def train(mode: str, form: str, updates: int, out: Path, resume: Path | None) -> Path:
    """One mode and form: ``updates`` updates (after ``resume``'s), its checkpoint written to ``out``."""
    import lightning as L
    from torch.utils.data import DataLoader

    from pixelsac.config import load_config, to_plain
    from pixelsac.module import SACModule
    from pixelsac.perf.calibration import quiet_lightning

    config = to_plain(load_config([*SIZES, *MODES[mode], *FORMS[form], "seed=1"]))
    torch.manual_seed(1)
    module = SACModule(config, OBS_SHAPE, ACTION_DIM)
    epochs = 2 if resume is not None else 1
    loader = DataLoader(batches(updates, 1000 * epochs), batch_size=None)
    with quiet_lightning():
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=epochs,
            precision="32-true",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        start = None if resume is None else str(resume / f"{mode}-{form}.ckpt")
        trainer.fit(module, loader, ckpt_path=start)
        path = out / f"{mode}-{form}.ckpt"
        trainer.save_checkpoint(path)
    return path


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two checkpoint values differ: tensors by ``torch.equal`` (dtype and shape too)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        same = torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}/{key} (only one side)" for key in sorted(set(a) ^ set(b), key=str)]
        for key in a.keys() & b.keys():
            out += differences(a[key], b[key], f"{where}/{key}")
        return out
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}/{i}")]
    return [] if a == b else [where]


#: checkpoint entries that record the run, not its numbers
IGNORED = ("pytorch-lightning_version", "hyper_parameters", "loops", "callbacks", "hparams_name")


def compare(a: Path, b: Path) -> int:
    names = sorted({p.name for p in a.glob("*.ckpt")} | {p.name for p in b.glob("*.ckpt")})
    if not names:
        print(f"update_bits: no checkpoints in {a} or {b}", file=sys.stderr)
        return 2
    failed = 0
    for name in names:
        if not ((a / name).exists() and (b / name).exists()):
            failed += 1
            print(f"{name}: only in {a if (a / name).exists() else b}")
            continue
        left = torch.load(a / name, map_location="cpu", weights_only=False)
        right = torch.load(b / name, map_location="cpu", weights_only=False)
        for key in IGNORED:
            left.pop(key, None)
            right.pop(key, None)
        found = differences(left, right)
        failed += bool(found)
        print(f"{name}: " + ("equal" if not found else f"{len(found)} differ, e.g. {', '.join(found[:4])}"))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    save = sub.add_parser("save", help="train each mode and form, write its checkpoint")
    save.add_argument("out", type=Path)
    save.add_argument("--modes", default=",".join(DEFAULT_MODES))
    save.add_argument("--forms", default=",".join(FORMS))
    save.add_argument("--updates", type=int, default=200)
    save.add_argument("--resume", type=Path, default=None, help="a folder this tool saved: continue its runs")
    both = sub.add_parser("compare", help="hold two saved folders to each other")
    both.add_argument("a", type=Path)
    both.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    if args.command == "compare":
        return compare(args.a, args.b)
    modes, forms = args.modes.split(","), args.forms.split(",")
    for name, known, kind in ((modes, MODES, "mode"), (forms, FORMS, "form")):
        unknown = [n for n in name if n not in known]
        if unknown:
            print(f"update_bits: unknown {kind} {unknown[0]!r}; choose from {', '.join(known)}", file=sys.stderr)
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    for mode in modes:
        for form in forms:
            print(train(mode, form, args.updates, args.out, args.resume), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
