"""tools/update_bits.py: the bitwise before/after check of a refactoring (a few tiny updates here)."""

from __future__ import annotations

import shutil

import torch
from conftest import load_tool


def test_a_run_equals_itself_and_one_changed_bit_is_found(tmp_path, capsys):
    bits = load_tool("update_bits.py")
    assert bits.main(["save", str(tmp_path / "a"), "--modes", "fp16", "--forms", "eager", "--updates", "3"]) == 0
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert bits.main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "fp16-eager.ckpt: equal" in capsys.readouterr().out

    checkpoint = torch.load(tmp_path / "b" / "fp16-eager.ckpt", weights_only=False)
    moment = checkpoint["optimizer_states"][0]["state"][0]["exp_avg_root"]
    moment.view(torch.int16)[(0,) * moment.dim()] ^= 1  # one ulp of one root moment
    torch.save(checkpoint, tmp_path / "b" / "fp16-eager.ckpt")
    assert bits.main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert "1 differ, e.g. /optimizer_states/0/state/0/exp_avg_root" in capsys.readouterr().out


def test_an_unknown_mode_is_refused_with_the_choices(tmp_path, capsys):
    bits = load_tool("update_bits.py")
    assert bits.main(["save", str(tmp_path), "--modes", "fp17"]) == 2
    assert "unknown mode 'fp17'; choose from" in capsys.readouterr().err
