"""Low-precision building blocks for pure-fp16 Soft Actor-Critic.

The six numerical modifications of Björck et al., "Low-Precision Reinforcement Learning:
Running Soft Actor-Critic in Half Precision" (ICML 2021), as a library that imports only
torch:

* :class:`HAdam` — Adam with a root second moment (hAdam), optional Kahan-gradients; its
  float32 step (``fused.py``) runs eagerly or compiled into a few kernels.
* :class:`KahanAdam` — plain Adam with Kahan-gradients (for the "no hAdam" ablation).
* :class:`CompoundLossScaler` — loss scaling carried into the optimizer state.
* :class:`KahanEMA` — Kahan-momentum for the target network; its flat update optionally compiled
  into one op (``fused_target.py``).
* :class:`SquashedNormal` — tanh-Gaussian with the softplus-fix and normal-fix.
* :func:`fp32_accumulate` — CPU emulation of fp16 tensor-core matmuls/convolutions.
* :func:`split_k_linear`, :class:`SplitKLinear` — split-K for long fp16/bf16 matmuls with every
  sum in fp32 (the parallelism of cuBLAS's split-K without its reduced-precision reductions).
* :func:`all_finite` — one-pass finiteness checks for gradients and optimizer state.
* :func:`stochastic_round` — deterministic, unbiased rounding from float32 into fp16/bf16
  (hAdam's ``unbiased_moments``, beyond the paper).
"""

from .distributions import (
    SquashedNormal,
    gaussian_log_prob,
    stable_softplus,
    tanh_log_abs_det_jacobian,
)
from .ema import KahanEMA
from .emulate import fp32_accumulate
from .finite import all_finite
from .hadam import HAdam
from .kahan import kahan_add_
from .kahan_adam import KahanAdam
from .rounding import stochastic_round
from .scaler import (
    CompoundLossScaler,
    LossScale,
    graph_capturing,
    optimizer_state_is_finite_after,
    rescale_optimizer_state_,
)
from .splitk import SplitKLinear, describe_split_k, reset_split_k_paths, split_count, split_k_linear, split_k_paths

__all__ = [
    "HAdam",
    "KahanAdam",
    "CompoundLossScaler",
    "LossScale",
    "graph_capturing",
    "rescale_optimizer_state_",
    "optimizer_state_is_finite_after",
    "KahanEMA",
    "SquashedNormal",
    "stable_softplus",
    "gaussian_log_prob",
    "tanh_log_abs_det_jacobian",
    "fp32_accumulate",
    "split_k_linear",
    "split_count",
    "SplitKLinear",
    "split_k_paths",
    "describe_split_k",
    "reset_split_k_paths",
    "all_finite",
    "kahan_add_",
    "stochastic_round",
]
