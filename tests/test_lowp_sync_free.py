"""Sync-free low-precision steps: device-side skips in hAdam and the compound loss scaler.

The device path must (1) take exactly the host path's decisions -- same skips, same backoffs, a
growth at the same step -- (2) leave every tensor bit-exactly unchanged on a skipped step, (3)
follow the host path's trajectory to rounding, and (4) never read a tensor on the host between
growth checks. Two host-read counters: a TorchFunctionMode that sees every ``.item()``,
``bool()``, ``float()``, ``.tolist()``, ``.cpu()`` and ``.numpy()`` on a tensor, and the
TorchDispatchMode of ``dispatch_count.py``, which also sees the reads below the Python API (a 0-dim
tensor handed to a foreach op's Scalar overload).
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from dispatch_count import DispatchCount
from torch.overrides import TorchFunctionMode

from pixelsac.lowp import CompoundLossScaler, HAdam, KahanEMA, kahan_add_

F16, F32, F64 = torch.float16, torch.float32, torch.float64
HOST_READS = {"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "cpu", "numpy", "nonzero"}


class HostReads(TorchFunctionMode):
    """Counts tensor methods that make the host wait for the device."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def test_the_counter_sees_host_reads():
    x = torch.ones(2)
    with HostReads() as reads:
        bool(x.sum() > 0), x[0].item(), float(x[1]), x.tolist()
    assert reads.total == 4, reads.calls


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # a matrix, a vector and a 0-dim tensor (like log_alpha: its own dtype-promotion corner)
    return [
        torch.randn(4, 3, generator=gen).to(dtype).requires_grad_(),
        torch.randn(5, generator=gen).to(dtype).requires_grad_(),
        torch.tensor(-2.3, dtype=dtype).requires_grad_(),
    ]


def _grads(step: int, params: list[torch.Tensor], scale: float = 1.0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(p.shape, generator=gen, dtype=F64) * 1e-2 * scale + 3e-3).to(p.dtype) for p in params]


def _state_copy(opt: HAdam, params: list[torch.Tensor]) -> list[dict]:
    return [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()} for p in params]


@pytest.mark.parametrize("unbiased", [False, True], ids=["published", "unbiased"])
@pytest.mark.parametrize("kahan", [False, True])
def test_capturable_hadam_follows_the_host_path_and_a_float64_reference(kahan, unbiased):
    host_p, dev_p, ref_p = _params(F16), _params(F16), _params(F64)
    host = HAdam(host_p, lr=1e-3, eps=1e-4, kahan=kahan, unbiased_moments=unbiased)
    dev = HAdam(dev_p, lr=1e-3, eps=1e-4, kahan=kahan, capturable=True, unbiased_moments=unbiased)
    ref = HAdam(ref_p, lr=1e-3, eps=1e-4)
    for step in range(200):
        for opt, ps in ((host, host_p), (dev, dev_p), (ref, ref_p)):
            for p, g in zip(ps, _grads(step, ps)):
                p.grad = g
            opt.step()
    assert torch.is_tensor(dev.state[dev_p[0]]["step"]) and float(dev.state[dev_p[0]]["step"]) == 200
    for h, d, r, start in zip(host_p, dev_p, ref_p, _params(F64)):
        travelled = (r.detach() - start).abs()
        assert travelled.min() > 0.02  # the reference went somewhere
        host_err = (h.detach().double() - r.detach()).abs().max()
        dev_err = (d.detach().double() - r.detach()).abs().max()
        # the two fp16 paths differ only in how the bias corrections are rounded
        assert dev_err <= 1.5 * host_err + 2e-3, (dev_err, host_err)
        torch.testing.assert_close(d.detach().double(), h.detach().double(), rtol=0, atol=4e-3)


@pytest.mark.parametrize("unbiased", [False, True], ids=["published", "unbiased"])
@pytest.mark.parametrize("kahan", [False, True])
def test_device_side_skip_leaves_every_tensor_bit_exactly_unchanged(kahan, unbiased):
    params = _params(F16)
    opt = HAdam(params, lr=1e-3, eps=1e-4, kahan=kahan, capturable=True, unbiased_moments=unbiased)
    for step in range(5):
        for p, g in zip(params, _grads(step, params)):
            p.grad = g
        opt.step(found_inf=torch.zeros(()))
    before_params = [p.detach().clone() for p in params]
    before_state = _state_copy(opt, params)
    for p in params:
        p.grad = torch.full_like(p, float("inf"))
    params[1].grad[0] = float("nan")
    opt.step(found_inf=torch.ones(()))
    for p, b in zip(params, before_params):
        assert torch.equal(p.detach(), b)
    for p, b in zip(params, before_state):
        for key, value in opt.state[p].items():
            assert torch.equal(value, b[key]), key  # step, exp_avg, exp_avg_root, kahan_comp
    if kahan:
        assert any(bool(b["kahan_comp"].ne(0).any()) for b in before_state)  # a compensation that must survive


@pytest.mark.parametrize("dtype", [F16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("unbiased", [False, True], ids=["published", "unbiased"])
@pytest.mark.parametrize("kahan", [False, True])
def test_a_capturable_step_reads_nothing_on_the_host(kahan, unbiased, dtype):
    """Taken and skipped steps, with ε a float and (after a device-side rescale) a device tensor:
    no ``aten._local_scalar_dense`` anywhere in the step or the rescale."""
    params = _params(dtype)
    opt = HAdam(params, lr=1e-3, eps=1e-4, kahan=kahan, capturable=True, unbiased_moments=unbiased)
    reads = []
    for step, flag in enumerate([0.0, 0.0, 1.0, 0.0]):
        for p, g in zip(params, _grads(step, params)):
            p.grad = g
        with DispatchCount() as count:
            opt.step(found_inf=torch.tensor(flag))
            opt.rescale_state_(torch.tensor(0.5 if flag else 1.0))  # ε becomes a device tensor
        reads.append((count.host_reads, dict(count.read_sites)))
    assert torch.is_tensor(opt.param_groups[0]["eps"])
    assert all(n == 0 for n, _ in reads), reads


def test_a_masked_kahan_add_reads_nothing_on_the_host():
    values, comps = (
        [torch.ones(3, dtype=F16), torch.ones((), dtype=F16)],
        [torch.zeros(3, dtype=F16), torch.zeros((), dtype=F16)],
    )
    with DispatchCount() as count:
        kahan_add_(
            values, [torch.full((3,), 1e-4, dtype=F16), torch.tensor(1e-4, dtype=F16)], comps, taken=torch.ones(())
        )
    assert count.host_reads == 0, dict(count.read_sites)
    assert all(bool(c.ne(0).all()) for c in comps)  # 1e-4 is below half an ulp of 1: all of it compensated


def test_a_skipped_first_step_leaves_t_at_zero_and_the_next_step_is_a_first_step():
    skipped_first, plain = _params(F32), _params(F32)
    a = HAdam(skipped_first, lr=1e-3, capturable=True)
    b = HAdam(plain, lr=1e-3, capturable=True)
    for p in skipped_first:
        p.grad = torch.full_like(p, float("inf"))
    a.step(found_inf=torch.ones(()))
    assert float(a.state[skipped_first[0]]["step"]) == 0.0
    for opt, ps in ((a, skipped_first), (b, plain)):
        for p, g in zip(ps, _grads(0, ps)):
            p.grad = g
        opt.step(found_inf=torch.zeros(()))
    for p, q in zip(skipped_first, plain):
        assert torch.isfinite(p).all()
        assert torch.equal(p.detach(), q.detach())


def test_found_inf_needs_a_capturable_optimizer():
    params = _params(F16)
    opt = HAdam(params, lr=1e-3)
    for p, g in zip(params, _grads(0, params)):
        p.grad = g
    with pytest.raises(ValueError, match="capturable=True"):
        opt.step(found_inf=torch.zeros(()))


def test_state_moves_between_host_and_sync_free_runs():
    params = _params(F16)
    host = HAdam(params, lr=1e-3, eps=1e-4, kahan=True)
    for step in range(3):
        for p, g in zip(params, _grads(step, params)):
            p.grad = g
        host.step()
    dev = HAdam(params, lr=1e-3, eps=1e-4, kahan=True, capturable=True)
    dev.load_state_dict(host.state_dict())
    dev.rescale_state_(torch.tensor(0.5))  # eps becomes a device tensor
    for p, g in zip(params, _grads(3, params)):
        p.grad = g
    dev.step(found_inf=torch.zeros(()))
    assert float(dev.state[params[0]]["step"]) == 4
    back = HAdam(params, lr=1e-3, eps=1e-4, kahan=True)
    back.load_state_dict(dev.state_dict())
    for p, g in zip(params, _grads(4, params)):
        p.grad = g
    back.step()
    assert back.state[params[0]]["step"] == 5 and isinstance(back.param_groups[0]["eps"], float)
    assert back.param_groups[0]["eps"] == pytest.approx(0.5e-4, rel=1e-3)


# ---------------------------------------------------------------------------- the loss scaler
def _scaled_run(sync_free: bool, overflow_at: set[int], steps: int, growth_interval: int):
    params = _params(F16)
    opt = HAdam(params, lr=1e-3, eps=1e-4, kahan=True, capturable=sync_free)
    scaler = CompoundLossScaler(init_scale=1024.0, growth_interval=growth_interval)
    history = []
    for step in range(steps):
        loss = sum(
            ((p.float() * g.float()).sum() for p, g in zip(params, _grads(step, params, 30.0))), torch.zeros(())
        ).to(F16)
        if step in overflow_at:
            loss = loss * 1e4  # loss·S and its gradients leave fp16's range
        for p in params:
            p.grad = None
        scaler.scale_loss(loss).backward()
        taken = scaler.step(opt)
        history.append((bool(taken), scaler.scale, scaler.clean_steps))
    return params, opt, scaler, history


def test_sync_free_scaler_takes_the_host_decisions_step_for_step():
    overflow_at, steps = {2, 9, 10, 23}, 40
    host_params, host_opt, host, host_history = _scaled_run(False, overflow_at, steps, growth_interval=4)
    dev_params, dev_opt, dev, dev_history = _scaled_run(True, overflow_at, steps, growth_interval=4)
    assert dev_history == host_history  # skips, backoffs and growths at the same steps
    grew = [i for i in range(1, steps) if host_history[i][1] > host_history[i - 1][1]]
    assert len(grew) >= 3, host_history
    assert dev.state_dict() == host.state_dict()
    assert dev.skipped_steps == len(overflow_at) and dev.taken_steps == steps - len(overflow_at)
    assert dev_opt.param_groups[0]["eps"].item() == pytest.approx(host_opt.param_groups[0]["eps"], rel=1e-6)
    for h, d in zip(host_params, dev_params):
        torch.testing.assert_close(d.detach().float(), h.detach().float(), rtol=0, atol=2e-3)


@pytest.mark.parametrize("unbiased", [False, True], ids=["published", "unbiased"])
def test_sync_free_scaler_reads_the_host_only_at_growth_checks(unbiased):
    params = _params(F16)
    opt = HAdam(params, lr=1e-3, eps=1e-4, capturable=True, unbiased_moments=unbiased)
    scaler = CompoundLossScaler(init_scale=1024.0, growth_interval=10)
    reads_per_step = []
    for step in range(30):
        for p in params:
            p.grad = None
        loss = sum((p * g).sum() for p, g in zip(params, _grads(step, params)))
        with HostReads() as reads, DispatchCount() as dispatched:
            scaler.scale_loss(loss).backward()
            scaler.step(opt)
        reads_per_step.append(reads.total + dispatched.host_reads)
    # clean steps only: the host looks at step 11 (clean = 11 > 10, grows) and at step 22
    assert [i for i, n in enumerate(reads_per_step) if n] == [10, 21], reads_per_step
    assert scaler.scale == 4096.0


def test_host_scaler_reads_the_host_every_step():
    """The counter can fail: the host-side scaler reads found_inf on every step."""
    params = _params(F16)
    opt = HAdam(params, lr=1e-3, eps=1e-4)
    scaler = CompoundLossScaler(init_scale=1024.0)
    for p, g in zip(params, _grads(0, params)):
        p.grad = g
    with HostReads() as reads:
        scaler.step(opt)
    assert reads.total >= 1


def test_sync_free_scaler_state_round_trips_through_plain_numbers():
    _, _, scaler, _ = _scaled_run(True, {1}, 6, growth_interval=100)
    saved = scaler.state_dict()
    assert all(isinstance(v, (int, float)) for v in saved.values())
    fresh = CompoundLossScaler(growth_interval=100)
    fresh.load_state_dict(copy.deepcopy(saved))
    assert fresh.state_dict() == saved and fresh.scale == 512.0


# ------------------------------------------------------------------------------ Kahan-momentum
def test_deferred_target_check_sees_an_overflow_later():
    source, target = torch.nn.Linear(2, 2).half(), torch.nn.Linear(2, 2).half()
    ema = KahanEMA(source, target, scale=1e4, check_every_update=False)
    with torch.no_grad():
        source.weight.fill_(100.0)  # K·θ = 1e6 > 65504
    with HostReads() as reads:
        ema.update_(0.5)
    assert reads.total == 0
    ema.update_(0.5)  # still no error: nothing was read
    with pytest.raises(FloatingPointError, match="not finite"):
        ema.check_finite()
