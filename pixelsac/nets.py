"""The DrQ networks: a conv trunk shared by actor and critic, per-head projections, the actor and
the double-Q critic. For state observations the trunk and projections are the identity.

Layout (DrQ, Kostrikov et al. 2020)::

    obs (uint8 frames) -> /255 in the model dtype, once per batch (PrecisionPolicy.cast_observation)
      -> ConvTrunk: conv3x3 s2 + (L-1) x conv3x3 s1, 32 ch, ReLU -> flat      (shared)
      -> Projection: Linear -> LayerNorm -> tanh                       (one per head)
      -> Actor: MLP -> (mu, log_std),   Critic: two MLPs on [features, action] -> Q1, Q2

The actor reads the trunk's features detached: only the critic loss trains the convolutions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from pixelsac import lowp


def mlp(in_dim: int, hidden_dim: int, out_dim: int, hidden_depth: int) -> nn.Sequential:
    """``hidden_depth`` hidden layers of ``hidden_dim`` ReLU units, then a linear output."""
    layers: list[nn.Module] = []
    dim = in_dim
    for _ in range(hidden_depth):
        layers += [nn.Linear(dim, hidden_dim), nn.ReLU(inplace=True)]
        dim = hidden_dim
    layers.append(nn.Linear(dim, out_dim))
    return nn.Sequential(*layers)


def orthogonal_init_(module: nn.Module) -> None:
    """DrQ's init: orthogonal weights (ReLU gain for convolutions), zero biases."""
    if isinstance(module, nn.Linear):
        nn.init.orthogonal_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Conv2d):
        nn.init.orthogonal_(module.weight, gain=nn.init.calculate_gain("relu"))
        if module.bias is not None:
            nn.init.zeros_(module.bias)


class ConvTrunk(nn.Module):
    """DrQ's convolutions: ``num_layers`` 3x3 convs (the first with stride 2), ReLU, flattened."""

    def __init__(self, obs_shape: tuple[int, ...], num_filters: int = 32, num_layers: int = 4) -> None:
        super().__init__()
        channels, height, width = obs_shape
        layers: list[nn.Module] = [nn.Conv2d(channels, num_filters, 3, stride=2), nn.ReLU(inplace=True)]
        for _ in range(num_layers - 1):
            layers += [nn.Conv2d(num_filters, num_filters, 3, stride=1), nn.ReLU(inplace=True)]
        self.convs = nn.Sequential(*layers)
        side_h = (height - 3) // 2 + 1 - 2 * (num_layers - 1)
        side_w = (width - 3) // 2 + 1 - 2 * (num_layers - 1)
        self.out_dim = num_filters * side_h * side_w

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # Pixels arrive scaled to [0, 1] (PrecisionPolicy.cast_observation: once per batch, after
        # the augmentation has shifted the exact uint8 frames), not as DrQ's encoder takes them.
        return self.convs(pixels).flatten(1)


class IdentityTrunk(nn.Module):
    """State observations: the flat vector is the feature."""

    def __init__(self, obs_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.out_dim = int(obs_shape[0])

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return obs


class Projection(nn.Module):
    """Linear -> LayerNorm -> tanh: the per-head bottleneck of DrQ's encoder."""

    def __init__(self, in_dim: int, feature_dim: int) -> None:
        super().__init__()
        # SplitKLinear is nn.Linear until the precision policy sets its split (fp16/bf16 on CUDA)
        self.net = nn.Sequential(lowp.SplitKLinear(in_dim, feature_dim), nn.LayerNorm(feature_dim), nn.Tanh())
        self.out_dim = feature_dim

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features)


class Actor(nn.Module):
    """Gaussian policy head: features -> (mu, log_std) with log_std squashed into [min, max].

    It hands over log σ rather than σ so the low-precision log-density can use it directly."""

    def __init__(
        self,
        in_dim: int,
        action_dim: int,
        feature_dim: int | None,
        hidden_dim: int,
        hidden_depth: int,
        log_std_min: float,
        log_std_max: float,
    ) -> None:
        super().__init__()
        self.proj = Projection(in_dim, feature_dim) if feature_dim else nn.Identity()
        self.policy = mlp(feature_dim or in_dim, hidden_dim, 2 * action_dim, hidden_depth)
        self.log_std_min, self.log_std_max = log_std_min, log_std_max

    def forward(self, trunk_features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, log_std = self.policy(self.proj(trunk_features)).chunk(2, dim=-1)
        # tanh rescaling keeps log_std in [min, max] with a gradient everywhere (DrQ, SAC-AE)
        log_std = self.log_std_min + 0.5 * (self.log_std_max - self.log_std_min) * (torch.tanh(log_std) + 1)
        return mu, log_std


class Critic(nn.Module):
    """Double-Q critic that owns the trunk (the critic loss is what trains the convolutions)."""

    def __init__(
        self, trunk: nn.Module, action_dim: int, feature_dim: int | None, hidden_dim: int, hidden_depth: int
    ) -> None:
        super().__init__()
        self.trunk = trunk
        self.proj = Projection(trunk.out_dim, feature_dim) if feature_dim else nn.Identity()
        in_dim = (feature_dim or trunk.out_dim) + action_dim
        self.q1 = mlp(in_dim, hidden_dim, 1, hidden_depth)
        self.q2 = mlp(in_dim, hidden_dim, 1, hidden_depth)
        # set by the precision policy (lowp.fp32_q_output): Q's last layer sums in fp32 and keeps
        # the fp32 result instead of rounding it to the weights' dtype
        self.fp32_q_output = False

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.heads(self.trunk(obs), action)

    def heads(
        self, trunk_features: torch.Tensor, action: torch.Tensor, fp32: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Q1, Q2 from precomputed trunk features (lets the actor update reuse one detached pass).

        ``fp32``: the projection and both Q MLPs compute in fp32 from their 16-bit weights (each
        weight upcast exactly, no rounding between layers, forward or backward); Q comes out in
        fp32 and the gradient reaching ``action`` is rounded once, to the action's dtype. For
        the actor's loss (``lowp.fp32_actor_loss``)."""
        if fp32:
            x = torch.cat([in_fp32(self.proj, trunk_features), action.float()], dim=-1)
            return in_fp32(self.q1, x), in_fp32(self.q2, x)
        x = torch.cat([self.proj(trunk_features), action], dim=-1)
        return self._q(self.q1, x), self._q(self.q2, x)

    def _q(self, head: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        if not self.fp32_q_output:
            return head(x)
        *hidden, last = head  # the layers themselves: slicing would build a new Sequential per call
        for layer in hidden:
            x = layer(x)
        return F.linear(x.float(), last.weight.float(), last.bias.float())


def in_fp32(layer: nn.Module, x: torch.Tensor) -> Any:
    """``layer(x)`` with its parameters and input upcast to fp32 (exact); gradients flow back to
    the 16-bit parameters through the casts, each rounded once."""
    params = {name: p.float() for name, p in layer.named_parameters()}
    return functional_call(layer, params, (x.float(),))


def build_networks(obs_shape: tuple[int, ...], action_dim: int, agent_cfg) -> tuple[Actor, Critic]:
    """Actor and critic for pixel (3-D ``obs_shape``) or state (1-D) observations."""
    if len(obs_shape) == 3:
        trunk: nn.Module = ConvTrunk(obs_shape, agent_cfg.num_filters, agent_cfg.num_conv_layers)
        feature_dim: int | None = agent_cfg.feature_dim
    else:
        trunk, feature_dim = IdentityTrunk(obs_shape), None
    critic = Critic(trunk, action_dim, feature_dim, agent_cfg.hidden_dim, agent_cfg.hidden_depth)
    actor = Actor(
        trunk.out_dim,
        action_dim,
        feature_dim,
        agent_cfg.hidden_dim,
        agent_cfg.hidden_depth,
        agent_cfg.log_std_min,
        agent_cfg.log_std_max,
    )
    critic.apply(orthogonal_init_)
    actor.apply(orthogonal_init_)
    return actor, critic


def apply_speed_options(
    module: Any, channels_last: bool, compile: bool, compile_mode: str = "default", compile_backend: str = "inductor"
) -> None:
    """GPU-speed switches that need no change to the module's code (``perf.channels_last``,
    ``perf.compile``; the benchmark measures each on and off).

    ``channels_last``: every 4-D tensor of the module (conv weights of the critic, its target
    and the Kahan-momentum copies) in NHWC, so cuDNN runs the trunk's convolutions channels-last
    (a convolution follows its weight's memory format). ``compile``: ``nn.Module.compile`` on the
    trunk, projection and Q heads of the critic and its target, and on the actor -- in place, so
    parameter names, optimizers and checkpoints are unchanged. The augmentation, the losses'
    elementwise math and the optimizers stay eager.
    """
    if channels_last:
        module.to(memory_format=torch.channels_last)
    if compile:
        kwargs: dict[str, Any] = {"backend": compile_backend}
        if compile_backend == "inductor" and compile_mode != "default":
            kwargs["mode"] = compile_mode
        # a derived target (lowp.derived_target) runs the critic itself with other parameters
        for critic in filter(None, (module.critic, module.critic_target)):
            for part in (critic.trunk, critic.proj, critic.q1, critic.q2):
                part.compile(**kwargs)
        module.actor.compile(**kwargs)
