"""hAdam's unbiased step compiled into a few kernels (``HAdam(compiled=True)``, ``pixelsac/lowp/fused.py``).

The compiled step is held to what the eager step is held to -- float64 Adam over 5,000 steps,
skipped steps that change nothing, checkpoints that resume bitwise -- and against the eager step
itself: the same arithmetic, rounded the same ways, so it may differ only where a fused
multiply-add in ATen's ``lerp`` moves a float32 value by an ulp. The one way compilation could
silently change the method (inductor dropping the fp16 rounding that Kahan's compensation is made
of) is shown to fail the Kahan test.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from test_lowp_moments import BAND, displacement_ratio

from pixelsac.lowp import HAdam, fused

F16, BF16, F64 = torch.float16, torch.bfloat16, torch.float64


def make_params(dtype: torch.dtype = F16) -> list[torch.nn.Parameter]:
    """A conv weight in channels-last (read in NHWC order), a bias, a matrix and a vector."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(8, 6, 3, 3), (8,), (30, 17), (5,)]
    params = []
    for shape in shapes:
        value = torch.randn(shape, generator=gen).to(dtype)
        if len(shape) == 4:
            value = value.to(memory_format=torch.channels_last)
        params.append(torch.nn.Parameter(value))
    return params


def gradients(params, gen: torch.Generator) -> list[torch.Tensor]:
    """Gradients over five decades (1e-4..10) in each parameter's layout."""
    grads = []
    for param in params:
        magnitude = 10 ** torch.empty(param.shape).uniform_(-4, 1, generator=gen)
        grad = (torch.randn(param.shape, generator=gen) * magnitude).to(param.dtype)
        grads.append(torch.empty_like(param).copy_(grad))
    return grads


def state_of(optimizer: HAdam, params) -> list[dict]:
    return [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in optimizer.state[p].items()} for p in params]


def run(
    compiled: bool,
    kahan: bool,
    capturable: bool,
    steps: int = 20,
    skip_at: int = 7,
    dtype=F16,
    stochastic_first_moment: bool = False,
):
    params = make_params(dtype)
    optimizer = HAdam(
        params,
        lr=1e-3,
        kahan=kahan,
        capturable=capturable,
        unbiased_moments=True,
        stochastic_first_moment=stochastic_first_moment,
        seed=3,
        compiled=compiled,
    )
    gen = torch.Generator().manual_seed(2)
    for step in range(steps):
        for param, grad in zip(params, gradients(params, gen)):
            param.grad = grad
        if capturable:
            optimizer.step(found_inf=torch.tensor(float(step == skip_at)))
        else:
            optimizer.step()
    return params, optimizer


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable numbers lie between a and b (same dtype and sign)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize(
    "kahan, capturable, stochastic_m",
    [(True, True, False), (True, False, False), (False, True, False), (False, False, False)]
    + [(False, True, True), (True, False, True)],
    ids=lambda v: None,
)
def test_the_compiled_step_is_the_eager_step_but_for_rare_one_ulp_differences(kahan, capturable, stochastic_m):
    """Twenty steps (a skipped one among them on the device path) of four parameters, one a
    channels-last conv weight: every step count equal, and at most 1 in 500 state elements apart,
    by one ulp. The stochastic-rounding streams are the eager step's (a wrong element index or key
    would make about half of the stochastically rounded weights differ), the first moment's too
    when it is stochastically rounded (``stochastic_m``)."""
    eager_params, eager = run(False, kahan, capturable, stochastic_first_moment=stochastic_m)
    compiled_params, compiled = run(True, kahan, capturable, stochastic_first_moment=stochastic_m)
    differing = total = 0
    for a, b in zip(eager_params, compiled_params):
        sa, sb = eager.state[a], compiled.state[b]
        assert float(sa["step"]) == float(sb["step"]) == (19.0 if capturable else 20.0)
        pairs = [(a.detach(), b.detach())] + [
            (sa[k], sb[k]) for k in ("exp_avg", "exp_avg_root", "kahan_comp") if k in sa
        ]
        for x, y in pairs:
            assert x.shape == y.shape and x.stride() == y.stride()
            apart = ulps_apart(x, y)
            assert int(apart.max()) <= 1, apart.max()
            differing += int((apart > 0).sum())
            total += x.numel()
    assert differing <= total / 500, (differing, total)


@pytest.mark.parametrize("kind", ["gaussian", "spikes"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16-scaled", "bf16"])
def test_the_compiled_step_tracks_float64_adam_like_the_eager_one(kind, dtype):
    """test_lowp_moments' judge: 5,000 steps (fp16 through the compound loss scaler), the median
    displacement against float64 Adam within 5% (the eager step: 0.998-1.000)."""
    ratio = displacement_ratio(kind, dtype, unbiased=True, compiled=True)
    assert BAND[0] <= ratio <= BAND[1], ratio


@pytest.fixture
def fresh_compile():
    """Compile the step anew in this test and again for the tests after it."""
    fused._compiled.clear()
    torch._dynamo.reset()
    yield
    fused._compiled.clear()
    torch._dynamo.reset()


def kahan_displacement(options: dict, monkeypatch) -> tuple[float, float]:
    """A weight of 1.0 moved by 300 Adam steps of 1e-5 each, a fiftieth of an fp16 ulp there
    (9.8e-4): (fp16 displacement, float64 displacement)."""
    monkeypatch.setattr(fused, "COMPILE_OPTIONS", options)
    param = torch.nn.Parameter(torch.ones(64, dtype=F16))
    optimizer = HAdam([param], lr=1e-5, eps=1e-8, kahan=True, unbiased_moments=True, compiled=True)
    reference = torch.nn.Parameter(torch.ones(64, dtype=F64))
    reference_optimizer = torch.optim.Adam([reference], lr=1e-5, eps=1e-8 / 3.1623)
    for _ in range(300):
        param.grad = torch.full((64,), 0.5, dtype=F16)
        reference.grad = torch.full((64,), 0.5, dtype=F64)
        optimizer.step()
        reference_optimizer.step()
    return float(1 - param.detach().double().mean()), float(1 - reference.detach().mean())


def test_kahan_compensation_survives_compilation(monkeypatch, fresh_compile):
    """300 steps of a fiftieth of an ulp: with the compensation the weight moves as float64's
    (3e-3 in all); rounded to nearest alone it would not move at all."""
    moved, reference = kahan_displacement(fused.COMPILE_OPTIONS, monkeypatch)
    assert reference == pytest.approx(3e-3, rel=0.01)
    assert moved == pytest.approx(reference, rel=0.05), (moved, reference)


def test_without_rounding_at_every_cast_inductor_would_turn_kahan_off(monkeypatch, fresh_compile):
    """The test above can fail: compiled without ``emulate_precision_casts``, inductor keeps
    ``(p + y).to(fp16).float()`` in float32, the compensation comes out 0 and the weight stays
    at 1.0."""
    moved, reference = kahan_displacement({}, monkeypatch)
    assert moved < 0.1 * reference, (moved, reference)


def test_a_skipped_step_changes_nothing_and_a_root_moment_overflow_is_a_skip():
    params, optimizer = run(True, kahan=True, capturable=True, steps=3, skip_at=-1)
    before = state_of(optimizer, params)
    weights = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(5)
    for param, grad in zip(params, gradients(params, gen)):
        param.grad = grad
    params[2].grad[0, 0] = float("inf")  # a skipped step's gradients may hold inf: counted as 0
    optimizer.step(found_inf=torch.tensor(1.0))
    assert not bool(optimizer.state_overflow)
    for a, b, state in zip(params, weights, before):
        assert torch.equal(a.detach(), b)
        for key, value in optimizer.state[a].items():
            assert torch.equal(value, state[key]), key
    # then a finite gradient that takes a root moment at fp16's largest value past it:
    # hypot(0.1·60000, sqrt(0.999)·65504) = 65,746
    optimizer.state[params[1]]["exp_avg_root"][3] = 65504.0
    before = state_of(optimizer, params)
    for _ in range(2):
        for a, b, state in zip(params, weights, before):
            assert torch.equal(a.detach(), b)
            for key, value in optimizer.state[a].items():
                assert torch.equal(value, state[key]), key
        for param, grad in zip(params, gradients(params, gen)):
            param.grad = grad
        params[1].grad[3] = 60000.0
        optimizer.step(found_inf=torch.tensor(0.0))
        assert bool(optimizer.state_overflow)


def test_the_compiled_state_resumes_bitwise_and_loads_into_an_eager_optimizer():
    """A checkpoint of the compiled optimizer's state (views into one buffer per name) continues
    exactly as the uninterrupted run, and an eager hAdam reads it as ordinary state."""
    params, optimizer = run(True, kahan=True, capturable=True, steps=6, skip_at=-1)
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "optimizer": optimizer.state_dict()}, buffer)
    gen = torch.Generator().manual_seed(9)
    later = [gradients(params, gen) for _ in range(4)]
    for grads in later:
        for param, grad in zip(params, grads):
            param.grad = grad.clone()
        optimizer.step(found_inf=torch.tensor(0.0))

    for compiled in (True, False):
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        resumed = [torch.nn.Parameter(torch.empty_like(p).copy_(w)) for p, w in zip(params, saved["params"])]
        again = HAdam(resumed, lr=1e-3, kahan=True, capturable=True, unbiased_moments=True, seed=3, compiled=compiled)
        again.load_state_dict(saved["optimizer"])
        for grads in later:
            for param, grad in zip(resumed, grads):
                param.grad = grad.clone()
            again.step(found_inf=torch.tensor(0.0))
        for a, b in zip(params, resumed):
            if compiled:
                assert torch.equal(a.detach(), b.detach())
                for key in ("exp_avg", "exp_avg_root", "kahan_comp", "step"):
                    assert torch.equal(optimizer.state[a][key], again.state[b][key]), key
            else:  # the eager step on the same state: the same method, rare one-ulp differences
                assert int(ulps_apart(a.detach(), b.detach()).max()) <= 1


def test_the_compiled_step_is_the_gradients_views_one_cat_and_one_op():
    """What the step dispatches: the gradients' views, one ``cat`` of the gradients and the step
    itself -- the parameters are views into the flat buffer the op updates in place, so nothing
    joins them or writes them back; inductor generated its kernels once."""
    from pixelsac.perf.opcount import DispatchCount

    params, optimizer = run(True, kahan=True, capturable=True, steps=2, skip_at=-1)
    for param, grad in zip(params, gradients(params, torch.Generator().manual_seed(4))):
        param.grad = grad
    found_inf = torch.tensor(0.0)
    with DispatchCount(sites=False) as count:
        optimizer.step(found_inf=found_inf)
    ops = {str(op).removeprefix("aten."): n for op, n in count.ops.items() if not str(op).startswith("profiler.")}
    assert ops == {
        "view.default": 3,  # the contiguous gradients
        "as_strided.default": 1,  # the channels-last conv weight's gradient, in memory order
        "cat.default": 1,
        "pixelsac_lowp.hadam_step.default": 1,
    }, ops
    assert fused.kernels_per_call().get("step", 0) >= 1


def test_the_parameters_live_in_one_buffer_and_a_replaced_parameter_moves_back():
    """From the optimizer's construction the bucket's parameters are views into one buffer (same
    objects, same values and strides: the channels-last weight stays channels-last); a parameter
    given new storage (``param.data = ...``, as ``module.to`` does) is copied back in at the next
    step and the run goes on exactly as without the move; autograd sees every step as an
    in-place change."""
    fresh = make_params()
    values = [p.detach().clone() for p in fresh]
    strides = [p.stride() for p in fresh]
    HAdam(fresh, lr=1e-3, unbiased_moments=True, compiled=True)
    assert len({p.untyped_storage().data_ptr() for p in fresh}) == 1
    assert all(torch.equal(p.detach(), v) and p.stride() == st for p, v, st in zip(fresh, values, strides))

    params, optimizer = run(True, kahan=True, capturable=True, steps=3, skip_at=-1)
    reference, again = run(True, kahan=True, capturable=True, steps=3, skip_at=-1)
    storage = params[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == storage for p in params)
    assert params[0].is_contiguous(memory_format=torch.channels_last) and not params[0].is_contiguous()
    params[2].data = params[2].data.clone()  # elsewhere now
    assert params[2].untyped_storage().data_ptr() != storage
    versions = [p._version for p in params]
    gen, gen_again = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(3):
        for param, grad in zip(params, gradients(params, gen)):
            param.grad = grad
        for param, grad in zip(reference, gradients(reference, gen_again)):
            param.grad = grad
        optimizer.step(found_inf=torch.tensor(0.0))
        again.step(found_inf=torch.tensor(0.0))
    storage = params[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == storage for p in params)
    for a, b in zip(params, reference):
        assert torch.equal(a.detach(), b.detach())
        for key in ("exp_avg", "exp_avg_root", "kahan_comp", "step"):
            assert torch.equal(optimizer.state[a][key], again.state[b][key]), key
    assert all(p._version > v for p, v in zip(params, versions))
    # a graph that saved a weight before a step may not backpropagate after it
    weight = params[3]
    loss = (weight * weight).sum()
    weight.grad = torch.ones_like(weight)
    for param in params[:3]:
        param.grad = torch.zeros_like(param)
    optimizer.step(found_inf=torch.tensor(0.0))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("kahan", [True, False], ids=["kahan", "stochastic-weights"])
def test_a_backoff_folded_into_the_step_is_the_scalers_rescale_after_it(kahan, compiled):
    """``step(found_inf, backoff=(f, floor))``, the compound scaler's call, gives bit for bit what
    the step followed by ``rescale_state_(f if skipped else 1, floor)`` gives: moments ×f on the
    skipped steps (f = 0.3: no power of two, so the rounding of the product counts; subnormal
    moments among them), ε <- max(ε·f, floor) on every step (1e-8, 3e-9, 9e-10 -> the floor 1e-9):
    the compiled step in its own pass, the eager one by that rescale."""

    def drive(fold: bool) -> tuple[list[torch.Tensor], HAdam]:
        params = make_params()
        optimizer = HAdam(params, lr=1e-3, eps=1e-8, kahan=kahan, capturable=True, unbiased_moments=True, seed=3,
                          compiled=compiled)  # fmt: skip
        gen = torch.Generator().manual_seed(2)
        one = torch.ones(())
        for step in range(12):
            for param, grad in zip(params, gradients(params, gen)):
                param.grad = grad * 1e-3 if step < 4 else grad  # small first: subnormal moments to back off
            if step == 9:  # a finite gradient whose new root moment overflows fp16: a skip of the state's
                optimizer.state[params[1]]["exp_avg_root"][0] = 65504.0
                params[1].grad[0] = 6e4
            found_inf = torch.tensor(float(step in (5, 6)))
            if fold:
                optimizer.step(found_inf=found_inf, backoff=(0.3, 1e-9))
            else:
                optimizer.step(found_inf=found_inf)
                skipped = (found_inf > 0) | optimizer.state_overflow
                optimizer.rescale_state_(one.masked_fill(skipped, 0.3), eps_floor=1e-9)
        return params, optimizer

    folded_params, folded = drive(True)
    params, unfolded = drive(False)
    assert float(unfolded.state[params[0]]["step"]) == 9.0  # three skips
    subnormal = 0
    for a, b in zip(folded_params, params):
        assert torch.equal(a.detach(), b.detach())
        for key in ("exp_avg", "exp_avg_root", "kahan_comp", "step"):
            if key in unfolded.state[b]:
                assert torch.equal(folded.state[a][key], unfolded.state[b][key]), key
        subnormal += int(((unfolded.state[b]["exp_avg"].abs() < 2**-14) & (unfolded.state[b]["exp_avg"] != 0)).sum())
    assert subnormal > 0
    assert torch.equal(folded.param_groups[0]["eps"], unfolded.param_groups[0]["eps"])
    assert float(unfolded.param_groups[0]["eps"]) == pytest.approx(1e-9, rel=1e-6)  # 1e-8·0.3² then the floor


def test_perf_compile_optimizer_compiles_the_16_bit_hadam_only():
    from pixelsac.config import load_config
    from pixelsac.precision import PrecisionPolicy

    for mode, compiled in (("fp16", True), ("bf16", True), ("fp32", False)):
        cfg = load_config([f"precision={mode}", "perf.compile_optimizer=true"])
        policy = PrecisionPolicy.from_config(cfg, "cpu")
        param = torch.nn.Parameter(torch.zeros(3, dtype=policy.param_dtype))
        optimizer = policy.make_optimizer([param], lr=1e-3, betas=(0.9, 0.999), kahan=True)
        assert getattr(optimizer, "compiled", False) is compiled, mode
        assert ("compiled hAdam step" in policy.describe()) is compiled, policy.describe()
    cfg = load_config(["precision=fp16", "lowp.unbiased_moments=false", "perf.compile_optimizer=true"])
    assert not PrecisionPolicy.from_config(cfg, "cpu").compiled_optimizer  # the published arithmetic stays eager
    assert not PrecisionPolicy.from_config(load_config(["precision=fp16"]), "cpu").compiled_optimizer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_compiled_step_matches_the_eager_step_and_replays_in_a_graph():
    """The same equality on CUDA (triton kernels), then the step captured in a CUDA graph and
    replayed: equal to running it eagerly, with no host read inside."""
    device = torch.device("cuda")
    results = []
    for compiled in (False, True):
        params = [torch.nn.Parameter(p.detach().to(device)) for p in make_params()]
        optimizer = HAdam(
            params, lr=1e-3, kahan=True, capturable=True, unbiased_moments=True, seed=3, compiled=compiled
        )
        gen = torch.Generator().manual_seed(2)
        for _ in range(10):
            for param, grad in zip(params, gradients(params, gen)):
                param.grad = grad.to(device)
            optimizer.step(found_inf=torch.zeros((), device=device))
        results.append((params, optimizer))
    (eager_params, _), (compiled_params, compiled) = results
    for a, b in zip(eager_params, compiled_params):
        assert int(ulps_apart(a.detach().cpu(), b.detach().cpu()).max()) <= 1
    found_inf = torch.zeros((), device=device)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        compiled.step(found_inf=found_inf)
    before = [p.detach().clone() for p in compiled_params]
    graph.replay()
    torch.cuda.synchronize()
    assert any(not torch.equal(p.detach(), b) for p, b in zip(compiled_params, before))
    assert math.isfinite(float(torch.stack([p.detach().float().abs().max() for p in compiled_params]).max()))


def test_a_metered_update_of_the_tiny_agent_runs_with_the_compiled_step():
    """The benchmark's CPU cell (host-side decisions, the tensor-peak meter over the first update)
    once failed inside torch.compile: the step's cached view of ``log_alpha`` had been made under
    no_grad from the leaf itself ("a view was created in no_grad mode ..."); the views are now
    made from a detached alias."""
    from pixelsac.bench.plan import MODES
    from pixelsac.config import load_config, to_plain
    from pixelsac.perf import synthetic_batch, time_updates

    sizes = [
        "env.image_size=32",
        "agent.num_filters=4",
        "agent.feature_dim=8",
        "agent.hidden_dim=16",
        "agent.batch_size=4",
    ]
    cfg = to_plain(load_config([*MODES["fp16-compiled"].overrides, *sizes]))
    batch = synthetic_batch(4, (9, 32, 32), 1, seed=1)
    timed = time_updates(cfg, (9, 32, 32), 1, batch, torch.device("cpu"), 2, 1, tensor_peak=True)
    assert len(timed.ms) >= 2 and all(math.isfinite(ms) for ms in timed.ms)
