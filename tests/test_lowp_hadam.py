"""hAdam (spec §1) and Kahan-gradients (§3): failure modes 1 and 5 of §7, against float64."""

from __future__ import annotations

import io
import math

import pytest
import torch

from pixelsac.lowp import HAdam, KahanAdam, kahan_add_

F16, F64 = torch.float16, torch.float64
BETAS = (0.9, 0.999)
# ε_adam = ε·sqrt(1-β2)/(1-β1): hAdam's s is c·sqrt(v) with c = (1-β1)/sqrt(1-β2) ≈ 3.162.
ROOT_FACTOR = (1 - BETAS[0]) / math.sqrt(1 - BETAS[1])


def fp16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of fp16 numbers at |x| (normal range), in float64."""
    x = x.double().abs()
    return torch.exp2(torch.floor(torch.log2(x)) - 10)


def run_optimizer(make_opt, params: list[torch.Tensor], grads_per_step: list[list[torch.Tensor]]):
    opt = make_opt(params)
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.to(p.dtype)
        opt.step()
    return opt


# ---------------------------------------------------------------- exact-arithmetic equivalence
def test_hadam_equals_adam_with_mapped_eps_in_float64():
    gen = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (7,)]
    init = [torch.randn(s, generator=gen, dtype=F64) for s in shapes]
    # A per-coordinate drift, so each coordinate travels far (not a random walk that
    # returns near its start, which would make a relative comparison meaningless).
    drift = [torch.where(torch.rand(s, generator=gen) < 0.5, -1.0, 1.0).double() for s in shapes]
    steps = []
    for _ in range(300):
        # Magnitudes spread over two decades, never tiny compared with ε = 1e-8.
        mag = 10 ** (-2 * torch.rand((), generator=gen, dtype=F64))
        steps.append([mag * (d + torch.randn(s, generator=gen, dtype=F64)) for s, d in zip(shapes, drift)])
    eps = 1e-8
    hadam_params = [p.clone().requires_grad_() for p in init]
    adam_params = [p.clone().requires_grad_() for p in init]
    hadam = run_optimizer(lambda ps: HAdam(ps, lr=1e-3, betas=BETAS, eps=eps), hadam_params, steps)
    adam = run_optimizer(
        lambda ps: torch.optim.Adam(ps, lr=1e-3, betas=BETAS, eps=eps / ROOT_FACTOR),
        adam_params,
        steps,
    )
    for p0, ph, pa in zip(init, hadam_params, adam_params):
        moved_h, moved_a = ph.detach() - p0, pa.detach() - p0
        assert moved_a.abs().min() > 0.05  # the trajectories really went somewhere
        torch.testing.assert_close(moved_h, moved_a, rtol=1e-6, atol=0)
        sh, sa = hadam.state[ph], adam.state[pa]
        assert sh["step"] == 300 and isinstance(sh["step"], int)
        torch.testing.assert_close(sh["exp_avg"], sa["exp_avg"], rtol=1e-9, atol=0)
        torch.testing.assert_close(sh["exp_avg_root"], ROOT_FACTOR * sa["exp_avg_sq"].sqrt(), rtol=1e-6, atol=0)
        assert "exp_avg_sq" not in sh


def test_hadam_eps_maps_to_adam_eps_over_root_factor():
    # At t=1 the hypot ratio is 0/(M+ε) = 0 exactly, so ε acts only in the denominator:
    # a large ε makes the mapping ε_adam = ε/3.162 visible far above rounding.
    g = torch.tensor([0.3, -0.02, 1e-3], dtype=F64)
    eps = 1e-2

    def first_step(make_opt):
        p = torch.zeros(3, dtype=F64, requires_grad=True)
        p.grad = g.clone()
        make_opt([p]).step()
        return p.detach()

    hadam = first_step(lambda ps: HAdam(ps, lr=1e-3, eps=eps))
    mapped = first_step(lambda ps: torch.optim.Adam(ps, lr=1e-3, eps=eps / ROOT_FACTOR))
    unmapped = first_step(lambda ps: torch.optim.Adam(ps, lr=1e-3, eps=eps))
    torch.testing.assert_close(hadam, mapped, rtol=1e-12, atol=0)
    assert (hadam - unmapped).abs().max() > 1e-5


# ------------------------------------------------------------------------- failure mode 1
def test_torch_adam_fp16_second_moment_underflows_and_overflows():
    """Measured on this CPU (torch 2.13): the fused addcmul computes (1-β2)·g·g in fp32 and
    rounds once, so v flushes to 0 at |g| = 1e-4 and overflows at |g| = 8200 (> 65504 / 1e-3).
    With v = 0 and ε = 1e-8 (which is 0 in fp16) the very first step divides m by 0."""
    for magnitude, v_expected in [(1e-4, 0.0), (8200.0, math.inf)]:
        p = torch.zeros(4, dtype=F16, requires_grad=True)
        opt = torch.optim.Adam([p], lr=1e-3, betas=BETAS, eps=1e-8)
        p.grad = torch.full((4,), magnitude, dtype=F16)
        opt.step()
        v = opt.state[p]["exp_avg_sq"]
        assert (v == v_expected).all(), (magnitude, v)
        if magnitude == 1e-4:
            assert torch.isinf(p).all()  # m / (0 + 0): the parameter is destroyed at step 1
    # Squared on its own, fp16 g·g overflows already at |g| = 256 (65536 > 65504).
    g = torch.tensor([255.0, 256.0], dtype=F16)
    assert torch.isfinite(g * g).tolist() == [True, False]
    v_naive = BETAS[1] * torch.zeros(2, dtype=F16) + (1 - BETAS[1]) * (g * g)
    assert torch.isfinite(v_naive).tolist() == [True, False]


@pytest.mark.parametrize("magnitude", [1e-4, 8200.0])
def test_hadam_root_moment_finite_and_tracks_float64(magnitude):
    gen = torch.Generator().manual_seed(1)
    steps, lr = 60, 1e-3
    signs = [torch.where(torch.rand(8, generator=gen) < 0.7, 1.0, -1.0) for _ in range(steps)]
    p16 = torch.zeros(8, dtype=F16, requires_grad=True)
    p64 = torch.zeros(8, dtype=F64, requires_grad=True)
    opt16 = HAdam([p16], lr=lr, betas=BETAS, eps=1e-8)
    opt64 = HAdam([p64], lr=lr, betas=BETAS, eps=1e-8)
    worst_root = worst_param = 0.0
    for t, sign in enumerate(signs, start=1):
        for opt, p in ((opt16, p16), (opt64, p64)):
            p.grad = (magnitude * sign).to(p.dtype)  # |g| is exactly the magnitude
            opt.step()
        root16, root64 = opt16.state[p16]["exp_avg_root"], opt64.state[p64]["exp_avg_root"]
        assert torch.isfinite(root16).all() and (root16 > 0).all()
        worst_root = max(worst_root, ((root16.double() - root64) / root64).abs().max().item())
        # Relative to the farthest the parameters can have gone (|Adam step| <= ~lr).
        param_err = (p16.detach().double() - p64.detach()).abs().max().item()
        worst_param = max(worst_param, param_err / (lr * t))
    assert torch.isfinite(p16).all()
    # s is rounded to 11 bits a few times per step (u = 2^-11 ≈ 4.9e-4), and its per-step
    # relative change (1-β2)/2 ≈ 5e-4 is at the half-ulp level, so errors accumulate slowly
    # (see the lag test below): ~1% after 60 steps. At |g| = 1e-4, a = 1e-5 is subnormal.
    assert worst_root < 2e-2, worst_root
    # m/denom is accurate to the same ~1%, so the parameters to ~1% of the distance travelled.
    assert worst_param < 1e-2, worst_param


def test_fp16_root_moment_lags_float64_when_its_per_step_change_is_below_half_an_ulp():
    """A documented limitation of hAdam in fp16 (measured, not in the paper): with β2 = 0.999
    and steady |g|, s approaches its fixed point 3.162·rms(g) by relative steps of ~(1-β2)/2,
    below half an fp16 ulp, so the rounded update stalls: here s stops near 2.1 while float64
    reaches 3.2. Adam's normalised step is then ~1.5x larger than in float64. Finite, positive,
    and far from the inf/0 of plain Adam; a fused torch.hypot lags less (2.65)."""
    gen = torch.Generator().manual_seed(0)
    grads = [0.5 + torch.rand(4, generator=gen, dtype=F64) for _ in range(3000)]
    roots = {}
    for dtype in (F16, F64):
        p = torch.zeros(4, dtype=dtype, requires_grad=True)
        opt = HAdam([p], lr=1e-4, betas=BETAS)
        for g in grads:
            p.grad = g.to(dtype)
            opt.step()
        roots[dtype] = opt.state[p]["exp_avg_root"].double()
    ratio = roots[F16] / roots[F64]
    assert torch.isfinite(roots[F16]).all()
    assert (ratio > 0.5).all() and (ratio < 0.8).all(), ratio


# ------------------------------------------------------------------------- failure mode 5
def test_kahan_recovers_small_steps_on_log_alpha():
    log_alpha = torch.tensor([math.log(0.1)], dtype=F16)  # -2.3027..., ulp 1.95e-3
    naive = log_alpha.clone()
    kahan = log_alpha.clone()
    kahan_comp = torch.zeros_like(kahan)
    step = torch.tensor([-1e-4], dtype=F16)
    for _ in range(100):
        naive += step
        kahan_add_([kahan], [step.clone()], [kahan_comp])
    exact = log_alpha.double() + 100 * step.double()  # ≈ -2.3127
    assert torch.equal(naive, log_alpha)  # every step lost: 1e-4 < ulp/2
    # p is the fp16 number nearest the exact sum (within half an ulp) ...
    assert (kahan.double() - exact).abs().item() <= fp16_ulp(exact).item() / 2
    assert kahan.item() == pytest.approx(-2.3125)
    # ... and p - c carries the rest, to Kahan's bound 2u·Σ|u_i| = 2·2^-11·0.01 = 9.8e-6
    # (y = u - c and c = (t - p) - y are each rounded to fp16). Naive: off by 1e-2.
    bound = 2 * 2.0**-11 * 100 * abs(step.double().item())
    assert ((kahan.double() - kahan_comp.double()) - exact).abs().item() <= bound


def test_kahan_sum_tracks_float64_over_thousands_of_steps_where_naive_sum_stalls():
    gen = torch.Generator().manual_seed(4)
    start = torch.tensor([math.log(0.1), 0.75, -1.3, 40.0], dtype=F16)
    n = 5000
    # Increments of 1e-5..1e-3 (all below half an ulp of some of the values), mixed sign
    # with a drift.
    magnitudes = 10 ** (-5 + 2 * torch.rand(n, 4, generator=gen, dtype=F64))
    signs = torch.where(torch.rand(n, 4, generator=gen, dtype=F64) < 0.75, 1.0, -1.0)
    increments = (magnitudes * signs).to(F16)  # what an fp16 optimizer would produce
    naive, kahan = start.clone(), start.clone()
    kahan_comp = torch.zeros_like(kahan)
    for inc in increments:
        naive += inc
        kahan_add_([kahan], [inc.clone()], [kahan_comp])
    exact = start.double() + increments.double().sum(0)
    assert ((exact - start.double()).abs() > 0.3).all()
    # Kahan's bound |p - c - exact| <= 2u·Σ|u_i| (u = 2^-11) plus p's own last rounding.
    bound = 2 * 2.0**-11 * increments.double().abs().sum(0)
    assert ((kahan.double() - kahan_comp.double() - exact).abs() <= bound).all()
    assert ((kahan.double() - exact).abs() <= fp16_ulp(exact) / 2 + bound).all()
    naive_err = (naive.double() - exact).abs()
    assert (naive_err > 10 * fp16_ulp(exact)).all(), naive_err / fp16_ulp(exact)


def test_hadam_kahan_tracks_float64_where_plain_fp16_stalls():
    gen = torch.Generator().manual_seed(2)
    start = torch.tensor([math.log(0.1), 0.75, -1.3], dtype=F16)
    # Gradients of varying size and fixed sign: Adam steps of ~1e-4 (lr), far below
    # half an ulp of the parameters (2.4e-4 near 0.75, 9.8e-4 near 2.3).
    signs = torch.tensor([1.0, -1.0, 1.0], dtype=F64)
    grads = [(0.5 + torch.rand(3, generator=gen, dtype=F64)) * signs for _ in range(2000)]
    # β2 = 0.99 keeps s accurate in fp16 (see the lag test above) so that the comparison
    # measures the parameter update, which is what Kahan summation is about.
    betas = (0.9, 0.99)
    results = {}
    for name, dtype, kahan in [("f64", F64, False), ("kahan", F16, True), ("plain", F16, False)]:
        p = start.to(dtype).clone().requires_grad_()
        opt = HAdam([p], lr=1e-4, betas=betas, eps=1e-8, kahan=kahan)
        for g in grads:
            p.grad = g.to(dtype)
            opt.step()
        results[name] = (p.detach().double(), opt)
    exact = results["f64"][0]
    travelled = (exact - start.double()).abs()
    assert (travelled > 0.15).all()  # ~100 ulps
    assert torch.equal(results["plain"][0], start.double())  # every update rounded away
    # Kahan: within 2% of the distance travelled. The remaining error is hAdam's own fp16
    # rounding of s and m/denom (~1%), not the summation (which test_kahan_sum_... bounds).
    err = (results["kahan"][0] - exact).abs()
    assert (err <= 0.02 * travelled).all(), err / travelled
    kahan_opt = results["kahan"][1]
    assert "kahan_comp" in next(iter(kahan_opt.state.values()))


def test_kahan_is_a_per_group_option():
    a = torch.zeros(3, dtype=F16, requires_grad=True)
    b = torch.zeros(3, dtype=F16, requires_grad=True)
    opt = HAdam([{"params": [a], "kahan": True}, {"params": [b]}], lr=1e-3)
    a.grad = torch.ones(3, dtype=F16)
    b.grad = torch.ones(3, dtype=F16)
    opt.step()
    assert "kahan_comp" in opt.state[a]
    assert "kahan_comp" not in opt.state[b]
    assert opt.state[a]["kahan_comp"].dtype == F16
    assert all(t.dtype == F16 for s in opt.state.values() for k, t in s.items() if k != "step")


def test_zero_gradient_with_eps_that_rounds_to_zero_in_fp16_gives_no_nan():
    p = torch.ones(3, dtype=F16, requires_grad=True)
    opt = HAdam([p], lr=1e-3, eps=1e-8)  # 1e-8 is 0 in fp16
    p.grad = torch.zeros(3, dtype=F16)
    opt.step()
    assert torch.equal(p.detach(), torch.ones(3, dtype=F16))
    assert torch.equal(opt.state[p]["exp_avg_root"], torch.zeros(3, dtype=F16))


# ---------------------------------------------------------------------------- checkpointing
@pytest.mark.parametrize("unbiased", [False, True], ids=["published", "unbiased"])
def test_hadam_state_dict_round_trip_is_bitwise(unbiased):
    gen = torch.Generator().manual_seed(3)
    grads = [[torch.randn(4, 3, generator=gen).half(), torch.randn(3, generator=gen).half()] for _ in range(20)]
    init = [torch.randn(4, 3, generator=gen).half(), torch.randn(3, generator=gen).half()]

    def make(params):
        return HAdam(
            [{"params": params[:1], "kahan": True}, {"params": params[1:]}],
            lr=1e-3,
            eps=1e-4,
            unbiased_moments=unbiased,
            seed=4,
        )

    params = [p.clone().requires_grad_() for p in init]
    opt = make(params)
    for step_grads in grads[:10]:
        for p, g in zip(params, step_grads):
            p.grad = g
        opt.step()
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    restored_params = [p.clone().requires_grad_() for p in saved["params"]]
    restored = make(restored_params)
    restored.load_state_dict(saved["opt"])
    first_state = restored.state[restored_params[0]]
    assert first_state["step"] == 10 and isinstance(first_state["step"], int)
    for step_grads in grads[10:]:
        for ps in (params, restored_params):
            for p, g in zip(ps, step_grads):
                p.grad = g.clone()
        opt.step()
        restored.step()
    for p, q in zip(params, restored_params):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_root", "kahan_comp"):
            if key in opt.state[p]:
                assert torch.equal(opt.state[p][key], restored.state[q][key]), key
        assert opt.state[p]["step"] == restored.state[q]["step"] == 20


# ------------------------------------------------------------- KahanAdam (ablation optimizer)
def test_kahan_adam_equals_torch_adam_in_float64():
    gen = torch.Generator().manual_seed(6)
    init = torch.randn(5, generator=gen, dtype=F64)
    grads = [[torch.randn(5, generator=gen, dtype=F64)] for _ in range(100)]
    ours, theirs = [init.clone().requires_grad_()], [init.clone().requires_grad_()]
    run_optimizer(lambda ps: KahanAdam(ps, lr=1e-2, eps=1e-8), ours, grads)
    run_optimizer(lambda ps: torch.optim.Adam(ps, lr=1e-2, eps=1e-8, foreach=True), theirs, grads)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-12, atol=1e-14)


def test_kahan_adam_fp16_tracks_float64_where_torch_adam_stalls():
    gen = torch.Generator().manual_seed(7)
    start = torch.tensor([math.log(0.1), 0.75], dtype=F16)
    signs = torch.tensor([1.0, -1.0], dtype=F64)
    grads = [[(0.5 + torch.rand(2, generator=gen, dtype=F64)) * signs] for _ in range(1500)]
    betas = (0.9, 0.99)  # keeps fp16 v accurate, as in the hAdam test above
    results = {}
    for name, make, dtype in [
        ("f64", lambda ps: torch.optim.Adam(ps, lr=1e-4, betas=betas), F64),
        ("kahan", lambda ps: KahanAdam(ps, lr=1e-4, betas=betas), F16),
        ("torch", lambda ps: torch.optim.Adam(ps, lr=1e-4, betas=betas), F16),
    ]:
        params = [start.to(dtype).clone().requires_grad_()]
        run_optimizer(make, params, grads)
        results[name] = params[0].detach().double()
    travelled = (results["f64"] - start.double()).abs()
    assert (travelled > 0.1).all()
    assert torch.equal(results["torch"], start.double())
    assert ((results["kahan"] - results["f64"]).abs() <= 0.02 * travelled).all()


def test_kahan_adam_state_is_in_param_dtype_and_round_trips():
    p = torch.ones(3, dtype=F16, requires_grad=True)
    opt = KahanAdam([p], lr=1e-3)
    p.grad = torch.full((3,), 0.5, dtype=F16)
    opt.step()
    state = opt.state[p]
    assert state["step"] == 1 and isinstance(state["step"], int)
    assert {k: v.dtype for k, v in state.items() if k != "step"} == {
        "exp_avg": F16,
        "exp_avg_sq": F16,
        "kahan_comp": F16,
    }
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    q = p.detach().clone().requires_grad_()
    restored = KahanAdam([q], lr=1e-3)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    for opt_, param in ((opt, p), (restored, q)):
        param.grad = torch.full((3,), -0.25, dtype=F16)
        opt_.step()
    assert torch.equal(p, q)
    assert all(torch.equal(opt.state[p][k], restored.state[q][k]) for k in ("exp_avg", "exp_avg_sq", "kahan_comp"))


# ------------------------------------------------------------------------------ chunk size
@pytest.mark.parametrize("capturable", [False, True], ids=["host", "sync_free"])
@pytest.mark.parametrize("dtype", [F16, torch.bfloat16], ids=["fp16", "bf16"])
def test_the_chunk_size_does_not_change_a_bit(dtype, capturable):
    """Whole buckets (a GPU's setting), cache-sized chunks (a CPU's) and chunks that split
    parameters at odd places: the same parameters and state, bit for bit, through skipped steps,
    with a channels-last weight, a Kahan group and a 0-dim parameter (like ``log_alpha``)."""
    gen = torch.Generator().manual_seed(5)
    init = [
        torch.randn(6, 5, 3, 3, generator=gen).to(dtype).contiguous(memory_format=torch.channels_last),
        torch.randn(40, 7, generator=gen).to(dtype),
        torch.randn(300, generator=gen).to(dtype),
        torch.tensor(-2.3).to(dtype),
    ]
    grads = [[torch.randn(p.shape, generator=gen).to(dtype) * 1e-2 for p in init] for _ in range(12)]

    def run(chunk_numel):
        params = [p.clone().requires_grad_() for p in init]
        opt = HAdam(
            [{"params": params[:2], "kahan": True}, {"params": params[2:]}],
            lr=1e-3,
            eps=1e-4,
            unbiased_moments=True,
            capturable=capturable,
            seed=7,
            chunk_numel=chunk_numel,
        )
        for step, step_grads in enumerate(grads):
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step(found_inf=torch.tensor(float(step == 4))) if capturable else opt.step()
        return params, opt

    runs = {chunk: run(chunk) for chunk in (None, 1 << 18, 97, 5)}
    params, opt = runs[None]
    assert float(opt.state[params[0]]["step"]) == (11 if capturable else 12)
    for chunk, (other_params, other_opt) in runs.items():
        for p, q in zip(params, other_params):
            assert torch.equal(p.view(torch.int16), q.view(torch.int16)), chunk
            for key, value in opt.state[p].items():
                other = other_opt.state[q][key]
                if key == "step":  # an int, or a float32 device count
                    assert torch.equal(value, other) if capturable else value == other, chunk
                else:
                    assert torch.equal(value.view(torch.int16), other.view(torch.int16)), (chunk, key)


# ------------------------------------------------------------------- memory format on resume
FORMATS = {"NCHW": torch.contiguous_format, "NHWC": torch.channels_last}


@pytest.mark.parametrize("switch", ["NCHW->NHWC", "NHWC->NCHW"])
@pytest.mark.parametrize("capturable", [False, True], ids=["host", "sync_free"])
@pytest.mark.parametrize("unbiased", [False, True], ids=["published", "unbiased"])
def test_resuming_in_another_memory_format_continues_bitwise(switch, unbiased, capturable):
    """``perf.channels_last`` switched between save and resume: a conv weight's moments and Kahan
    buffer were saved in one memory format and its weight is now in the other. The resumed run
    must continue bit for bit as the run that kept its format (the state takes the weight's)."""
    saved_format, resumed_format = (FORMATS[name] for name in switch.split("->"))
    gen = torch.Generator().manual_seed(11)
    init = [torch.randn(8, 5, 3, 3, generator=gen).half(), torch.randn(7, generator=gen).half()]
    grads = [[torch.randn(p.shape, generator=gen).half() * 1e-2 for p in init] for _ in range(8)]

    def make(memory_format, values):
        params = [values[0].contiguous(memory_format=memory_format).requires_grad_(), values[1].requires_grad_()]
        opt = HAdam(
            [{"params": params[:1], "kahan": True}, {"params": params[1:]}],
            lr=1e-2,
            eps=1e-4,
            unbiased_moments=unbiased,
            capturable=capturable,
            seed=2,
        )
        return params, opt

    def steps(params, opt, step_grads):
        for gs in step_grads:
            for p, g in zip(params, gs):
                p.grad = torch.empty_like(p).copy_(g)  # a gradient in its weight's memory format
            opt.step()

    params, opt = make(saved_format, [p.clone() for p in init])
    steps(params, opt, grads[:4])
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict()}, buffer)

    resumed = {}
    for memory_format in (saved_format, resumed_format):
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        assert saved["opt"]["state"][0]["exp_avg"].is_contiguous(memory_format=saved_format)
        params, opt = make(memory_format, [p.clone() for p in saved["params"]])
        opt.load_state_dict(saved["opt"])
        for key in ("exp_avg", "exp_avg_root", "kahan_comp"):
            assert opt.state[params[0]][key].stride() == params[0].stride(), key
        steps(params, opt, grads[4:])
        resumed[memory_format] = (params, opt)
    (kept, kept_opt), (switched, switched_opt) = resumed[saved_format], resumed[resumed_format]
    assert kept[0].is_contiguous(memory_format=saved_format) and switched[0].is_contiguous(memory_format=resumed_format)
    for p, q in zip(kept, switched):
        assert torch.equal(p.detach().contiguous().view(torch.int16), q.detach().contiguous().view(torch.int16))
        for key in ("exp_avg", "exp_avg_root", "kahan_comp"):
            if key in kept_opt.state[p]:
                a, b = kept_opt.state[p][key].contiguous(), switched_opt.state[q][key].contiguous()
                assert torch.equal(a.view(torch.int16), b.view(torch.int16)), key
