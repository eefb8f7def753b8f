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
@pytest.mark.parametrize(
    "precision,poison,extra",
    [
        ("fp32", -1, ()),
        ("fp16", 3, ()),
        ("fp16", 3, ("perf.compile_optimizer=true",)),
        ("fp32", -1, ("train.overlap_collection=true",)),
    ],
    ids=["fp32", "fp16", "fp16-compiled-hadam", "fp32-overlapped-collection"],
)
def test_ranks_hold_bitwise_identical_weights(tmp_path, precision, poison, extra):
    """fp16 with an overflow on one rank alone at update 3: every rank skips it, and stays
    identical (also with hAdam's compiled step, which each rank compiles for itself); and with
    each rank's environment stepping in its own worker during the updates."""
    a, b = run_ddp(tmp_path, f"precision={precision}", *extra, poison=poison)
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


def test_data_parallel_trains_under_gradient_average_not_ddps_reducer():
    """trainer.strategy=ddp (or several devices) builds GradientAverage: no find_unused_parameters
    (a host copy of the reducer's used-map per backward), no broadcast of buffers per forward."""
    from pixelsac.config import load_config
    from pixelsac.distributed import GradientAverage
    from pixelsac.run import make_trainer

    for overrides in (DDP[:3], ["trainer.devices=2", "trainer.accelerator=cpu"]):
        trainer = make_trainer(load_config(overrides))
        assert isinstance(trainer.strategy, GradientAverage) and trainer.strategy.world_size == 2
        assert not trainer.strategy._ddp_kwargs  # no DistributedDataParallel is built to take them


class ThreeNets(torch.nn.Module):
    """SAC's shape in miniature: a critic (trunk + head, channels-last trunk weight), an actor whose
    loss reaches the critic's head only, a temperature; a buffer that must not travel per step."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Conv2d(2, 3, 1).to(memory_format=torch.channels_last)
        self.head = torch.nn.Linear(3, 1)
        self.actor = torch.nn.Linear(3, 3)
        self.log_alpha = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))
        self.register_buffer("kahan", torch.zeros(5, dtype=torch.float16))

    def losses(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        features = self.trunk(x).mean((2, 3))
        critic = self.head(features).square().mean()
        action = self.actor(features.detach())
        actor = self.head(action).mean()  # through the critic's head, not its trunk
        alpha = (self.log_alpha * 2.0).float()
        return critic, actor, alpha


def test_each_backward_averages_exactly_the_gradients_it_produced(monkeypatch):
    """In one process, the collectives recorded: states broadcast once; after each backward one
    all-reduce per dtype of the gradients it produced, in parameter order, divided by the world."""
    from types import SimpleNamespace

    from pixelsac import distributed

    sent = []

    def all_reduce(flat, *args, **kwargs):
        sent.append(("all_reduce", flat.dtype, flat.numel()))
        flat.mul_(2)  # what the sum over 2 identical ranks gives

    monkeypatch.setattr(distributed.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(distributed.dist, "broadcast", lambda flat, src: sent.append(("broadcast", flat.dtype, src)))
    torch.manual_seed(0)
    module = ThreeNets()
    strategy = distributed.GradientAverage()
    strategy.cluster_environment = SimpleNamespace(world_size=lambda: 2, teardown=lambda: None)
    strategy.model = module
    strategy.configure_ddp()
    assert sorted(sent, key=str) == sorted([("broadcast", torch.float32, 0), ("broadcast", torch.float64, 0),
                                            ("broadcast", torch.float16, 0)], key=str)  # fmt: skip
    sent.clear()

    def backward(loss):
        strategy.pre_backward(loss)
        loss.backward()
        strategy.post_backward(loss)

    x = torch.randn(4, 2, 3, 3)
    critic, actor, alpha = module.losses(x)
    numel = lambda *params: sum(p.numel() for p in params)  # noqa: E731
    backward(critic)
    assert sent == [
        ("all_reduce", torch.float32, numel(module.trunk.weight, module.trunk.bias, *module.head.parameters()))
    ]
    # averaged over 2 identical ranks: the local gradient, value for value, back in a channels-last weight's layout
    (local,) = torch.autograd.grad(module.losses(x)[0], module.trunk.weight)
    assert torch.equal(module.trunk.weight.grad, local)
    sent.clear()
    module.zero_grad(set_to_none=True)
    backward(actor)  # the actor and the critic's head, never the trunk
    assert sent == [("all_reduce", torch.float32, numel(*module.head.parameters(), *module.actor.parameters()))]
    assert module.trunk.weight.grad is None
    sent.clear()
    backward(alpha)
    assert sent == [("all_reduce", torch.float64, 1)]
    assert module.log_alpha.grad.item() == 2.0  # divided by 2 ranks, summed over 2 identical ones
    sent.clear()
    strategy.post_backward(alpha)  # nothing produced since: nothing sent
    assert sent == []
