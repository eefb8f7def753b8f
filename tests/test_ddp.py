"""Data parallelism on a CPU: 2 processes with gloo through `trainer.strategy=ddp`."""

import subprocess
import sys

import pytest
import torch
from conftest import REPO, TESTS, TINY, cli_env

DDP = ["trainer.devices=2", "trainer.strategy=ddp", "trainer.accelerator=cpu", "train.num_threads=1"]


def run_ddp(tmp_path, *args: str, poison: int = -1, no_reduce: bool = False) -> tuple[dict, dict]:
    dump = tmp_path / "dump"
    dump.mkdir()
    env = cli_env(TESTS, DUMP_DIR=str(dump), POISON_UPDATE=str(poison), NO_REDUCE="1" if no_reduce else "0")
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "ddp_check.py"), *TINY, *DDP, *args, f"run_dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("done:") == 1  # rank 0 speaks for the run
    return torch.load(dump / "rank0.pt"), torch.load(dump / "rank1.pt")


def differing(a: dict, b: dict) -> list[str]:
    return [k for k in a["state_dict"] if not torch.equal(a["state_dict"][k], b["state_dict"][k])]


@pytest.mark.slow
@pytest.mark.parametrize("precision,poison", [("fp32", -1), ("fp16", 3)])
def test_ranks_hold_bitwise_identical_weights(tmp_path, precision, poison):
    """fp16 with an overflow on one rank alone at update 3: every rank skips it, and stays identical."""
    a, b = run_ddp(tmp_path, f"precision={precision}", poison=poison)
    assert a["updates"] == b["updates"] > 0
    assert differing(a, b) == []
    if precision == "fp16":
        assert a["skipped"]["critic"] == b["skipped"]["critic"] == 1
        assert a["scales"] == b["scales"] and a["scales"]["critic"] == 5000.0
    # each rank collected half of the 320-frame budget; logs count both
    assert a["env_frames"] == b["env_frames"] == 160
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["callbacks"]["Checkpointer"]["collector"]["env_frames"] == 160
    header = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert header and any(line.split(",")[header[0].split(",").index("step")] == "320" for line in header[1:])


@pytest.mark.slow
def test_without_the_all_reduce_the_replicas_drift_apart(tmp_path):
    """Negative control: the test above can fail."""
    a, b = run_ddp(tmp_path, "precision=fp16", poison=3, no_reduce=True)
    assert (a["skipped"]["critic"], b["skipped"]["critic"]) == (0, 1)
    assert differing(a, b)


@pytest.mark.slow
def test_an_update_waits_at_no_barrier(tmp_path):
    """The skip decision's all-reduce (critic, actor, temperature: 3 per full update) goes to
    torch.distributed directly; Lightning's strategy.reduce would add a barrier before each."""
    a, b = run_ddp(tmp_path, "precision=fp16")
    for rank in (a, b):
        assert rank["barriers_in_updates"] == 0
        assert rank["all_reduces_in_updates"] >= rank["updates"]  # the flags were still reduced
    assert differing(a, b) == []
