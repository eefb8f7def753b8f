"""The precision policy: modes, parity of one fp16 + six update with fp32, checkpoints that carry
every low-precision state, and the memory the pure fp16 agent saves."""

import lightning as L
import pytest
import torch
from test_module import fit, make_batch, make_module
from torch.utils.data import DataLoader

from pixelsac.config import load_config, to_plain
from pixelsac.module import SACModule
from pixelsac.precision import (
    SIX,
    NumericalFailure,
    PrecisionPolicy,
    keep_execution_flags,
    materialize_optimizer_state,
    state_bytes,
)

LR = 1e-3


def policy(*overrides: str, device: str = "cpu") -> PrecisionPolicy:
    return PrecisionPolicy.from_config(load_config(list(overrides)), device)


def test_modes_and_switches():
    assert all(getattr(policy("precision=fp16"), m) for m in SIX)
    assert not any(getattr(policy("precision=fp32"), m) for m in SIX)
    assert not any(getattr(policy("precision=fp16", "lowp.all=false"), m) for m in SIX)  # naive fp16
    bf16 = policy("precision=bf16")
    assert bf16.param_dtype == torch.bfloat16 and not bf16.loss_scaling and bf16.hadam and bf16.kahan_momentum
    ablation = policy("precision=fp16", "lowp.kahan_momentum=false")
    assert not ablation.kahan_momentum and ablation.hadam and ablation.loss_scaling
    assert (
        policy("precision=fp16").adam_eps == 1e-4
        and policy("precision=fp16", "lowp.loss_scaling=false").adam_eps == 1e-8
    )
    assert policy("precision=fp16").fp32_accumulate and not policy("precision=fp16", device="cuda").fp32_accumulate
    assert not policy("precision=fp16", "lowp.fp32_accumulate=false").fp32_accumulate
    assert policy("precision=amp").param_dtype == torch.float32
    assert "naive" not in policy("precision=fp16", "lowp.all=false").describe()
    assert "modifications: none" in policy("precision=fp16", "lowp.all=false").describe()


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("channels_last", [True, False])
def test_observations_are_scaled_once_bit_for_bit_as_drq_scales_them(precision, channels_last):
    frames = torch.randint(0, 256, (3, 9, 8, 8), dtype=torch.uint8)
    kept = frames.clone()
    chosen = policy(f"precision={precision}", f"perf.channels_last={str(channels_last).lower()}")
    pixels = chosen.cast_observation(frames)
    reference = frames.to(chosen.param_dtype) / 255.0  # DrQ's encoder: obs / 255 in the model dtype
    assert pixels.dtype == chosen.param_dtype and torch.equal(pixels, reference)
    assert pixels.is_contiguous(memory_format=torch.channels_last) == channels_last
    assert torch.equal(frames, kept)  # the division is in place on the cast copy, never on the frames
    states = torch.randn(3, 5)
    assert torch.equal(chosen.cast_observation(states), states.to(chosen.param_dtype))  # vectors: cast only


def _kahan_comps(trainer: L.Trainer) -> dict:
    return {p: st["kahan_comp"] for opt in trainer.optimizers for p, st in opt.state.items() if "kahan_comp" in st}


def test_one_update_fp16_six_matches_fp32():
    """Same initial weights (fp32, then rounded to fp16), same batch, same random draws.

    Tolerance, and why: the weights start one rounding apart (≤ ulp/2) and Adam's first step is
    lr·g/(|g|+ε) ≈ lr·sign(g), rounded once more onto the fp16 grid (≤ ulp/2), so an element
    agrees within one fp16 ulp of its value -- unless its gradient is so small that fp16
    rounding noise flips its sign, which moves it by at most 2·lr. We require ≥ 97% of all
    elements within one ulp and every element within 2·lr + ulp; Kahan-compensated parameters
    are compared through p - c, the value the compensated sum represents.
    """
    torch.manual_seed(0)
    m32 = make_module("precision=fp32", "agent.batch_size=16")
    torch.manual_seed(0)
    m16 = make_module("precision=fp16", "agent.batch_size=16")
    batch = make_batch(16)
    torch.manual_seed(1)
    fit(m32, [batch])
    torch.manual_seed(1)
    t16 = fit(m16, [batch])
    assert m16.skipped == {"critic": 0, "actor": 0, "alpha": 0}
    comps = _kahan_comps(t16)
    params16 = dict(m16.named_parameters())
    # fp16 derives its target critic (lowp.derived_target): compare fp32's stored copy with it
    updater = m16.target_updater
    params16.update({f"critic_target.{n}": t for n, t in zip(updater.param_names, updater.target_parameters())})
    within, total = 0, 0
    for name, p32 in m32.named_parameters():
        p16 = params16[name]
        value = p16.float() - (comps[p16].float() if p16 in comps else 0.0)
        diff = (value - p32.detach()).abs()
        ulp = torch.finfo(torch.float16).eps * p16.float().abs().clamp(min=2**-14)
        assert (diff <= 2 * LR + ulp).all(), name
        within += int((diff <= ulp).sum())
        total += diff.numel()
    assert within / total >= 0.97, within / total
    for key in ("critic_loss", "q", "target_q"):
        a, b = float(m32.metrics[key]), float(m16.metrics[key])
        assert abs(a - b) <= 2e-2 * max(1.0, abs(a)), (key, a, b)


def test_naive_fp16_fails_where_the_six_do_not():
    """Naive fp16 (Adam with ε = 1e-8, which is 0 in fp16): the first step divides by a zero
    second moment somewhere and the weights go non-finite (spec §0, pitfalls)."""
    torch.manual_seed(0)
    naive = make_module("precision=fp16", "lowp.all=false")
    with pytest.raises(NumericalFailure, match="non-finite critic"):  # the health check stops it
        fit(naive, [make_batch(seed=i) for i in range(2)])
    assert not naive.weights_are_finite()
    torch.manual_seed(0)
    six = make_module("precision=fp16")
    fit(six, [make_batch(seed=i) for i in range(2)])
    assert all(torch.isfinite(p).all() for p in six.parameters())


def test_checkpoint_round_trip_restores_scalers_optimizer_and_target_states(tmp_path):
    torch.manual_seed(0)
    module = make_module("precision=fp16", "lowp.init_scale=65504.0")  # forces backoffs
    trainer = fit(module, [make_batch(seed=i) for i in range(4)])
    assert any(s.skipped_steps for s in module.scalers.values())
    path = tmp_path / "c.ckpt"
    trainer.save_checkpoint(path, weights_only=False)

    restored = SACModule.load_from_checkpoint(path, map_location="cpu", weights_only=False)
    for (name, a), b in zip(module.state_dict().items(), restored.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert any("scaled_params" in k for k in restored.state_dict()) and any(
        "kahan_comp" in k for k in restored.state_dict()
    )
    # scaler and optimizer states (with the Kahan buffers) come back through the Trainer
    trainer2 = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    fresh = make_module("precision=fp16", "lowp.init_scale=65504.0")
    trainer2.fit(fresh, DataLoader([], batch_size=None), ckpt_path=path, weights_only=False)
    assert {n: s.state_dict() for n, s in fresh.scalers.items()} == {
        n: s.state_dict() for n, s in module.scalers.items()
    }
    assert fresh.updates == module.updates and fresh.skipped == module.skipped
    for opt_a, opt_b in zip(trainer.optimizers, trainer2.optimizers):
        sa, sb = opt_a.state_dict(), opt_b.state_dict()
        assert sa["param_groups"] == sb["param_groups"]
        for idx, state in sa["state"].items():
            for key, value in state.items():
                other = sb["state"][idx][key]
                assert torch.equal(value, other) if torch.is_tensor(value) else value == other, key


def test_pure_fp16_state_of_the_full_drq_agent_vs_fp32():
    """Full-size DrQ agent (84x84 pixels, 6-D actions): parameters + optimizer state + target
    copies of the default fp16 mode ≤ 0.60x fp32 (measured 57.7 vs 99.4 MiB = 0.581). Bytes per
    critic parameter: fp32 16 (p, m, v, target); fp16 10 (p, m, s, the ×K target copy and its
    Kahan buffer: the target is derived, Kahan-gradients are stochastic rounding). Each saving
    is a switch, and without both the published layout is back at 0.74."""
    sizes = {}
    for overrides in (
        ["precision=fp32"],
        ["precision=fp16"],
        ["precision=fp16", "lowp.derived_target=false", "lowp.stochastic_weights=false"],
    ):
        module = SACModule(to_plain(load_config(overrides)), (9, 84, 84), 6)
        optimizers = module.configure_optimizers()
        materialize_optimizer_state(optimizers)
        sizes[" ".join(overrides)] = state_bytes(module, optimizers)
    fp32, fp16, published = (sizes[k]["total"] for k in sizes)
    assert fp16 <= 0.60 * fp32, sizes
    assert published > 0.70 * fp32, sizes  # the bound can fail: the savings are what meets it
    critic = 4_208_504  # parameters of DrQ's critic (trunk included) at 84x84, 6-D actions
    assert published - fp16 == 2 * 2 * critic  # exactly the two fp16 tensors the switches drop


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_derived_target_gives_bitwise_the_same_updates_as_the_stored_one(precision):
    runs = {}
    for derived in (False, True):
        torch.manual_seed(0)
        module = make_module(f"precision={precision}", f"lowp.derived_target={str(derived).lower()}")
        torch.manual_seed(1)
        fit(module, [make_batch(seed=i) for i in range(5)])
        runs[derived] = module
    stored, derived = runs[False], runs[True]
    assert stored.critic_target is not None and derived.critic_target is None
    for (name, a), b in zip(stored.named_parameters(), derived.parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(stored.critic_target.parameters(), derived.target_updater.target_parameters()):
        assert torch.equal(a, b)
    assert float(stored.metrics["target_q"]) == float(derived.metrics["target_q"])


@pytest.mark.parametrize("updates", [0, 3])
def test_checkpoints_convert_between_a_stored_and_a_derived_target(updates):
    """Checkpoints written before lowp.derived_target hold critic_target.*; they load into a
    module that derives the target (and the other way round), with the same target."""
    torch.manual_seed(0)
    stored = make_module("precision=fp16", "lowp.derived_target=false")
    fit(stored, [make_batch(seed=i) for i in range(updates)])
    state = stored.state_dict()
    assert any(k.startswith("critic_target.") for k in state)
    derived = make_module("precision=fp16")
    derived.load_state_dict(state)  # strict
    x = (make_batch()["next_obs"].to(torch.float16), torch.zeros(4, 2, dtype=torch.float16))
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(stored.target_updater(*x), derived.target_updater(*x)))
    back = make_module("precision=fp16", "lowp.derived_target=false")
    back.load_state_dict(derived.state_dict())
    for a, b in zip(stored.critic_target.parameters(), back.critic_target.parameters()):
        assert torch.equal(a, b)


def test_tf32_only_when_asked_for_and_owned_by_the_policy():
    """fp32 means IEEE fp32 on a GPU unless perf.tf32=true; the policy sets torch's global
    switches both ways (a TF32 run earlier in the process does not leak into an fp32 one)."""
    before = (
        torch.get_float32_matmul_precision(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    )
    try:
        asked = PrecisionPolicy.from_config(load_config(["precision=fp32", "perf.tf32=true"]), "cuda")
        plain = PrecisionPolicy.from_config(load_config(["precision=fp32"]), "cuda")
        assert asked.tf32 and not plain.tf32
        assert not PrecisionPolicy.from_config(load_config(["precision=fp32", "perf.tf32=true"]), "cpu").tf32
        assert "TF32 tensor cores" in asked.describe() and "TF32 off" in plain.describe()
        asked.apply_global_numerics()
        assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
        assert torch.get_float32_matmul_precision() == "high"
        plain.apply_global_numerics()
        assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[1:]


@pytest.mark.parametrize("precision", ["fp16", "bf16", "amp"])
def test_half_matmuls_reduce_in_fp32(precision):
    """cuBLAS may split fp16/bf16 matmul reductions in reduced precision unless told not to; the
    half-precision numerics were validated with fp32 accumulation, so the policy turns it off."""
    matmul = torch.backends.cuda.matmul
    before = (matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction)
    try:
        matmul.allow_fp16_reduced_precision_reduction = True
        matmul.allow_bf16_reduced_precision_reduction = True
        PrecisionPolicy.from_config(load_config([f"precision={precision}"]), "cuda").apply_global_numerics()
        assert not matmul.allow_fp16_reduced_precision_reduction
        assert not matmul.allow_bf16_reduced_precision_reduction
    finally:
        matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction = before


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["precision=fp16"], True),
        (["precision=fp16", "lowp.stochastic_first_moment=false"], False),
        (["precision=bf16"], False),
        (["precision=bf16", "lowp.stochastic_first_moment=true"], True),
        (["precision=fp16", "lowp.stochastic_first_moment=true", "lowp.unbiased_moments=false"], False),
        (["precision=fp32", "lowp.stochastic_first_moment=true"], False),
    ],
)
def test_stochastic_first_moment_reaches_every_unbiased_hadam_group(overrides, expected):
    """The switch acts where hAdam's unbiased step writes the first moment (16 bits, unbiased
    moments), in every optimizer of the agent, and trains; elsewhere it is off."""
    module = make_module(*overrides)
    assert module.precision_policy.stochastic_first_moment is expected
    assert ("stochastic_first_moment" in module.precision_policy.describe()) is expected
    torch.manual_seed(1)
    fit(module, [make_batch(seed=i) for i in range(3)])
    hadam_groups = [g for o in module.optimizers() for g in o.optimizer.param_groups if "unbiased_moments" in g]
    assert len(hadam_groups) == (0 if overrides[0] == "precision=fp32" else 3)
    assert all(group["stochastic_first_moment"] is expected for group in hadam_groups)
    assert all(torch.isfinite(p.float()).all() for p in module.parameters())


def test_a_checkpoint_without_a_newer_group_switch_resumes_with_the_runs_value():
    """A checkpoint written before ``stochastic_first_moment`` existed holds groups without it:
    torch's ``load_state_dict`` would drop the key (so the run would silently round ``m`` to
    nearest while its config says otherwise); the run's built value stays. A key the checkpoint
    holds is the checkpoint's."""
    from pixelsac.lowp import HAdam

    def built() -> HAdam:
        param = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
        optimizer = HAdam([param], lr=1e-3, unbiased_moments=True, stochastic_first_moment=True)
        param.grad = torch.full_like(param, 0.5)
        optimizer.step()
        return keep_execution_flags(optimizer)

    old = built().state_dict()
    del old["param_groups"][0]["stochastic_first_moment"]
    resumed = built()
    resumed.load_state_dict(old)
    assert resumed.param_groups[0]["stochastic_first_moment"] is True
    unhooked = HAdam([torch.nn.Parameter(torch.ones(4, dtype=torch.float16))], lr=1e-3, stochastic_first_moment=True)
    unhooked.load_state_dict(old)  # torch alone drops the key
    assert "stochastic_first_moment" not in unhooked.param_groups[0]
    saved_off = built().state_dict()
    saved_off["param_groups"][0]["stochastic_first_moment"] = False
    resumed.load_state_dict(saved_off)
    assert resumed.param_groups[0]["stochastic_first_moment"] is False
