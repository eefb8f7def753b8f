"""The SAC module: one update on a synthetic batch, in each precision mode."""

import math

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from pixelsac.config import load_config, to_plain
from pixelsac.module import SACModule
from pixelsac.precision import tensors_not_in

OBS_SHAPE = (9, 24, 24)
ACTION_DIM = 2


def make_module(*overrides: str) -> SACModule:
    cfg = load_config(
        [
            "env.image_size=24",
            "agent.num_filters=4",
            "agent.feature_dim=8",
            "agent.hidden_dim=16",
            "agent.batch_size=4",
            "train.log_every_updates=1",
            *overrides,
        ]
    )
    return SACModule(to_plain(cfg), OBS_SHAPE, ACTION_DIM)


def mode(name: str) -> list[str]:
    """Overrides for a precision mode; ``fp16-six`` is fp16 with the published six only."""
    return ["precision=fp16", "lowp.unbiased_moments=false"] if name == "fp16-six" else [f"precision={name}"]


def make_batch(batch_size: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "obs": torch.randint(0, 256, (batch_size, *OBS_SHAPE), generator=g, dtype=torch.uint8),
        "next_obs": torch.randint(0, 256, (batch_size, *OBS_SHAPE), generator=g, dtype=torch.uint8),
        "action": torch.rand(batch_size, ACTION_DIM, generator=g) * 2 - 1,
        "reward": torch.rand(batch_size, 1, generator=g),
        "not_terminal": torch.ones(batch_size, 1),
    }


def moved(module: SACModule, trainer: L.Trainer, before: dict[str, torch.Tensor], name: str) -> bool:
    """The parameter changed, or (Kahan update) its compensation holds a sub-ulp step."""
    param = dict(module.named_parameters())[name]
    if not torch.equal(before[name], param):
        return True
    for opt in trainer.optimizers:
        comp = opt.state.get(param, {}).get("kahan_comp")
        if comp is not None and bool(comp.ne(0).any()):
            return True
    return False


def fit(module: SACModule, batches: list[dict]) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(batches, batch_size=None))
    return trainer


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_one_fp32_update_changes_every_parameter():
    torch.manual_seed(0)
    module = make_module("precision=fp32")
    before = snapshot(module)
    fit(module, [make_batch()])
    assert module.updates == 1
    for name, value in module.named_parameters():
        assert not torch.equal(before[name], value), f"{name} did not change"


@pytest.mark.parametrize("sync_free", [False, True], ids=["host", "sync_free"])
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16", "amp+fixes"])
def test_updates_change_parameters_and_keep_losses_finite(precision, sync_free):
    """A few updates: loss scalers may skip the first steps on overflow (AMP's GradScaler starts
    at 65536) and a Kahan-compensated step smaller than half an ulp of log_alpha first lands in
    the compensation buffer -- both by design."""
    torch.manual_seed(0)
    overrides = (
        ["precision=amp", "lowp.normal_fix=true", "lowp.softplus_fix=true"]
        if precision == "amp+fixes"
        else [f"precision={precision}"]
    )
    module = make_module(*overrides, f"perf.sync_free={str(sync_free).lower()}")
    before = snapshot(module)
    trainer = fit(module, [make_batch(seed=i) for i in range(16)])
    after = module.state_dict()
    assert module.updates == 16
    assert module.skipped["critic"] < 4 and module.skipped["actor"] < 4, module.skipped
    for name in ("critic.trunk.convs.0.weight", "critic.q1.0.weight", "actor.policy.0.weight", "log_alpha"):
        assert moved(module, trainer, before, name), f"{name} did not change"
    # a stored target critic, or (lowp.derived_target) the xK copy it is derived from
    target_keys = [k for k in before if k.startswith(("critic_target.", "target_updater.scaled_params."))]
    assert target_keys and any(not torch.equal(before[k], after[k]) for k in target_keys), "the target did not move"
    for key, value in module.metrics.items():
        assert torch.isfinite(value).all(), f"{key} = {value}"
    assert set(module.metrics) >= {"critic_loss", "actor_loss", "alpha_loss", "entropy", "alpha"}
    for name, tensor in after.items():
        if tensor.is_floating_point():
            assert torch.isfinite(tensor).all(), name


@pytest.mark.parametrize("sync_free", [False, True], ids=["host", "sync_free"])
def test_plain_amp_actor_overflows_as_the_paper_reports(sync_free):
    """Standard mixed precision: autocast leaves the Gaussian log-density's elementwise ops in
    fp16, whose backward overflows; GradScaler then skips every actor step (paper, §AMP). The
    same run with normal-fix and softplus-fix steps (previous test). Sync-free: fused Adam takes
    GradScaler's flag on the device and the skips are still counted."""
    torch.manual_seed(0)
    module = make_module("precision=amp", f"perf.sync_free={str(sync_free).lower()}")
    before = snapshot(module)
    fit(module, [make_batch(seed=i) for i in range(16)])
    assert module.skipped["actor"] == 8
    assert torch.equal(before["actor.policy.0.weight"], module.state_dict()["actor.policy.0.weight"])
    assert module.skipped["critic"] < 4


def test_actor_loss_does_not_train_the_convolutions():
    torch.manual_seed(0)
    module = make_module("precision=fp32")
    fit(module, [])  # sets the trainer up without an update
    obs = module.precision_policy.cast_observation(make_batch()["obs"])
    actor_loss, _, _ = module.actor_and_alpha_loss(obs)
    actor_loss.backward()
    assert all(p.grad is None for p in module.critic.trunk.parameters())
    assert any(p.grad is not None for p in module.actor.parameters())


def test_the_temperatures_backward_forms_its_gradient_alone():
    """DrQ's temperature loss α·E[-log π - H̄] has the gradient α·E[...] in log α. Its published
    form's backward forms S·E[...] first, 1/α times that: with α = 0.05 and E[...] = 2, at the
    fp16 temperature's loss scale of 4e4 that is 8e4, past fp16's range, while the scaled
    gradient itself is 4e3 (6% of it). The module's loss, log α times the constant α·E[...],
    gives that gradient from one product: finite, and float64's within fp16's rounding. In
    float64 the two forms have the same gradient."""
    torch.manual_seed(0)
    module = make_module("precision=fp16")
    fit(module, [])  # sets the trainer up without an update
    policy = module.precision_policy
    obs = policy.cast_observation(make_batch()["obs"])
    with torch.no_grad():
        module.log_alpha.fill_(math.log(0.05))
    torch.manual_seed(1)
    with policy.compute_context():
        _, _, metrics = module.actor_and_alpha_loss(obs)
    module.target_entropy = float(metrics["entropy"]) - 2.0  # E[-log π - H̄] = 2
    torch.manual_seed(1)  # the same actions, so the same log π
    with policy.compute_context():
        _, alpha_loss, metrics = module.actor_and_alpha_loss(obs)
    scale = 4e4
    gap = metrics["entropy"].double() - module.target_entropy
    assert float(gap) == pytest.approx(2.0, rel=1e-3)
    assert module.log_alpha.dtype == alpha_loss.dtype == torch.float16

    def grad_of(loss: torch.Tensor) -> torch.Tensor:
        module.log_alpha.grad = None
        (loss * scale).backward(inputs=[module.log_alpha])
        return module.log_alpha.grad.double()

    alpha64 = math.exp(float(module.log_alpha))  # the fp16 log α, widened exactly
    expected = scale * alpha64 * float(gap)
    assert float(grad_of(alpha_loss)) == pytest.approx(expected, rel=2e-3)
    published = module.alpha * (metrics["entropy"] - module.target_entropy)  # α·E[...], as published
    assert not bool(torch.isfinite(grad_of(published)))  # S·E[...] = 8e4 overflowed on the way

    log_alpha = torch.tensor(math.log(0.05), dtype=torch.float64, requires_grad=True)
    gaps = torch.randn(64, dtype=torch.float64) + 2.0
    (published_grad,) = torch.autograd.grad((log_alpha.exp() * gaps).mean(), log_alpha)
    (module_grad,) = torch.autograd.grad(log_alpha * (log_alpha.exp().detach() * gaps.mean()), log_alpha)
    assert float(module_grad) == pytest.approx(float(published_grad), rel=1e-14)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_each_backward_computes_only_its_own_optimizers_gradients(precision):
    """The actor's loss reads the critic's heads (in fp32 for fp16/bf16), but its backward
    computes no gradient for them: the critic's gradients after a full update are exactly those
    of the critic's own backward (a plain backward adds the actor's to them, work the critic's
    next step throws away: on a GPU, every Q-layer weight gradient and its cast back)."""
    torch.manual_seed(0)
    module = make_module(f"precision={precision}")
    own: dict[str, torch.Tensor] = {}
    step = module._step

    def spy(name, loss, optimizer):
        step(name, loss, optimizer)
        if name == "critic":
            own.update({n: p.grad.clone() for n, p in module.critic.named_parameters() if p.grad is not None})

    module._step = spy
    fit(module, [make_batch()])
    assert module.updates == 1 and "q1.0.weight" in own and "proj.net.0.weight" in own
    for name, param in module.critic.named_parameters():
        assert torch.equal(param.grad, own[name]), f"the actor's backward wrote critic.{name}.grad"
    assert all(p.grad is not None for p in module.actor.parameters())


def test_the_actor_backward_timing_tool_checks_both_forms_agree(tmp_path):
    """tools/instruments/actor_backward_timing.py (the measurement behind the own-gradients change) runs the
    full-size agent, holds the actor's gradients of both forms equal and writes its table."""
    from conftest import load_tool

    tool = load_tool("instruments/actor_backward_timing.py")
    out = tmp_path / "timing"
    assert tool.main(["--precisions", "fp32", "--batches", "2", "--rounds", "1", "--out", str(out)]) == 0
    assert "| fp32 | 2 |" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("precision,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_pure_low_precision_has_no_fp32_tensor_anywhere(precision, dtype):
    torch.manual_seed(0)
    module = make_module(f"precision={precision}")
    trainer = fit(module, [make_batch(), make_batch(seed=1)])
    assert tensors_not_in(dtype, module, trainer.optimizers) == []
    assert module.log_alpha.dtype == dtype


def test_act_is_bounded_and_deterministic_without_sampling():
    module = make_module("precision=fp32")
    obs = np.random.default_rng(0).integers(0, 256, (3, *OBS_SHAPE), dtype=np.uint8)
    a1, a2 = module.act(obs, sample=False), module.act(obs, sample=False)
    assert a1.shape == (3, ACTION_DIM) and a1.dtype == np.float32
    assert np.array_equal(a1, a2) and np.abs(a1).max() <= 1.0
    assert not np.array_equal(module.act(obs, sample=True), a1)


def test_update_uses_k_target_copies_m_q_copies_and_the_first_for_the_actor():
    """DrQ's schedule: K shifted copies of next_obs for the target, M of obs for the Q loss, and
    the actor on the critic's first copy of obs (DrQ's ``obs``), not on a fresh shift."""
    module = make_module(
        "precision=fp32", "agent.aug_target_copies=3", "agent.aug_q_copies=2", "agent.actor_update_every=1"
    )
    calls, actor_inputs = [], []
    real_copies, real_actor_loss = module.augment.copies, module.actor_and_alpha_loss

    def spy(images, n):
        out = real_copies(images, n)
        calls.append((images.dtype, n, out.shape[0]))
        if n == 2:
            calls.append(out.clone())
        return out

    def actor_spy(obs_aug):
        actor_inputs.append(obs_aug.clone())
        return real_actor_loss(obs_aug)

    module.augment.copies = spy
    module.actor_and_alpha_loss = actor_spy
    fit(module, [make_batch()])
    # shifted as uint8 frames (cast after), next_obs first
    assert calls[0] == (torch.uint8, 3, 12) and calls[1] == (torch.uint8, 2, 8)
    q_copies = calls[2].float() / 255.0  # as the networks read them (cast_observation)
    assert len(actor_inputs) == 1 and actor_inputs[0].shape[0] == 4
    assert torch.equal(actor_inputs[0], q_copies[:4])


@pytest.mark.parametrize("precision", ["fp32", "fp16", "fp16-six", "bf16", "amp"])
def test_sync_free_update_never_waits_for_the_device(precision):
    """No tensor is read on the host inside a sync-free update (between logging intervals):
    no loss-scale decision, skip count, K·theta check or augmentation offset. The same update
    with host decisions and kornia's crop reads many, so the counter can fail."""
    from test_lowp_sync_free import HostReads

    counts = {}
    for sync_free in (False, True):
        reads = HostReads()

        class Counted(SACModule):
            reads_counter = reads  # bound now: the class is used within this iteration only

            def training_step(self, dataloader_iter):
                with self.reads_counter:
                    return super().training_step(dataloader_iter)

        module = make_module(
            *mode(precision),
            "train.log_every_updates=1000",
            f"perf.sync_free={str(sync_free).lower()}",
            f"perf.aug_backend={'index' if sync_free else 'kornia'}",
        )
        module.__class__ = Counted
        fit(module, [make_batch(seed=i) for i in range(3)])
        assert module.updates == 3
        counts[sync_free] = dict(reads.calls)
    assert counts[True] == {}, counts[True]
    assert sum(counts[False].values()) >= 3, counts[False]
