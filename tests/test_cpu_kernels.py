"""Native fp16/bf16 CPU kernels versus the fp32-accumulated emulation.

The policy runs a bf16 convolution or matmul natively exactly where oneDNN offers kernels that
accumulate in fp32 (AMX or AVX512-BF16), and emulates that arithmetic elsewhere; fp16 is emulated
even where oneDNN has fp16 kernels (AMX-FP16 or AVX512-FP16), whose convolution weight gradients
are reference loops; ``lowp.fp32_accumulate`` true/false forces either way.
"""

import pytest
import torch
import torch.nn.functional as F

from pixelsac import precision
from pixelsac.config import ConfigError, load_config
from pixelsac.lowp import fp32_accumulate
from pixelsac.precision import PrecisionPolicy, native_half_kernels


def policy(*overrides: str, device: str = "cpu") -> PrecisionPolicy:
    return PrecisionPolicy.from_config(load_config(list(overrides)), device)


@pytest.fixture
def cpu_with(monkeypatch):
    """Pretend this CPU has native kernels for the given dtypes (``None``: for none)."""

    def pretend(*dtypes: torch.dtype) -> None:
        names = {torch.bfloat16: "avx512_bf16", torch.float16: "avx512_fp16"}
        monkeypatch.setattr(precision, "native_half_kernels", lambda dtype: names[dtype] if dtype in dtypes else None)

    return pretend


def test_native_bf16_kernels_are_chosen_exactly_where_the_cpu_has_them(cpu_with):
    cpu_with(torch.bfloat16)
    assert not policy("precision=bf16").fp32_accumulate
    assert not policy("precision=bf16", "lowp.fp32_accumulate=auto").fp32_accumulate
    assert policy("precision=bf16", "lowp.fp32_accumulate=true").fp32_accumulate  # forced
    assert "native kernels" in policy("precision=bf16").cpu_kernels()
    cpu_with(torch.float16)  # kernels for the other half type only
    assert policy("precision=bf16").fp32_accumulate
    assert "emulated" in policy("precision=bf16").cpu_kernels()
    cpu_with()
    assert policy("precision=bf16").fp32_accumulate
    forced = policy("precision=bf16", "lowp.fp32_accumulate=false")
    assert not forced.fp32_accumulate and "has none" in forced.cpu_kernels()
    assert not policy("precision=bf16", device="cuda").fp32_accumulate  # tensor cores do it on a GPU
    assert policy("precision=fp32").cpu_kernels() is None and policy("precision=amp").cpu_kernels() is None


def test_fp16_is_emulated_even_where_the_cpu_has_native_fp16_kernels(cpu_with):
    """Native CPU fp16 convolutions compute weight gradients in reference loops (an update ~80x
    fp32's on a Sapphire Rapids core), so auto emulates fp16 everywhere and says why; forcing the
    native kernels still works and says what it costs."""
    cpu_with(torch.float16, torch.bfloat16)
    auto = policy("precision=fp16")
    assert auto.fp32_accumulate and "weight gradients in reference loops" in auto.cpu_kernels()
    forced = policy("precision=fp16", "lowp.fp32_accumulate=false")
    assert not forced.fp32_accumulate and "~80x slower" in forced.cpu_kernels()
    cpu_with()
    assert "no native kernels" in policy("precision=fp16").cpu_kernels()
    assert "has none" in policy("precision=fp16", "lowp.fp32_accumulate=false").cpu_kernels()


def test_fp32_accumulate_takes_auto_or_a_bool_and_nothing_else():
    assert load_config(["lowp.fp32_accumulate=auto"]).lowp.fp32_accumulate is None
    with pytest.raises(ConfigError, match="lowp.fp32_accumulate"):
        load_config(["lowp.fp32_accumulate=sometimes"])


def test_detection_reads_onednn_and_the_cpu_flags(monkeypatch):
    """avx512_bf16 and AMX each count; oneDNN's bf16 support without either (plain AVX512) does not."""
    flags = {"mkldnn_bf16": True, "mkldnn_fp16": False, "amx_tile": False, "avx512_bf16": True, "amx_fp16": False}
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: flags["mkldnn_bf16"], raising=False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: flags["mkldnn_fp16"], raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: flags["amx_tile"])
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: flags["avx512_bf16"])
    monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: flags["amx_fp16"])
    assert native_half_kernels(torch.bfloat16) == "avx512_bf16" and native_half_kernels(torch.float16) is None
    flags.update(amx_tile=True)
    assert native_half_kernels(torch.bfloat16) == "amx_bf16"
    flags.update(amx_tile=False, avx512_bf16=False)
    assert native_half_kernels(torch.bfloat16) is None
    flags.update(mkldnn_fp16=True, amx_fp16=True)
    assert native_half_kernels(torch.float16) == "amx_fp16"
    assert native_half_kernels(torch.float32) is None


def _bf16_ulps(value: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """|value - reference| in units of the bf16 spacing at the reference (2^(e-7))."""
    exponent = torch.floor(torch.log2(reference.abs().clamp_min(2.0**-126)))
    return (value.double() - reference).abs() / torch.pow(2.0, exponent - 7)


LAYERS = {  # the DrQ trunk's two kinds of convolution and the projection / head matmuls
    "conv stride 2": ((8, 9, 24, 24), (16, 9, 3, 3), 2),
    "conv stride 1": ((8, 16, 11, 11), (16, 16, 3, 3), 1),
    "linear": ((32, 784), (50, 784), None),
}


def _forward_backward(layer: str, inputs: tuple[torch.Tensor, ...], grad: torch.Tensor | None, emulate: bool):
    stride, leaves = LAYERS[layer][2], [t.clone().requires_grad_(True) for t in inputs]
    x, w, b = leaves
    context = fp32_accumulate() if emulate else torch.enable_grad()
    with context:
        out = F.linear(x, w, b) if stride is None else F.conv2d(x, w, b, stride=stride)
    if grad is None:
        return out
    out.backward(grad)
    return [out.detach(), *(leaf.grad for leaf in leaves)]


@pytest.mark.skipif(native_half_kernels(torch.bfloat16) is None, reason="this CPU has no native bf16 kernels")
@pytest.mark.parametrize("layer", list(LAYERS))
def test_native_bf16_agrees_with_the_emulation_within_one_ulp(layer):
    """Both compute each output and gradient as an fp32 sum rounded once to bf16: they may differ
    where the two summation orders straddle a rounding boundary, by one bf16 ulp at most."""
    torch.manual_seed(0)
    x_shape, w_shape, _ = LAYERS[layer]
    inputs = (torch.randn(x_shape), torch.randn(w_shape) * 0.1, torch.randn(w_shape[0]) * 0.1)
    inputs = tuple(t.bfloat16() for t in inputs)
    grad = torch.randn_like(_forward_backward(layer, inputs, None, emulate=True)).bfloat16()
    native = _forward_backward(layer, inputs, grad, emulate=False)
    emulated = _forward_backward(layer, inputs, grad, emulate=True)
    for name, a, b in zip(("output", "input grad", "weight grad", "bias grad"), native, emulated):
        worst = float(_bf16_ulps(a, b.double()).max())
        assert worst <= 1.0, f"{layer} {name}: native and emulated differ by {worst:g} bf16 ulps"


@pytest.mark.parametrize("native", [True, False])
def test_bench_rows_say_which_kernels_ran(cpu_with, native):
    from pixelsac.bench.cells import _compute
    from pixelsac.bench.plan import MODES

    cpu_with(*([torch.bfloat16] if native else []))

    def compute(mode: str, device: str = "cpu") -> tuple[str, bool]:
        return _compute(load_config(list(MODES[mode].overrides)), MODES[mode], device)

    if native:
        assert compute("bf16") == ("native CPU bfloat16 kernels (avx512_bf16)", False)
        assert compute("bf16-native") == compute("bf16")
    else:
        assert compute("bf16")[1] and "emulated" in compute("bf16")[0]
        assert compute("bf16-native") == ("CPU bfloat16 reference kernels (no native ones)", False)
    assert compute("bf16-emulated")[1]  # forced on either way
    assert compute("fp16")[1]  # no fp16 kernels pretended: emulated
    assert compute("bf16", "cuda") == ("bfloat16 tensor cores", False)


@pytest.mark.parametrize("switch", ["fp32_q_output", "fp32_actor_loss", "fp32_actor_features"])
def test_bf16_turns_its_fp32_switches_on_and_fp16_keeps_the_published_form(switch):
    """fp16 keeps the published actor loss; its Q values are fp32 where loss scaling runs (the
    full-size agent's Q in the hundreds, tests/test_fp16_range.py), not in naive fp16."""
    assert getattr(policy("precision=bf16"), switch) and switch in policy("precision=bf16").describe()
    assert not getattr(policy("precision=bf16", f"lowp.{switch}=false"), switch)
    fp16_default = switch == "fp32_q_output"
    assert getattr(policy("precision=fp16"), switch) == fp16_default and not getattr(policy("precision=fp32"), switch)
    assert not getattr(policy("precision=fp16", "lowp.all=false"), switch)
    assert getattr(policy("precision=fp16", f"lowp.{switch}=true"), switch)
    assert not getattr(policy("precision=fp16", f"lowp.{switch}=false"), switch)


def bf16_agent_and_float64_critic(overrides: list[str], obs_shape: tuple[int, ...]):
    """A bf16 agent and a float64 critic holding the same (bf16) critic weights: the judge."""
    from pixelsac.config import to_plain
    from pixelsac.module import SACModule

    torch.manual_seed(0)
    module = SACModule(to_plain(load_config(["precision=bf16", *overrides])), obs_shape, 2)
    shape_only = [o for o in overrides if not o.startswith("lowp.")]  # the judge is plain float64
    judge = SACModule(to_plain(load_config(["precision=fp32", *shape_only])), obs_shape, 2).double()
    judge.critic.load_state_dict({k: v.double() for k, v in module.critic.state_dict().items()})
    return module, judge


@pytest.mark.parametrize("fp32_q_output", [True, False])
def test_fp32_q_values_track_float64_where_bf16_outputs_round_the_td_signal_away(fp32_q_output):
    """A bf16 critic whose Q values sit near 30 (a trained swing-up agent's): rounded to bf16 they
    move in steps of 0.125, a quarter of a typical TD error; summed and kept in fp32 they stay
    within the hidden activations' own rounding of float64's value on the same bf16 weights."""
    module, judge = bf16_agent_and_float64_critic(
        ["env.obs=state", f"lowp.fp32_q_output={str(fp32_q_output).lower()}"], (8,)
    )
    with torch.no_grad():
        for critic in (module.critic, judge.critic):
            for head in (critic.q1, critic.q2):
                head[-1].bias.fill_(30.0)
        obs, action = torch.randn(512, 8), torch.rand(512, 2) * 2 - 1
        with module.precision_policy.compute_context():
            q_low, _ = module.critic(obs.bfloat16(), action.bfloat16())
        q64, _ = judge.critic(obs.bfloat16().double(), action.bfloat16().double())
    error = float((q_low.double() - q64).abs().mean())
    assert q_low.dtype == (torch.float32 if fp32_q_output else torch.bfloat16)
    if fp32_q_output:
        assert error < 0.005, error
    else:
        assert error > 0.015, error  # round to nearest in steps of 0.125 (0.25 above 32)


@pytest.mark.parametrize("obs_shape", [(8,), (9, 24, 24)], ids=["state", "pixels"])
@pytest.mark.parametrize("fp32", [True, False])
def test_the_actors_action_gradient_in_fp32_heads_is_float64s_rounded_once(obs_shape, fp32):
    """∇ₐ min(Q1, Q2), what the actor's loss pushes the policy with, from bf16 weights and inputs:
    through fp32 heads it is float64's value rounded once to bf16 (≤ 2⁻⁹ relative); through
    bf16 heads every layer's activations and gradients round, ≈1-3% off (measured 2.7% here)."""
    pixels = ["env.image_size=24", "agent.num_filters=4"] if len(obs_shape) == 3 else ["env.obs=state"]
    module, judge = bf16_agent_and_float64_critic(pixels, obs_shape)
    with torch.no_grad():
        features = module.critic.trunk(torch.rand(512, *obs_shape).bfloat16())
    action = (torch.rand(512, 2) * 2 - 1).bfloat16().requires_grad_()
    action64 = action.detach().double().requires_grad_()
    with module.precision_policy.compute_context():
        q1, q2 = module.critic.heads(features, action, fp32=fp32)
    torch.min(q1, q2).sum().backward()
    q1_64, q2_64 = judge.critic.heads(features.double(), action64)
    torch.min(q1_64, q2_64).sum().backward()
    error = float((action.grad.double() - action64.grad).norm() / action64.grad.norm())
    assert action.grad.dtype == torch.bfloat16 and q1.dtype == (torch.float32 if fp32 else q1.dtype)
    if fp32:
        assert error < 2.0**-9, error
    else:
        assert error > 0.008, error


@pytest.mark.parametrize("fp32_actor_loss", [True, False])
def test_the_actors_gradient_in_fp32_is_float64s_rounded_once(fp32_actor_loss):
    """The actor's gradient from bf16 weights, against float64 from the same weights, features and
    noise: in fp32 arithmetic it is float64's rounded once (≤ 2⁻⁹ relative; measured 0.14%); with
    every op in bf16 it is twice as far on a fresh agent (0.29%) and 3-6x on a trained one, where
    α∇log π and ∇ₐQ cancel (docs/precision.md)."""
    import copy

    from pixelsac.config import to_plain
    from pixelsac.module import SACModule
    from pixelsac.precision import PrecisionPolicy

    torch.manual_seed(0)
    flag = str(fp32_actor_loss).lower()
    cfg = load_config(["precision=bf16", "env.obs=state", f"lowp.fp32_actor_loss={flag}"])
    module = SACModule(to_plain(cfg), (8,), 2)
    judge = copy.deepcopy(module).double()
    judge.precision_policy = PrecisionPolicy.from_config(load_config(["precision=fp32"]), "cpu")  # plain ops
    obs = torch.randn(512, 8).bfloat16()

    def actor_gradient(agent: SACModule, observations: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(1)  # the same policy noise: fp32 and float64 normals agree to rounding
        with agent.precision_policy.compute_context():
            actor_loss, _, _ = agent.actor_and_alpha_loss(observations)
        actor_loss.backward()
        return torch.cat([p.grad.double().flatten() for p in agent.actor.parameters()])

    mine, reference = actor_gradient(module, obs), actor_gradient(judge, obs.double())
    error = float((mine - reference).norm() / reference.norm())
    if fp32_actor_loss:
        assert error < 2.0**-9, error
    else:
        assert error > 1.2 * 2.0**-9, error


@pytest.mark.parametrize("fp32_actor_features", [True, False])
def test_the_actors_gradient_from_fp32_trunk_features_is_float64s_rounded_once(fp32_actor_features):
    """A pixel agent's actor gradient (its loss in fp32), against float64 from the same weights,
    pixel values and noise: with the trunk's features computed in fp32 it is within a few percent
    of float64's gradient rounded once to bf16; with the features rounded to bf16 after each conv
    it is twice as far on this fresh agent (and 20x on a trained one, docs/results/grad_fidelity)."""
    import copy

    from pixelsac.config import to_plain
    from pixelsac.module import SACModule

    torch.manual_seed(0)
    flag = str(fp32_actor_features).lower()
    shape = ["env.image_size=24", "agent.num_filters=8"]
    cfg = load_config(["precision=bf16", *shape, f"lowp.fp32_actor_features={flag}"])
    module = SACModule(to_plain(cfg), (9, 24, 24), 2)
    judge = copy.deepcopy(module).double()
    judge.precision_policy = PrecisionPolicy.from_config(load_config(["precision=fp32"]), "cpu")  # plain ops
    # the pixel values the bf16 critic reads (k/255 rounded to bf16), read exactly by the judge
    pixels = (torch.randint(0, 256, (256, 9, 24, 24), dtype=torch.uint8).to(torch.bfloat16) / 255).to(
        memory_format=torch.channels_last
    )

    def actor_gradient(agent: SACModule, observations: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(1)  # the same policy noise: fp32 and float64 normals agree to rounding
        with agent.precision_policy.compute_context():
            actor_loss, _, _ = agent.actor_and_alpha_loss(observations)
        actor_loss.backward()
        return torch.cat([p.grad.double().flatten() for p in agent.actor.parameters()])

    mine, reference = actor_gradient(module, pixels), actor_gradient(judge, pixels.double())
    error = float((mine - reference).norm() / reference.norm())
    rounded_once = float((reference.bfloat16().double() - reference).norm() / reference.norm())
    assert module.precision_policy.fp32_actor_loss
    if fp32_actor_features:
        assert error < 1.25 * rounded_once, (error, rounded_once)  # measured 1.11x (α = exp(log α) rounds too)
    else:
        assert error > 1.5 * rounded_once, (error, rounded_once)  # measured 2.2x; 20x on a trained agent


def _run_on(device: str, *overrides: str):
    """What :func:`pixelsac.train.start_lines` reads of a built run, on ``device``."""
    from types import SimpleNamespace

    return SimpleNamespace(
        cfg=load_config(list(overrides)),
        trainer=SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)), world_size=1),
        env=SimpleNamespace(action_repeat=8),
        replay=SimpleNamespace(describe=lambda: "replay buffer: (stand-in)"),
    )


def test_a_cuda_run_says_nothing_about_the_hosts_cpu_kernels(cpu_with):
    """The run's start-up lines describe the policy of the device it trains on: the module's own
    policy is the CPU's until the Trainer's setup, and a CUDA run used to print this host's
    ``fp16: native kernels (avx512_fp16), expect ~1.8x fp32's updates/s``."""
    from pixelsac.train import start_lines

    cpu_with(torch.float16, torch.bfloat16)
    on_cpu = "\n".join(start_lines(_run_on("cpu", "precision=bf16")))
    assert "bf16: native kernels (avx512_bf16)" in on_cpu and "1 x cpu" in on_cpu
    for mode in ("fp16", "bf16"):
        on_gpu = "\n".join(start_lines(_run_on("cuda", f"precision={mode}")))
        assert "1 x cuda" in on_gpu
        for cpu_words in ("avx512", "kernels", "on CPU", "emulated", "fp32-accumulated"):
            assert cpu_words not in on_gpu, (mode, on_gpu)
    fp32_on_gpu = "\n".join(start_lines(_run_on("cuda", "precision=fp32")))
    assert "TF32 off (IEEE fp32)" in fp32_on_gpu  # what applies to the GPU instead
