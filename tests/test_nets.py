"""pixelsac/nets.py: the DrQ networks' shapes and wiring (the actor reads the trunk without
training it; state observations skip trunk and projections) and the speed switches applied in
place (channels-last weights, compiled parts with names and optimizers unchanged)."""

from __future__ import annotations

import pytest
import torch

from pixelsac.config import load_config
from pixelsac.nets import ConvTrunk, apply_speed_options, build_networks


def agent_cfg(*overrides: str):
    return load_config(["agent.num_filters=4", "agent.feature_dim=8", "agent.hidden_dim=16", *overrides]).agent


@pytest.mark.parametrize("layers,side", [(4, 24), (2, 32), (1, 84)])
def test_conv_trunk_output_size_matches_its_formula(layers, side):
    trunk = ConvTrunk((9, side, side), num_filters=4, num_layers=layers)
    features = trunk(torch.zeros(2, 9, side, side))
    assert features.shape == (2, trunk.out_dim)
    assert trunk.out_dim == 4 * ((side - 3) // 2 + 1 - 2 * (layers - 1)) ** 2


def test_pixel_networks_shapes_and_the_detached_trunk():
    actor, critic = build_networks((9, 24, 24), 3, agent_cfg())
    obs = torch.rand(5, 9, 24, 24)  # pixels scaled to [0, 1], as cast_observation gives them
    q1, q2 = critic(obs, torch.zeros(5, 3))
    assert q1.shape == q2.shape == (5, 1) and not torch.equal(q1, q2)  # two independent heads
    mu, log_std = actor(critic.trunk(obs).detach())
    assert mu.shape == log_std.shape == (5, 3)
    cfg = agent_cfg()
    assert torch.all(log_std >= cfg.log_std_min) and torch.all(log_std <= cfg.log_std_max)
    # the actor's loss reaches its own parameters, never the critic's convolutions
    mu.sum().backward()
    assert all(p.grad is None for p in critic.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in actor.parameters())


def test_state_networks_have_no_trunk_or_projection():
    actor, critic = build_networks((5,), 2, agent_cfg())
    assert critic.trunk.out_dim == 5 and isinstance(critic.proj, torch.nn.Identity)
    assert isinstance(actor.proj, torch.nn.Identity)
    q1, _ = critic(torch.zeros(3, 5), torch.zeros(3, 2))
    assert q1.shape == (3, 1)


def test_drq_init_orthogonal_weights_zero_biases():
    actor, critic = build_networks((9, 24, 24), 2, agent_cfg())
    for module in [*actor.modules(), *critic.modules()]:
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
            assert torch.count_nonzero(module.bias) == 0
            w = module.weight.flatten(1)
            rows, cols = w.shape
            gram = w @ w.T if rows <= cols else w.T @ w
            gain = torch.nn.init.calculate_gain("relu") if isinstance(module, torch.nn.Conv2d) else 1.0
            torch.testing.assert_close(gram / gain**2, torch.eye(min(rows, cols)), atol=1e-4, rtol=0)


def test_speed_options_change_layout_and_compile_in_place():
    class Agent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.actor, self.critic = build_networks((9, 24, 24), 2, agent_cfg())
            self.critic_target = None  # a derived target: nothing stored to compile

    agent = Agent()
    names = [n for n, _ in agent.named_parameters()]
    obs, action = torch.rand(2, 9, 24, 24), torch.zeros(2, 2)
    before = agent.critic(obs, action)
    apply_speed_options(agent, channels_last=True, compile=True, compile_backend="eager")
    conv = agent.critic.trunk.convs[0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    assert [n for n, _ in agent.named_parameters()] == names  # optimizers and checkpoints see the same names
    torch.testing.assert_close(agent.critic(obs, action), before)
