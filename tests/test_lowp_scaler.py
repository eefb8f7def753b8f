"""Compound loss scaling (spec §2): failure mode 7 of §7 and the scaler's bookkeeping."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from pixelsac.lowp import CompoundLossScaler, HAdam, rescale_optimizer_state_

F16, F64 = torch.float16, torch.float64


def make_param(values=(0.1, -0.2, 0.3), dtype=F16) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, requires_grad=True)


def backward_scaled(scaler: CompoundLossScaler, param: torch.Tensor, x: float) -> torch.Tensor:
    """loss = Σ (x·w)²; its gradient 2x²w·S overflows fp16 when the loss is large."""
    param.grad = None
    loss = ((x * param) ** 2).sum()
    scaler.scale(loss).backward()
    return loss


def snapshot(opt: torch.optim.Optimizer, param: torch.Tensor) -> dict:
    state = {k: (v.clone() if torch.is_tensor(v) else copy.deepcopy(v)) for k, v in opt.state[param].items()}
    return {"param": param.detach().clone(), "state": state, "eps": opt.param_groups[0]["eps"]}


# ---------------------------------------------------------------------------- the one step
def test_the_step_backpropagates_the_scaled_loss_into_its_optimizers_parameters_only():
    """``step(optimizer, loss)`` owns the backward: stale gradients zeroed, ``S·loss`` backpropagated
    into the optimizer's parameters and no others, then the check and the step."""
    own = torch.nn.Parameter(torch.full((3,), 0.5, dtype=F16))
    other = torch.nn.Parameter(torch.full((3,), 2.0, dtype=F16))
    opt = HAdam([own], lr=1e-3, eps=1e-4)
    scaler = CompoundLossScaler(init_scale=8.0)
    own.grad = torch.full_like(own, 5.0)  # stale
    taken = scaler.step(opt, (own * other).sum())
    assert taken.dtype == torch.bool and bool(taken) and opt.state[own]["step"] == 1
    assert other.grad is None and torch.equal(own.grad, torch.full_like(own, 16.0))  # S·other


def test_while_a_graph_captures_the_step_its_host_half_is_left_to_the_caller():
    """Inside a CUDA graph capture (faked here) the step does its device work only: the growth
    check that is due waits for the caller's ``count_step`` after the replay."""
    from unittest import mock

    param = torch.nn.Parameter(torch.full((3,), 0.5, dtype=F16))
    opt = HAdam([param], lr=1e-3, eps=1e-4, capturable=True)
    scaler = CompoundLossScaler(init_scale=8.0, growth_interval=0)  # a growth due after each clean step
    param.grad = torch.ones_like(param)
    with (
        mock.patch.object(torch.backends.cuda, "is_built", return_value=True),
        mock.patch.object(torch.cuda, "is_current_stream_capturing", return_value=True),
    ):
        scaler.step(opt)
    assert scaler.scale == 8.0 and scaler.taken_steps == 1
    scaler.count_step(opt)
    assert scaler.scale == 16.0
    scaler.step(opt)  # not capturing: the host half runs at once
    assert scaler.scale == 32.0


# ------------------------------------------------------------------------- failure mode 7
def test_overflowing_loss_skips_the_step_and_halves_scale_state_and_eps():
    param = make_param()
    opt = HAdam([param], lr=1e-3, eps=1e-4, kahan=True)
    scaler = CompoundLossScaler(init_scale=1e4)
    for _ in range(3):
        backward_scaled(scaler, param, x=1.0)
        assert scaler.step(opt)
    before = snapshot(opt, param)

    loss = backward_scaled(scaler, param, x=30.0)
    assert loss.item() > 65504 / 1e4  # loss·S is not representable in fp16 ...
    assert not torch.isfinite(param.grad).all()  # ... and neither are the gradients
    assert not scaler.step(opt)

    assert torch.equal(param.detach(), before["param"])  # bitwise unchanged
    state = opt.state[param]
    assert state["step"] == before["state"]["step"] == 3  # t not advanced
    assert torch.equal(state["exp_avg"], before["state"]["exp_avg"] * 0.5)
    assert torch.equal(state["exp_avg_root"], before["state"]["exp_avg_root"] * 0.5)
    assert torch.equal(state["kahan_comp"], before["state"]["kahan_comp"])  # parameter units
    assert opt.param_groups[0]["eps"] == pytest.approx(0.5e-4)
    assert scaler.scale == 5e3
    assert (scaler.skipped_steps, scaler.taken_steps, scaler.clean_steps) == (1, 3, 0)


def test_backoff_floors_eps():
    param = make_param()
    opt = HAdam([param], lr=1e-3, eps=1e-4)
    scaler = CompoundLossScaler(init_scale=1e4, eps_floor=1e-7)
    for _ in range(12):  # 1e-4 · 2^-12 = 2.4e-8 < floor
        param.grad = torch.full((3,), float("inf"), dtype=F16)
        scaler.step(opt)
    assert opt.param_groups[0]["eps"] == 1e-7
    assert scaler.scale == pytest.approx(1e4 * 0.5**12)
    assert scaler.skipped_steps == 12 and not opt.state[param]  # no step was ever taken


def test_growth_after_more_than_growth_interval_clean_steps():
    param, twin = make_param(), make_param()
    opt = HAdam([param], lr=1e-3, eps=1e-4)
    twin_opt = HAdam([twin], lr=1e-3, eps=1e-4)  # same gradients, no scaler
    scaler = CompoundLossScaler(init_scale=1e4, growth_interval=3)
    for step in range(1, 5):
        backward_scaled(scaler, param, x=1.0)
        twin.grad = param.grad.clone()
        assert scaler.step(opt)
        twin_opt.step()
        if step <= 3:
            assert scaler.scale == 1e4 and scaler.clean_steps == step
    # The 4th clean step (> 3) grows S and the state, and restarts the count.
    assert scaler.scale == 2e4 and scaler.clean_steps == 0
    assert torch.equal(param, twin)
    assert torch.equal(opt.state[param]["exp_avg"], twin_opt.state[twin]["exp_avg"] * 2)
    assert torch.equal(opt.state[param]["exp_avg_root"], twin_opt.state[twin]["exp_avg_root"] * 2)
    assert opt.param_groups[0]["eps"] == pytest.approx(2e-4)
    assert opt.state[param]["step"] == twin_opt.state[twin]["step"] == 4


def test_no_growth_when_the_grown_state_would_overflow():
    param = make_param()
    opt = HAdam([param], lr=1e-3, eps=1e-4)
    scaler = CompoundLossScaler(init_scale=1e4, growth_interval=1)
    backward_scaled(scaler, param, x=1.0)
    scaler.step(opt)
    # 2.2·30000 overflows fp16 although 2·30000 would not: the paper's margin.
    opt.state[param]["exp_avg_root"].fill_(30000.0)
    # late in a run, so that the bias-corrected denominator (s / sqrt(1 - β2^t)) fits fp16 too;
    # at t = 2 it would be 22x s and the step itself would overflow (see the freeze tests)
    opt.state[param]["step"] = 10_000
    assert opt.state_is_finite_after(2.0) and not opt.state_is_finite_after(2.2)
    backward_scaled(scaler, param, x=1.0)
    assert scaler.step(opt)
    assert scaler.scale == 1e4 and scaler.clean_steps == 2  # keeps counting, retries next step


def test_reduce_found_inf_is_always_called_and_its_answer_decides():
    param = make_param()
    opt = HAdam([param], lr=1e-3, eps=1e-4)
    scaler = CompoundLossScaler()
    seen = []

    def another_rank_overflowed(flag: torch.Tensor) -> torch.Tensor:
        seen.append(flag.clone())
        return torch.ones_like(flag)

    backward_scaled(scaler, param, x=1.0)
    before = param.detach().clone()
    assert not scaler.step(opt, reduce_found_inf=another_rank_overflowed)
    assert len(seen) == 1 and seen[0].dim() == 0 and seen[0].is_floating_point()
    assert seen[0].item() == 0.0  # locally clean, but called anyway
    assert torch.equal(param.detach(), before) and scaler.scale == 5e3 and not opt.state[param]

    def in_place_all_reduce(flag: torch.Tensor) -> None:  # like dist.all_reduce(flag, MAX)
        seen.append(flag.clone())
        flag.zero_()

    param.grad = torch.full((3,), float("nan"), dtype=F16)
    # Every rank participates even on a local overflow; here the "reduction" clears it, so the
    # optimizer is asked to step -- and refuses the NaN state those gradients would write.
    assert not scaler.step(opt, reduce_found_inf=in_place_all_reduce)
    assert seen[-1].item() == 1.0
    assert bool(opt.state_overflow) and torch.equal(param.detach(), before)


def test_scaler_with_plain_torch_adam_scales_second_moment_quadratically():
    param = make_param()
    opt = torch.optim.Adam([param], lr=1e-3, eps=1e-4)
    scaler = CompoundLossScaler(init_scale=256.0, growth_interval=2)
    backward_scaled(scaler, param, x=1.0)
    scaler.step(opt)
    before = snapshot(opt, param)
    param.grad = torch.full((3,), float("inf"), dtype=F16)
    assert not scaler.step(opt)
    state = opt.state[param]
    assert torch.equal(state["exp_avg"], before["state"]["exp_avg"] * 0.5)
    assert torch.equal(state["exp_avg_sq"], before["state"]["exp_avg_sq"] * 0.25)
    assert torch.equal(state["step"], before["state"]["step"])
    assert opt.param_groups[0]["eps"] == pytest.approx(0.5e-4)
    assert scaler.scale == 128.0

    for _ in range(3):
        backward_scaled(scaler, param, x=1.0)
        assert scaler.step(opt)
    assert scaler.scale == 256.0  # grew after the 3rd clean step
    assert opt.param_groups[0]["eps"] == pytest.approx(1e-4)


def test_rescale_rejects_unknown_optimizers():
    param = make_param()
    with pytest.raises(TypeError, match="SGD"):
        rescale_optimizer_state_(torch.optim.SGD([param], lr=0.1), 0.5)


def test_gradients_are_never_unscaled():
    param = make_param()
    opt = HAdam([param], lr=1e-3, eps=1e-4)
    scaler = CompoundLossScaler(init_scale=1024.0)
    backward_scaled(scaler, param, x=1.0)
    scaled_grad = param.grad.clone()
    torch.testing.assert_close(scaled_grad, (1024.0 * 2 * param.detach()), rtol=1e-3, atol=0)
    scaler.step(opt)
    assert torch.equal(param.grad, scaled_grad)
    # m is in "×S" units: (1-β1)·S·g after one step.
    torch.testing.assert_close(opt.state[param]["exp_avg"], 0.1 * scaled_grad, rtol=1e-3, atol=0)


def test_skip_and_backoff_leave_the_float64_trajectory_unchanged():
    """The point of compound scaling: m/(s+ε) does not depend on S. In float64, training with
    S=1e4 and ε=1e-4 through a skipped step and a growth equals plain hAdam with ε=1e-8 on the
    unscaled gradients, the skipped step simply absent."""
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(3, generator=gen, dtype=F64) for _ in range(12)]
    skip_at = 5
    scaled_param, plain_param = make_param(dtype=F64), make_param(dtype=F64)
    scaled_opt = HAdam([scaled_param], lr=1e-2, eps=1e-4)
    plain_opt = HAdam([plain_param], lr=1e-2, eps=1e-8)
    scaler = CompoundLossScaler(init_scale=1e4, growth_interval=3)
    for i, g in enumerate(grads):
        if i == skip_at:
            scaled_param.grad = torch.full((3,), float("inf"), dtype=F64)
            assert not scaler.step(scaled_opt)
            continue
        scaled_param.grad = scaler.scale * g
        assert scaler.step(scaled_opt)
        plain_param.grad = g.clone()
        plain_opt.step()
    assert scaler.skipped_steps == 1 and scaler.scale != 1e4  # both rescales happened
    torch.testing.assert_close(scaled_param, plain_param, rtol=1e-10, atol=0)


# ---------------------------------------------------------------------------- bookkeeping
def test_scale_is_a_float_and_scales_a_loss():
    scaler = CompoundLossScaler(init_scale=8.0)
    loss = torch.tensor(0.5, dtype=F16)
    assert isinstance(scaler.scale, float) and scaler.scale == 8.0
    assert scaler.scale(loss).item() == 4.0 and scaler.scale(loss).dtype == F16
    assert (loss * scaler.scale).item() == 4.0


def test_state_dict_round_trip_with_plain_numbers():
    param = make_param()
    opt = HAdam([param], lr=1e-3, eps=1e-4)
    scaler = CompoundLossScaler(init_scale=1e4, growth_interval=2)
    for x in (1.0, 30.0, 1.0, 1.0, 1.0):
        backward_scaled(scaler, param, x=x)
        scaler.step(opt)
    state = scaler.state_dict()
    assert json.loads(json.dumps(state)) == state  # plain python numbers only
    assert all(type(v) in (int, float) for v in state.values())
    restored = CompoundLossScaler()
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    assert restored.scale == scaler.scale == 1e4  # 1e4 → 5e3 (skip) → 1e4 (growth)
    assert (restored.skipped_steps, restored.taken_steps, restored.clean_steps) == (1, 4, 0)


def test_kahan_adam_state_is_rescaled_like_adam():
    from pixelsac.lowp import KahanAdam

    param = make_param()
    opt = KahanAdam([param], lr=1e-3, eps=1e-4)
    scaler = CompoundLossScaler(init_scale=256.0)
    backward_scaled(scaler, param, x=1.0)
    scaler.step(opt)
    before = snapshot(opt, param)
    param.grad = torch.full((3,), float("inf"), dtype=F16)
    assert not scaler.step(opt)
    state = opt.state[param]
    assert torch.equal(state["exp_avg"], before["state"]["exp_avg"] * 0.5)
    assert torch.equal(state["exp_avg_sq"], before["state"]["exp_avg_sq"] * 0.25)
    assert torch.equal(state["kahan_comp"], before["state"]["kahan_comp"])  # parameter units
    assert torch.equal(param.detach(), before["param"]) and state["step"] == 1


@pytest.mark.parametrize("sync_free", [False, True], ids=["host", "sync-free"])
def test_after_a_burst_of_overflows_headroom_growth_returns_the_scale_where_the_gradients_allow(sync_free):
    """Eleven overflowing steps halve S from 1e4 to 4.88 (the full-size fp16 critic's burst). With
    gradients of 1 afterwards, the paper's rule keeps S at 4.88 for 10,000 clean steps; headroom
    growth restores it at the first check to the largest power of two that leaves room for
    4·max|S·g| (16,376 / 4.88 -> 2^11: S = 1e4), and a bigger gradient (|g| = 100) lets it grow
    only to 4·|S·g| <= 65,504 (S = 156.25). No step overflows on the way."""

    def run(headroom: bool, magnitude: float, clean_steps: int) -> tuple[CompoundLossScaler, HAdam]:
        param = torch.zeros(4, dtype=F16, requires_grad=True)
        opt = HAdam([param], lr=1e-3, eps=1e-4, capturable=sync_free)
        interval = 20 if headroom else 10_000  # the paper's interval for its rule
        scaler = CompoundLossScaler(init_scale=1e4, growth_interval=interval, headroom_growth=headroom)
        for _ in range(11):
            param.grad = torch.full((4,), float("inf"), dtype=F16)
            scaler.step(opt)
        for step in range(clean_steps):
            scale = float(scaler.scale)
            param.grad = (torch.tensor([1.0, -0.5, 0.25, -1.0]) * magnitude * scale).to(F16)
            assert bool(torch.isfinite(param.grad).all()), (step, scale)
            scaler.step(opt)
        return scaler, opt

    published, _ = run(False, 1.0, 60)
    assert float(published.scale) == pytest.approx(1e4 * 0.5**11) and published.skipped_steps == 11
    grown, opt = run(True, 1.0, 60)
    assert float(grown.scale) == pytest.approx(1e4) and grown.skipped_steps == 11
    peak = float(opt.state[opt.param_groups[0]["params"][0]]["exp_avg_root"].float().abs().max())
    assert peak < 65504 / 1.1  # the grown root moment keeps the growth check's margin
    large, _ = run(True, 100.0, 60)
    assert float(large.scale) == pytest.approx(1e4 * 0.5**11 * 2**5) and large.skipped_steps == 11


@pytest.mark.parametrize("sync_free", [False, True], ids=["host", "sync-free"])
def test_headroom_growth_keeps_the_scale_within_the_scaled_losss_dtype(sync_free):
    """The full-size fp16 agent's temperature: an fp16 loss α·mean(c) whose scaled gradient
    α·mean(c)·S fills 3% of fp16's range at S = 4e4. The gradients leave room for ×8, but S is
    the backward's first gradient and an fp16 loss holds no S past 65,504: grown to 3.2e5, every
    step overflows (three skips back to 4e4 after each check, as the runs logged: 12 skips in
    these 60 steps before the limit). Headroom growth stops at 4e4 with no step skipped; the same
    loss computed in float32 may grow past 65,504, where only the fp16 gradients bound S."""

    def run(loss_dtype: torch.dtype, steps: int) -> CompoundLossScaler:
        log_alpha = torch.tensor(-3.0, dtype=F16, requires_grad=True)  # α ≈ 0.05
        opt = HAdam([log_alpha], lr=1e-4, eps=1e-4, capturable=sync_free)
        scaler = CompoundLossScaler(init_scale=1e4, growth_interval=10, headroom_growth=True)
        gap = torch.tensor([1.5, 0.5, 1.2, 0.8], dtype=loss_dtype)  # -log π - target entropy
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = (log_alpha.to(loss_dtype).exp() * gap).mean()
            scaler.scale_loss(loss).backward()
            scaler.step(opt)
        return scaler

    fp16_loss = run(F16, 60)
    assert float(fp16_loss.scale) == pytest.approx(4e4)  # ×4 at the first check, then no room
    assert fp16_loss.skipped_steps == 0
    fp32_loss = run(torch.float32, 60)
    assert float(fp32_loss.scale) > 65504 and fp32_loss.skipped_steps == 0


@pytest.mark.parametrize("dtype", [F16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("margin", [1.1 * 0.9005, 1.0, 1.5, 2.0])
def test_the_overflow_flag_read_from_the_peaks_decides_as_the_elementwise_check(dtype, margin):
    """One pass (each gradient's peak, then ``margin·max|g|``) flags exactly the gradient sets
    whose ``margin·g`` the elementwise check (:meth:`found_inf`) finds non-finite: values at and
    around the largest one the margin leaves finite, infinities of either sign, NaN, zeros."""
    largest = torch.finfo(dtype).max
    near = [largest / margin * f for f in (0.999, 1.0, 1.001)] + [largest, largest * 0.5001]
    specials = [float("inf"), float("-inf"), float("nan"), 0.0]
    gen = torch.Generator().manual_seed(0)
    cases, decided = 0, set()
    for value in near + specials:
        for sign in (1.0, -1.0):
            params = [
                torch.zeros(5, dtype=dtype, requires_grad=True),
                torch.zeros(2, 3, dtype=dtype, requires_grad=True),
            ]
            params[0].grad = (torch.randn(5, generator=gen) * 100).to(dtype)
            params[1].grad = torch.zeros(2, 3, dtype=dtype)
            params[1].grad[1, 2] = torch.tensor(sign * value).to(dtype)
            scaler = CompoundLossScaler(overflow_margin=margin)
            opt = HAdam(params, lr=1e-3)
            found, peaks, peak = scaler._check_gradients(opt)
            assert peak is not None and peaks.shape == (2,)
            assert torch.equal(found, scaler.found_inf(opt)), (value, sign)
            cases += 1
            decided.add(float(found))
    assert cases == 2 * len(near + specials) and decided == {0.0, 1.0}


def test_gradients_of_two_dtypes_are_checked_elementwise():
    params = [torch.zeros(3, dtype=F16, requires_grad=True), torch.zeros(3, dtype=torch.float32, requires_grad=True)]
    params[0].grad = torch.ones(3, dtype=F16)
    params[1].grad = torch.tensor([1.0, 7e4, 0.0])  # finite in fp32, past fp16's range
    scaler = CompoundLossScaler()
    found, _, peak = scaler._check_gradients(torch.optim.Adam(params, lr=1e-3))
    assert peak is None and float(found) == 0.0


@pytest.mark.parametrize("backoff", [0.5, 0.3])
def test_the_sync_free_rescale_of_fp16_moments_is_one_multi_tensor_op_when_the_backoff_is_exact(backoff):
    """A skipped sync-free step multiplies every moment by the backoff: with 0.5 (exact in fp16)
    the factor goes in the moments' dtype and CUDA's one-kernel route takes the list (the counter
    models it); with 0.3 it stays fp32, rounded once per product, and CUDA loops per tensor. The
    bits are the fp32 factor's either way (tested against it)."""
    from pixelsac.perf.opcount import DispatchCount

    def run(state_factor: bool):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s).half()) for s in ((4, 3), (3,), (2, 2))]
        opt = HAdam(params, lr=1e-3, capturable=True, unbiased_moments=True, eps=1e-4)
        scaler = CompoundLossScaler(init_scale=2.0**10, backoff_factor=backoff)
        if not state_factor:  # the float32 factor
            opt._backoff_factor = lambda taken, backoff: torch.where(taken, 1.0, backoff)
        counts = []
        for step in range(4):
            for p in params:
                p.grad = torch.randn_like(p) * (float("inf") if step == 2 and p is params[0] else 1.0)
            with DispatchCount() as count:
                scaler.step(opt)
            counts.append(count)
        return params, opt, counts

    params, opt, counts = run(True)
    reference, ref_opt, _ = run(False)
    for a, b in zip(params, reference):
        assert torch.equal(a.detach(), b.detach())
        for key in ("exp_avg", "exp_avg_root"):
            assert torch.equal(opt.state[a][key], ref_opt.state[b][key])
    assert float(opt.state[params[0]]["step"]) == 3.0  # the skip happened
    looped = [dict(c.per_tensor) for c in counts]
    if backoff == 0.5:
        assert looped == [{}] * 4, looped
    else:
        assert all(c.get("aten._foreach_mul_.Tensor") == 6 for c in looped), looped


@pytest.mark.parametrize("headroom", [True, False], ids=["headroom-growth", "published-growth"])
@pytest.mark.parametrize("compiled_hadam", [True, False], ids=["compiled-hadam", "eager-hadam"])
def test_the_compiled_bookkeeping_is_the_eager_one_bit_for_bit(compiled_hadam, headroom):
    """``CompoundLossScaler(compiled=True)`` (``fused_scaler.py``): 40 sync-free steps with
    overflowing gradients, a state overflow and growth checks along the way leave the scale, every
    count and record and the optimizer exactly as the eager bookkeeping does, and as the scaler
    that decides on the host (its own code: the reference for both); the bookkeeping is one op."""
    from pixelsac.perf.opcount import DispatchCount

    def run(compiled: bool, sync_free: bool = True):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s).half()) for s in ((4, 3), (3,), (2, 2))]
        opt = HAdam(params, lr=1e-3, capturable=sync_free, unbiased_moments=True, eps=1e-4, compiled=compiled_hadam)
        scaler = CompoundLossScaler(init_scale=2.0**12, growth_interval=5, headroom_growth=headroom, compiled=compiled)
        counts, records = None, []
        for step in range(40):
            for p in params:
                p.grad = torch.randn_like(p) * 2.0**10
            if step in (3, 4, 17):
                params[0].grad[0, 0] = float("inf")
            if step == 25:
                opt.state[params[1]]["exp_avg_root"][0] = 65504.0
                params[1].grad[0] = 6e4
            with DispatchCount(sites=False) as count:
                scaler.step(opt)
            counts = count
            kept = (scaler._grad_peak, scaler._skipped_peaks, scaler._interval_peak)
            records.append((scaler.state_dict(), [None if t is None else t.clone() for t in kept]))
        return params, opt, scaler, counts, records

    params, opt, scaler, count, records = run(True)
    ref_params, ref_opt, ref_scaler, ref_count, ref_records = run(False)
    *_, host_records = run(False, sync_free=False)
    for step, ((state, kept), (ref_state, ref_kept), (host_state, host_kept)) in enumerate(
        zip(records, ref_records, host_records)
    ):
        assert state == ref_state == host_state, step
        for mine, theirs, host in zip(kept, ref_kept, host_kept):
            assert (mine is None) == (theirs is None) == (host is None), step
            assert mine is None or torch.equal(mine, theirs) and torch.equal(mine, host), step
    assert scaler.state_dict() == ref_scaler.state_dict()
    assert ref_scaler.skipped_steps >= 4 and scaler.scale != 2.0**12  # skips and growth happened
    for a, b in zip(params, ref_params):
        assert torch.equal(a.detach(), b.detach())
        for key in ("exp_avg", "exp_avg_root", "step"):
            assert torch.equal(opt.state[a][key], ref_opt.state[b][key]), key
    for name in ("_grad_peak", "_skipped_peaks", "_interval_peak"):
        mine, theirs = getattr(scaler, name), getattr(ref_scaler, name)
        assert (mine is None) == (theirs is None) and (mine is None or torch.equal(mine, theirs)), name
    assert count.ops["pixelsac_lowp.scaler_after_step.default"] == 1
    assert count.ops["pixelsac_lowp.gradient_verdict.default"] == 1
    assert count.kernels < ref_count.kernels


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
        ),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_compiled_gradient_verdict_is_the_eager_one(dtype, device):
    """The check before a step, compiled (one op) and eager (stack, max, product, select), equal
    bit for bit: with the paper's margin (below 1, so only a non-finite peak fails: the largest
    finite one passes, inf and NaN do not) and with a margin of 2, where the line falls inside the
    range (half the largest number passes, the next number above it does not); one gradient too.
    Bit for bit on CUDA as well (triton kernels): the verdict multiplies and compares, and holds
    no division, the one fp32 operation Triton lowers to an approximation there."""
    from pixelsac.lowp import fused_scaler

    big = torch.tensor(torch.finfo(dtype).max, dtype=dtype)
    half, two, inf, nan = (
        big / 2,
        torch.tensor(2.0, dtype=dtype),
        torch.tensor(float("inf"), dtype=dtype),
        torch.tensor(float("nan"), dtype=dtype),
    )
    past_half = torch.nextafter(half, big)
    one = torch.ones(())
    cases = [  # (margin, peaks, expected found_inf)
        (1.1 * 0.9005, [torch.zeros((), dtype=dtype)], 0.0),
        (1.1 * 0.9005, [two, big, two], 0.0),
        (1.1 * 0.9005, [inf, two], 1.0),
        (1.1 * 0.9005, [two, nan], 1.0),
        (2.0, [two, half], 0.0),
        (2.0, [past_half, two], 1.0),
    ]
    one = one.to(device)
    for margin, norms, expected in cases:
        norms = [norm.to(device) for norm in norms]
        eager = fused_scaler.verdict(norms, margin, one)
        compiled = fused_scaler.gradient_verdict(norms, margin, one)
        for mine, theirs in zip(compiled, eager):  # bit for bit, NaN where NaN
            assert mine.dtype == theirs.dtype and torch.allclose(mine, theirs, rtol=0, atol=0, equal_nan=True)
        assert float(eager[2]) == expected, (margin, norms)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_compiled_bookkeeping_replays_in_a_cuda_graph():
    """The compiled bookkeeping (triton kernels) captured in a CUDA graph with hAdam's step and
    replayed: the scale backs off on a replay whose gradients overflow, the counts move on the
    device, and nothing is read on the host inside."""
    device = torch.device("cuda")
    params = [torch.nn.Parameter(torch.randn(s, device=device).half()) for s in ((4, 3), (3,))]
    opt = HAdam(params, lr=1e-3, capturable=True, unbiased_moments=True, eps=1e-4, compiled=True)
    scaler = CompoundLossScaler(init_scale=2.0**12, headroom_growth=True, compiled=True)
    grads = [torch.randn_like(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    for _ in range(3):  # warm-up: state, constants and compiled graphs made before the capture
        scaler.step(opt)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        scaler.step(opt)  # (its host half left out: see graph_capturing)
    scale = float(scaler._device_counts["scale"])
    grads[0].fill_(float("inf"))
    graph.replay()
    torch.cuda.synchronize()
    assert float(scaler._device_counts["scale"]) == scale * scaler.backoff_factor
    assert int(scaler._device_counts["skipped_steps"]) >= 1
