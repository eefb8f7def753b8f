"""hAdam's optimizer state against float64 Adam over long runs (``unbiased_moments``; beyond the paper).

The published arithmetic rounds every op to the parameter dtype; over thousands of steps at
β2 = 0.999 its root moment runs biased (fp16: low, so steps are too large; bf16: it can stall
high), and a large but finite gradient can overflow it for good. These tests hold the fp16 (with
compound loss scaling) and bf16 optimizers against float64 torch Adam on three gradient streams,
show the published arithmetic outside the band, and reproduce the freeze.
"""

from __future__ import annotations

import math

import pytest
import torch

from pixelsac.lowp import CompoundLossScaler, HAdam
from pixelsac.lowp.rounding import mix_key, random_bits, stochastic_round

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
BETAS = (0.9, 0.999)
ROOT_FACTOR = (1 - BETAS[0]) / math.sqrt(1 - BETAS[1])  # s ≈ ROOT_FACTOR·sqrt(v): ε_adam = ε / ROOT_FACTOR
STEPS, WEIGHTS, LR = 5000, 384, 1e-4
BAND = (0.95, 1.05)


def gradient_stream(kind: str, seed: int = 0):
    """Per-weight gradient scales over three decades (1e-4..1e-1) with a drift, so every weight
    travels: Gaussian noise, Student-t (3 dof) noise, or Gaussian noise with rare 100x spikes."""
    gen = torch.Generator().manual_seed(seed)
    scale = 10 ** (-4 + 3 * torch.rand(WEIGHTS, generator=gen, dtype=F64))

    def draw() -> torch.Tensor:
        noise = torch.randn(WEIGHTS, generator=gen, dtype=F64)
        if kind == "heavy":
            chi2 = sum(torch.randn(WEIGHTS, generator=gen, dtype=F64) ** 2 for _ in range(3))
            noise = noise / torch.sqrt(chi2 / 3)
        grad = scale * (0.3 + noise)
        if kind == "spikes":
            grad = torch.where(torch.rand(WEIGHTS, generator=gen, dtype=F64) < 2e-3, 100 * grad, grad)
        return grad

    return draw


def start_weights(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return (2 * torch.rand(WEIGHTS, generator=gen, dtype=F64) - 1).to(dtype)


def displacement_ratio(kind: str, dtype: torch.dtype, unbiased: bool, compiled: bool = False) -> float:
    """Median over weights of (p_T - p_0) / (p_T - p_0)_float64 after STEPS steps.

    fp16 goes through the compound loss scaler (S₀ = 1e4, ε = 1e-4 in ×S units): the scaled
    gradient enters hAdam and skipped steps are skipped in the reference too. bf16 has fp32's
    range and runs unscaled with ε = 1e-8. The reference is torch Adam in float64 on the
    unscaled gradients with ε_adam = (ε/S) / ROOT_FACTOR, hAdam's docstring mapping."""
    scaled = dtype == F16
    eps = 1e-4 if scaled else 1e-8
    low = start_weights(dtype).requires_grad_()
    ref = low.detach().to(F64).requires_grad_()
    start = ref.detach().clone()
    opt = HAdam([low], lr=LR, betas=BETAS, eps=eps, kahan=True, unbiased_moments=unbiased, seed=3, compiled=compiled)
    init_scale = 1e4 if scaled else 1.0
    ref_opt = torch.optim.Adam([ref], lr=LR, betas=BETAS, eps=eps / init_scale / ROOT_FACTOR)
    scaler = CompoundLossScaler(init_scale=init_scale) if scaled else None
    draw = gradient_stream(kind)
    for _ in range(STEPS):
        grad = draw()
        if scaler is not None:
            low.grad = (grad * scaler.scale).to(dtype)
            taken = scaler.step(opt)
        else:
            low.grad = grad.to(dtype)
            opt.step()
            taken = not bool(opt.state_overflow)
        if taken:
            ref.grad = grad
            ref_opt.step()
    assert torch.isfinite(low).all()
    travelled = ref.detach() - start
    return float(((low.detach().to(F64) - start) / travelled).median())


@pytest.mark.parametrize("kind", ["gaussian", "heavy", "spikes"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16-scaled", "bf16"])
def test_unbiased_moments_track_float64_adam_and_the_published_arithmetic_does_not(kind, dtype):
    unbiased = displacement_ratio(kind, dtype, unbiased=True)
    published = displacement_ratio(kind, dtype, unbiased=False)
    assert BAND[0] <= unbiased <= BAND[1], (unbiased, published)
    # Measured here: unbiased 0.998-1.000 on every stream; published fp16 1.29 (gaussian), 1.23
    # (heavy), 1.19 (spikes): s runs low; bf16 1.23, 0.94 (s stalls high after large draws), 0.74.
    assert not BAND[0] <= published <= BAND[1], (unbiased, published)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_gradient_handed_to_hadam_itself_is_not_applied(bad):
    """Without a scaler in front, hAdam's own overflow check (the float32 path reduces the new
    root moment to its maximum) must see a NaN as well as an inf: no step, the state unchanged."""
    param = torch.full((5,), 0.5, dtype=F16, requires_grad=True)
    opt = HAdam([param], lr=1e-3, eps=1e-4, kahan=True, unbiased_moments=True)
    param.grad = torch.ones(5, dtype=F16)
    opt.step()
    before = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[param].items()}
    weights = param.detach().clone()
    param.grad = torch.tensor([0.1, bad, 0.2, 0.3, 0.4], dtype=F16)
    opt.step()
    assert bool(opt.state_overflow)
    assert torch.equal(param.detach(), weights)
    for key, value in opt.state[param].items():
        assert torch.equal(value, before[key]) if torch.is_tensor(value) else value == before[key], key


def test_a_finite_gradient_that_would_overflow_the_root_moment_is_a_skip_not_a_freeze():
    """The freeze of the published arithmetic: a true gradient of 2.5 at S = 1e4 is 2.5e4 in fp16,
    finite, but s (≈3.16·|g| at steady state) and the step-1 denominator (s/sqrt(1-β2) = 3.16·|g|)
    are not. Counted as taken, the step moved nothing and s stayed inf for good."""
    for unbiased in (False, True):
        for capturable in (False, True):
            param = torch.zeros(3, dtype=F16, requires_grad=True)
            opt = HAdam([param], lr=1e-3, eps=1e-4, kahan=True, capturable=capturable, unbiased_moments=unbiased)
            scaler = CompoundLossScaler()
            for _ in range(400):
                param.grad = None
                scaler.scale_loss((2.5 * param).sum()).backward()
                scaler.step(opt)
            # float64 Adam on a constant gradient moves every step by lr: 0.4 in all
            moved = -param.detach().to(F64)
            assert (moved >= 0.5 * 0.4).all() and (moved <= 1.2 * 0.4).all(), (unbiased, capturable, moved)
            assert torch.isfinite(opt.state[param]["exp_avg_root"]).all()
            if not unbiased:  # the published step-1 denominator overflows at S = 1e4: one backoff
                assert scaler.skipped_steps >= 1 and scaler.scale <= 5e3


def test_the_published_root_moment_overflow_is_skipped_and_backed_off_step_by_step():
    param = torch.zeros(2, dtype=F16, requires_grad=True)
    opt = HAdam([param], lr=1e-3, eps=1e-4)
    scaler = CompoundLossScaler(init_scale=1.0)
    param.grad = torch.full((2,), 3e4, dtype=F16)  # finite; 0.1·3e4/sqrt(1-β2) = 9.5e4 is not
    before = param.detach().clone()
    assert not scaler.step(opt)
    assert bool(opt.state_overflow) and scaler.skipped_steps == 1 and scaler.scale == 0.5
    assert torch.equal(param.detach(), before) and opt.state[param]["step"] == 0
    assert torch.equal(opt.state[param]["exp_avg_root"], torch.zeros(2, dtype=F16))


def test_a_steady_gradient_past_the_root_moment_range_backs_off_until_it_fits():
    """|g| = 3e4 every step: s would settle at 9.5e4 > 65504. Published, it became inf and froze
    the weight; now the scaler halves S until s fits, and the weight keeps moving."""
    for unbiased in (False, True):
        param = torch.zeros(2, dtype=F16, requires_grad=True)
        opt = HAdam([param], lr=1e-3, eps=1e-4, unbiased_moments=unbiased)
        scaler = CompoundLossScaler(init_scale=1.0)
        positions = []
        for _ in range(1500):  # s = 3.16·|g|·sqrt(1 - β2^t) passes 65504 near t = 650
            param.grad = torch.full((2,), 3e4 * scaler.scale, dtype=F16)
            scaler.step(opt)
            positions.append(float(param.detach()[0]))
        assert scaler.scale <= 0.5 and torch.isfinite(opt.state[param]["exp_avg_root"]).all()
        assert positions[-1] < positions[-100] < positions[700] < positions[50] < 0  # still moving at the end


def test_sync_free_state_overflow_is_decided_on_the_device_like_the_host():
    results = {}
    for capturable in (False, True):
        param = torch.zeros(2, dtype=F16, requires_grad=True)
        opt = HAdam([param], lr=1e-3, eps=1e-4, capturable=capturable, unbiased_moments=True)
        scaler = CompoundLossScaler(init_scale=1.0)
        for value in (100.0, 3e4, 3e4, 100.0):
            param.grad = torch.full((2,), value * float(scaler.scale), dtype=F16)
            scaler.step(opt)
        results[capturable] = (param.detach().clone(), scaler.scale, scaler.skipped_steps, scaler.taken_steps)
        if capturable:
            assert torch.is_tensor(opt.state_overflow)
    assert torch.equal(results[False][0], results[True][0]) and results[False][1:] == results[True][1:]


# ------------------------------------------------------------------------- the arithmetic itself
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour(dtype):
    value = torch.tensor(1.0 + 2**-13 + 2**-15, dtype=F32)  # between 1 and the next fp16/bf16 number
    rounded = stochastic_round(value.expand(200_000).contiguous(), dtype, key=mix_key(1, 2))
    above = torch.nextafter(torch.tensor(1.0, dtype=dtype), torch.tensor(2.0, dtype=dtype))
    assert set(rounded.unique().tolist()) == {1.0, float(above)}
    expected = (float(value) - 1.0) / (float(above) - 1.0)
    assert abs(float((rounded == above).double().mean()) - expected) < 4e-3
    # round to nearest always gives 1.0 here: the bias the moments suffered from
    assert float(value.to(dtype)) == 1.0
    negative = stochastic_round(-value.expand(200_000).contiguous(), dtype, key=mix_key(1, 3))
    assert abs(float(negative.double().mean()) + float(value)) < 4e-3 * (float(above) - 1.0) + 1e-9


def test_stochastic_rounding_is_a_function_of_key_and_index_only():
    x = torch.rand(1000, dtype=F32)
    a = stochastic_round(x, F16, key=5)
    assert torch.equal(a, stochastic_round(x.clone(), F16, key=5))
    assert not torch.equal(a, stochastic_round(x, F16, key=6))
    assert torch.equal(stochastic_round(x[300:], F16, key=5, offset=300), a[300:])
    assert torch.equal(random_bits(8, torch.tensor(9.0), 13, "cpu"), random_bits(8, mix_key(9) * 0 + 9, 13, "cpu"))
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 65504.0, 7e4, 0.0])
    out = stochastic_round(special, F16, key=1)
    assert out[0] == float("inf") and out[1] == -float("inf") and out[2].isnan()
    assert out[3] == 65504.0 and out[4] == float("inf") and out[5] == 0.0


def test_unbiased_step_is_deterministic_and_resumes_bitwise():
    def run(steps: int, resume_at: int | None = None) -> tuple[torch.Tensor, dict]:
        gen = torch.Generator().manual_seed(0)
        param = torch.linspace(-1, 1, 50, dtype=BF16).requires_grad_()
        opt = HAdam([param], lr=1e-3, eps=1e-8, unbiased_moments=True, seed=11)
        for step in range(steps):
            if step == resume_at:
                saved = {k: v.clone() for k, v in opt.state_dict()["state"][0].items() if torch.is_tensor(v)}
                saved_step = opt.state_dict()["state"][0]["step"]
                weights = param.detach().clone()
                param = weights.clone().requires_grad_()
                opt = HAdam([param], lr=1e-3, eps=1e-8, unbiased_moments=True, seed=11)
                opt.load_state_dict(
                    {
                        "state": {0: {**saved, "step": saved_step}},
                        "param_groups": [{**opt.state_dict()["param_groups"][0]}],
                    }
                )
            param.grad = torch.randn(50, generator=gen).to(BF16)
            opt.step()
        return param.detach(), opt.state[param]

    straight, state = run(40)
    resumed, resumed_state = run(40, resume_at=17)
    assert torch.equal(straight, resumed)
    assert torch.equal(state["exp_avg_root"], resumed_state["exp_avg_root"])


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("kahan", [True, False])
@pytest.mark.parametrize("capturable", [False, True])
def test_unbiased_step_is_the_same_whatever_the_packing(dtype, kahan, capturable):
    """Packing parameters into shared float32 workspaces (and splitting large ones) is only an
    execution detail: one pass per element (chunk 1), a tensor per pack, several tensors per
    pack and everything in one pack give the same weights and state bit for bit -- with a
    parameter that misses gradients (its own step count), channels-last weights and a skipped
    step."""
    results = []
    for chunk in (1 << 20, 1, 7, 40):
        gen = torch.Generator().manual_seed(0)
        shapes = [(4, 3, 3, 3), (4,), (5, 6), (3,), ()]
        params = [torch.randn(shape, generator=gen).to(dtype) for shape in shapes]
        params[0] = params[0].to(memory_format=torch.channels_last)
        params = [p.requires_grad_() for p in params]
        opt = HAdam(
            params,
            lr=1e-3,
            eps=1e-4,
            kahan=kahan,
            capturable=capturable,
            unbiased_moments=True,
            seed=5,
            chunk_numel=chunk,
        )
        for step in range(6):
            for i, p in enumerate(params):
                grad = (torch.randn(p.shape, generator=gen) * 50).to(dtype)
                p.grad = None if (i == 2 and step % 2) else grad.to(memory_format=torch.preserve_format)
            if capturable:
                opt.step(found_inf=torch.tensor(float(step == 3)))
            else:
                opt.step()
        results.append(
            [p.detach().clone() for p in params]
            + [opt.state[p][k].clone() for p in params for k in ("exp_avg", "exp_avg_root")]
            + [torch.as_tensor(opt.state[p]["step"]).clone() for p in params]
        )
    assert results[0][-3] != results[0][-1]  # the parameter without some gradients lags behind
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@pytest.mark.parametrize("kahan", [True, False])
def test_the_kept_views_follow_parameters_and_state_given_new_storage(kahan):
    """hAdam keeps its flat views of parameters and state between steps (a view is an op a GPU
    step pays for); a parameter given new storage in another memory format, a parameter given a
    copy of itself and a replaced state tensor must be read and written where they are now: the
    same weights and state, bit for bit, as a run where nothing moved."""
    results = []
    for move in (False, True):
        gen = torch.Generator().manual_seed(0)
        shapes = [(4, 3, 3, 3), (5, 6), ()]
        params = [torch.randn(shape, generator=gen).to(F16).requires_grad_() for shape in shapes]
        opt = HAdam(params, lr=1e-3, eps=1e-4, kahan=kahan, capturable=True, unbiased_moments=True, chunk_numel=None)
        for step in range(5):
            if move and step == 2:
                params[0].data = params[0].data.to(memory_format=torch.channels_last)
                params[1].data = params[1].data.clone()
                opt.state[params[2]]["exp_avg"] = opt.state[params[2]]["exp_avg"].clone()
            for p in params:
                p.grad = (torch.randn(p.shape, generator=gen) * 50).to(F16).to(memory_format=torch.preserve_format)
            opt.step(found_inf=torch.tensor(0.0))
        results.append(
            [p.detach().contiguous() for p in params]
            + [opt.state[p][k].contiguous() for p in params for k in ("exp_avg", "exp_avg_root")]
        )
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_a_step_after_the_first_makes_views_of_the_gradients_only():
    """The parameters and state live in flat buffers made once (cut with ``as_strided``, not
    viewed): every step, the first too, views each gradient and makes the three views of the
    paired rounding of root moments and weights (the stacked pair flattened, its noise flattened,
    the result shaped back), whatever the number of parameters."""
    from dispatch_count import DispatchCount

    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=gen).to(F16).requires_grad_() for shape in [(4, 3), (5,), (2, 2, 2)]]
    opt = HAdam(params, lr=1e-3, capturable=True, unbiased_moments=True, chunk_numel=None)
    views = []
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(F16)
        with DispatchCount() as count:
            opt.step(found_inf=torch.tensor(0.0))
        views.append(count.ops["aten.view.default"])
    assert views == [len(params) + 3] * 3, views


def test_two_tensors_of_the_same_elements_rounded_in_one_call_are_two_calls():
    """hAdam rounds its root moments and (without Kahan buffers) its weights in one call: rows of
    a ``(2, n)`` tensor with a key per row (``(2, 1)``: one stream each) or per element
    (``(2, n)``: several parameters' streams), over one counter of ``n``. Each row gets the bits
    of its own call; swapping the keys changes them."""
    gen = torch.Generator().manual_seed(2)
    rows = torch.randn(2, 500, generator=gen)
    counter = torch.arange(500, dtype=torch.int32).flip(0)  # any element order: a channels-last read
    keys = torch.tensor([mix_key(5, 6), mix_key(7, 8)], dtype=torch.int64)
    per_element = torch.stack([torch.randint(0, 2**31, (500,), generator=gen) for _ in range(2)]).to(torch.int32)
    for dtype in (F16, BF16):
        for key in (keys.view(2, 1), per_element):
            together = stochastic_round(rows, dtype, key, counter=counter)
            apart = torch.stack([stochastic_round(rows[r], dtype, key[r].squeeze(), counter=counter) for r in range(2)])
            assert together.shape == rows.shape and torch.equal(together, apart)
            assert not torch.equal(together, stochastic_round(rows, dtype, key.flip(0), counter=counter))


def test_stochastic_rounding_of_several_streams_in_one_call_is_one_call_per_stream():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(300, generator=gen)
    keys, parts = [mix_key(1, 2), mix_key(3, torch.tensor(4.0)), 2**32 - 1], [(0, 100), (100, 250), (250, 300)]
    counter = torch.cat([torch.arange(b - a) + 7 for a, b in parts])
    per_element = torch.cat(
        [torch.full((b - a,), int(k) & 0xFFFFFFFF, dtype=torch.int64) for k, (a, b) in zip(keys, parts)]
    )
    for dtype in (F16, BF16):
        together = stochastic_round(x, dtype, per_element, counter=counter)
        apart = torch.cat([stochastic_round(x[a:b], dtype, k, offset=7) for k, (a, b) in zip(keys, parts)])
        assert torch.equal(together, apart)
        assert not torch.equal(together, stochastic_round(x, dtype, per_element + 1, counter=counter))


def test_random_bits_match_the_hash_written_in_exact_integers():
    """The wrapping int32 arithmetic equals lowbias32 computed on Python integers."""

    def lowbias32(v: int) -> int:
        v ^= v >> 16
        v = (v * 0x7FEB352D) & 0xFFFFFFFF
        v ^= v >> 15
        v = (v * 0x846CA68B) & 0xFFFFFFFF
        return v ^ (v >> 16)

    for key in (0, 9, 2**31 + 5, 2**32 - 1):
        bits = random_bits(50, key, 13, "cpu", offset=2**20)
        expected = [
            (lowbias32(lowbias32((i * 0x27D4EB2F + key) & 0xFFFFFFFF)) >> 8) & 0x1FFF for i in range(2**20, 2**20 + 50)
        ]
        assert bits.tolist() == expected


def test_channels_last_parameters_step_like_contiguous_ones():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 3, 3, 3, generator=gen).to(F16)
    grads = [torch.randn(4, 3, 3, 3, generator=gen).to(F16) for _ in range(4)]
    outs = []
    for layout in (torch.contiguous_format, torch.channels_last):
        param = weight.clone().to(memory_format=layout).requires_grad_()
        opt = HAdam([param], lr=1e-3, eps=1e-4, unbiased_moments=True)
        for g in grads:
            param.grad = g.clone().to(memory_format=layout)
            opt.step()
        outs.append(param.detach().contiguous())
    # the random bits follow memory order, so only the distribution is shared; the RN parts agree
    assert (outs[0].double() - outs[1].double()).abs().max() < 5e-3


def test_unbiased_moments_leave_float32_and_float64_untouched():
    for dtype in (F32, F64):
        results = []
        for unbiased in (False, True):
            param = torch.linspace(-1, 1, 9, dtype=dtype).requires_grad_()
            opt = HAdam([param], lr=1e-2, eps=1e-8, unbiased_moments=unbiased)
            for step in range(5):
                param.grad = torch.full((9,), 0.1 * (step + 1), dtype=dtype)
                opt.step()
            results.append(param.detach())
        assert torch.equal(*results)
