"""The precision policy: modes, parity of one fp16 + six update with fp32, checkpoints that carry
every low-precision state, and the memory the pure fp16 agent saves."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from pixelsac.config import load_config, to_plain
from pixelsac.module import SACModule
from pixelsac.precision import NumericalFailure
from pixelsac.precision import SIX, PrecisionPolicy, materialize_optimizer_state, state_bytes
from test_module import fit, make_batch, make_module

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
    assert policy("precision=fp16").adam_eps == 1e-4 and policy("precision=fp16", "lowp.loss_scaling=false").adam_eps == 1e-8
    assert policy("precision=fp16").fp32_accumulate and not policy("precision=fp16", device="cuda").fp32_accumulate
    assert not policy("precision=fp16", "lowp.fp32_accumulate=false").fp32_accumulate
    assert policy("precision=amp").param_dtype == torch.float32
    assert "naive" not in policy("precision=fp16", "lowp.all=false").describe()
    assert "modifications: none" in policy("precision=fp16", "lowp.all=false").describe()


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
    within, total = 0, 0
    for name, p32 in m32.named_parameters():
        p16 = params16[name]
        value = p16.float() - (comps[p16].float() if p16 in comps else 0.0)
        diff = (value - p32.detach()).abs()
        ulp = torch.finfo(torch.float16).eps * p16.float().abs().clamp(min=2 ** -14)
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
    assert any("scaled_params" in k for k in restored.state_dict()) and any("kahan_comp" in k for k in restored.state_dict())
    # scaler and optimizer states (with the Kahan buffers) come back through the Trainer
    trainer2 = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    fresh = make_module("precision=fp16", "lowp.init_scale=65504.0")
    trainer2.fit(fresh, DataLoader([], batch_size=None), ckpt_path=path, weights_only=False)
    assert {n: s.state_dict() for n, s in fresh.scalers.items()} == {n: s.state_dict() for n, s in module.scalers.items()}
    assert fresh.updates == module.updates and fresh.skipped == module.skipped
    for opt_a, opt_b in zip(trainer.optimizers, trainer2.optimizers):
        sa, sb = opt_a.state_dict(), opt_b.state_dict()
        assert sa["param_groups"] == sb["param_groups"]
        for idx, state in sa["state"].items():
            for key, value in state.items():
                other = sb["state"][idx][key]
                assert torch.equal(value, other) if torch.is_tensor(value) else value == other, key


def test_pure_fp16_state_of_the_full_drq_agent_vs_fp32():
    """Full-size DrQ agent (84x84 pixels, 6-D actions). Parameters + optimizer state: ≤ 0.6x of
    fp32 (hAdam's two moments and the critic's Kahan buffer in fp16 against Adam's two fp32
    moments). With the target copies (the target critic, plus Kahan-momentum's scaled copy and
    compensation buffer) the ratio is higher; the bound below pins the measured layout."""
    sizes = {}
    for precision in ("fp32", "fp16"):
        module = SACModule(to_plain(load_config([f"precision={precision}"])), (9, 84, 84), 6)
        optimizers = module.configure_optimizers()
        materialize_optimizer_state(optimizers)
        sizes[precision] = state_bytes(module, optimizers)
    learner = {p: sizes[p]["parameters"] + sizes[p]["optimizer"] for p in sizes}
    assert learner["fp16"] <= 0.6 * learner["fp32"], sizes
    assert sizes["fp16"]["total"] <= 0.75 * sizes["fp32"]["total"], sizes
    print(sizes)
