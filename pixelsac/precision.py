"""The precision policy: the one place that decides dtypes and the numerical machinery.

Modes (``precision=...``) and what each implies; every ``lowp.*`` switch set explicitly wins,
``lowp.all`` sets all six at once (``precision=fp16 lowp.all=false`` is *naive fp16*):

=======  ============  =====================================================================
mode     parameters    machinery
=======  ============  =====================================================================
fp32     float32       torch Adam, plain EMA target, reference log-prob forms (DrQ as published)
fp16     float16       pure fp16 with the six modifications of Björck et al. (2021)
bf16     bfloat16      pure bf16; bf16 has fp32's range, so no loss scaling, the rest on
amp      float32       autocast to fp16 + one torch GradScaler per optimizer (standard mixed)
=======  ============  =====================================================================

In the pure low-precision modes every parameter, target copy, ``log_alpha`` and optimizer state
tensor has the parameter dtype.

``lowp.unbiased_moments`` (on by default in fp16 and bf16; beyond the paper) makes hAdam compute
each step in float32 from the 16-bit state and round the root moment stochastically, so the
optimizer tracks float64 Adam instead of taking 1.3-1.55x too large steps (see
``lowp/hadam.py``); ``lowp.unbiased_moments=false`` is the published six. ``lowp.all`` sets the
six only. It acts inside hAdam, so it does nothing where ``lowp.hadam`` is off.

Two switches keep pure fp16 in range at full size (on by default in fp16 and bf16; beyond the
paper, ``false`` gives the published form): ``lowp.adaptive_target_scale`` gives each tensor of
Kahan-momentum's scaled copy its own power-of-two scale ``K·2^-k``, re-chosen on the device before
every target update, instead of one K = 1e4 that caps every critic weight at 6.55 in fp16 (the
full-size DrQ critic passed it after ~4,850 updates); ``lowp.fp32_q_output`` keeps the critic's Q
values, TD target, TD error and squared loss in fp32 from the 16-bit weights, so returns of
hundreds neither square to inf nor overflow the scaled loss ``S·L``.

Two memory savings, each its own switch (state bytes: ``python -m pixelsac.bench``):
``lowp.derived_target`` (on by default in fp16/bf16 where Kahan-momentum runs) does not store the
target critic but computes it from the ×K copy when used -- bitwise the same updates;
``lowp.stochastic_weights`` (on by default in fp16, off in bf16) realises Kahan-gradients by the
unbiased step's stochastic rounding of the weight instead of a compensation buffer -- sub-ulp
steps still add up, on average rather than exactly (measured on critic weights over 3,000 steps:
displacement ÷ float64 1.000 ± 0.012 against Kahan's ± 0.004; in bf16 ± 0.07 against ± 0.02, so
bf16 keeps the buffer).

``perf.sync_free`` (default: on for CUDA) keeps every decision of an update on the device: hAdam
capturable (its step counts on the device, so the loss scaler tells it to skip there; fp16 + six,
bf16), fused torch Adam (fp32, AMP, where GradScaler then needs no host read either) with its
step count on the device, the target's ``K·θ`` check deferred to the health check. fp32 on CUDA
runs fused Adam either way, so the switch changes where its step count is read, not its kernels.
The loss scaler decides on the device either way; an optimizer that counts on the host (hAdam
with the switch off, or torch Adam or KahanAdam in the no-hAdam ablation) has the decision read
on the host. On a CPU, ``lowp.fp32_accumulate`` (on by default there) runs
convolutions and matmuls with fp32 accumulation and rounds their outputs to fp16 -- what GPU
tensor cores do -- because this CPU's native fp16 kernels are 5-14x slower than fp32. Storage and
every elementwise op stay fp16.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from pixelsac import lowp
from pixelsac.config import SIX  # the six switch names: one list, the config's

_PARAM_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "amp": torch.float32}
#: the wide arithmetics a trained agent can be judged or evaluated in (:meth:`PrecisionPolicy.widened`)
WIDE_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
_MODE_DEFAULTS = {
    "fp32": dict.fromkeys(SIX, False),
    "fp16": dict.fromkeys(SIX, True),
    "bf16": {**dict.fromkeys(SIX, True), "loss_scaling": False},
    "amp": dict.fromkeys(SIX, False),
}

Scaler = Any  # lowp.CompoundLossScaler | AmpScaler | None

#: Update speed against fp32 on a CPU, as measured with ``python -m pixelsac.bench`` (DrQ update,
#: batch 128, docs/performance.md): native bf16 kernels on AMD Zen 4 (avx512_bf16); the
#: fp32-accumulated emulation of fp16 and of bf16 on the same and on AVX2-only CPUs.
_CPU_SPEED_VS_FP32 = {"native": 1.8, torch.float16: 0.8, torch.bfloat16: 0.75}


def native_half_kernels(dtype: torch.dtype) -> str | None:
    """The instruction set of this CPU's native ``dtype`` convolutions and matmuls, or None.

    Native here means oneDNN kernels that read fp16/bf16 and accumulate in fp32 -- the arithmetic
    of a GPU's tensor cores, which ``lowp.fp32_accumulate`` otherwise emulates -- and that run
    faster than fp32: AMX or AVX512-BF16 for bf16, AMX-FP16 or AVX512-FP16 for fp16. Read from
    oneDNN's own capability check and the CPU's feature flags, not from a list of CPU models.
    Without them torch's half kernels are reference loops, 5-16x slower than fp32.
    """
    cpu = getattr(torch, "cpu", None)
    try:
        if dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            if cpu._is_amx_tile_supported():
                return "amx_bf16"
            if cpu._is_avx512_bf16_supported():
                return "avx512_bf16"
        if dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported():
            return "amx_fp16" if cpu._is_amx_fp16_supported() else "avx512_fp16"
    except (AttributeError, RuntimeError):  # a torch without these probes: assume none
        return None
    return None


def native_half_training(dtype: torch.dtype) -> str | None:
    """The instruction set of this CPU's native ``dtype`` kernels where they also *train* fast, or None.

    Training needs the backward kernels too, and the two half types differ there. bf16 has them
    wherever :func:`native_half_kernels` finds kernels. fp16 does not: torch's CPU fp16
    convolutions run oneDNN forward and input-gradient kernels, but their weight and bias
    gradients fall back to reference loops, hundreds of times slower than fp32's (measured:
    docs/performance.md). So fp16 is emulated (``lowp.fp32_accumulate``) on every CPU unless a
    run forces native kernels.
    """
    if dtype == torch.float16:
        return None
    return native_half_kernels(dtype)


class NumericalFailure(RuntimeError):
    """Training stopped because weights went non-finite or a loss scale collapsed.

    ``weights_finite`` tells whether the current state is still worth saving; the checkpoint
    callback fills in ``env_frames`` and ``checkpoint`` (the last good state on disk).
    """

    def __init__(self, message: str, weights_finite: bool) -> None:
        super().__init__(message)
        self.weights_finite = weights_finite
        self.env_frames: int | None = None
        self.checkpoint: str | None = None

    def __str__(self) -> str:
        where = f" at env frame {self.env_frames}" if self.env_frames is not None else ""
        saved = f"; last good checkpoint: {self.checkpoint}" if self.checkpoint else "; no good checkpoint was written"
        return f"{self.args[0]}{where}{saved}"


class AmpScaler:
    """AMP's loss scaling behind the compound scaler's one step (``lowp.CompoundLossScaler.step``):
    torch's GradScaler unscales the gradients in fp32 and skips the step on inf.

    Fused Adam (``perf.sync_free``) is handed GradScaler's inf flag and skips on the device;
    otherwise ``GradScaler.step`` reads it on the host.
    """

    def __init__(self, device_type: str) -> None:
        self.grad_scaler = torch.amp.GradScaler(device_type)

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        loss: torch.Tensor,
        backward: Callable[..., Any] | None = None,
        reduce_found_inf: Callable[[torch.Tensor], Any] | None = None,
    ) -> torch.Tensor:
        """Backward ``loss·S`` into the optimizer's parameters (through ``backward(tensor,
        inputs=...)``), unscale, step unless a gradient is not finite, update ``S``. Returns the
        0-dim bool "the step was taken" (GradScaler's per-device flags, summed on the device).
        ``reduce_found_inf`` is not used: GradScaler keeps its flags to itself."""
        scaler = self.grad_scaler
        optimizer.zero_grad(set_to_none=True)
        inputs = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        (backward or torch.Tensor.backward)(scaler.scale(loss), inputs=inputs)
        raw = getattr(optimizer, "optimizer", optimizer)  # Lightning wraps the torch optimizer
        if getattr(raw, "_step_supports_amp_scaling", False):
            # Fused Adam skips on the device when handed the flag. Set on the torch optimizer
            # itself (GradScaler would set it on Lightning's wrapper, where Adam never looks) and
            # stepped through the wrapper, so Lightning still counts the step.
            scaler.unscale_(optimizer)
            raw.found_inf = sum(scaler._found_inf_per_device(optimizer).values())
            try:
                optimizer.step()
            finally:
                del raw.found_inf
        else:
            scaler.step(optimizer)
        found_inf = sum(scaler._found_inf_per_device(optimizer).values())
        scaler.update()
        return found_inf == 0

    def get_scale(self) -> float:
        return self.grad_scaler.get_scale()

    def state_dict(self) -> dict[str, Any]:
        return self.grad_scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.grad_scaler.load_state_dict(state_dict)


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """Dtypes and numerical switches of one run; builds optimizers, scalers, targets, policies."""

    mode: str = "fp32"
    device_type: str = "cpu"
    hadam: bool = False
    loss_scaling: bool = False
    kahan_gradients: bool = False
    kahan_momentum: bool = False
    softplus_fix: bool = False
    normal_fix: bool = False
    fp32_accumulate: bool = False
    init_scale: float = 1e4
    growth_interval: int = 10_000
    headroom_growth: bool = False
    adam_eps: float = 1e-8
    target_scale: float = 1e4
    sync_free: bool = False
    unbiased_moments: bool = False
    stochastic_weights: bool = False
    stochastic_first_moment: bool = False
    derived_target: bool = False
    adaptive_target_scale: bool = False
    fp32_q_output: bool = False
    fp32_actor_loss: bool = False
    fp32_actor_features: bool = False
    channels_last: bool = False
    tf32: bool = False  # fp32 matmuls and convolutions on TF32 tensor cores (CUDA; perf.tf32)
    emulate_batch_chunk: int | None = None  # fp32_accumulate's samples per fp32 call (lowp.emulate_batch_chunk)
    split_k_chunk: int | None = None  # fp16/bf16 long-K linears: split-K chunk length (perf.split_k; None: off)
    compiled_optimizer: bool = False  # hAdam's unbiased step compiled (perf.compile_optimizer; lowp/fused.py)

    @classmethod
    def from_config(cls, cfg: Any, device_type: str) -> PrecisionPolicy:
        """Resolve ``cfg.precision`` and ``cfg.lowp`` for a device type ("cpu", "cuda", ...)."""
        mode = cfg.precision
        switches = dict(_MODE_DEFAULTS[mode])
        if cfg.lowp.get("all") is not None:
            switches = dict.fromkeys(SIX, bool(cfg.lowp.all))
        for name in SIX:
            if cfg.lowp[name] is not None:
                switches[name] = bool(cfg.lowp[name])
        low = mode in ("fp16", "bf16")
        fp32_accumulate = cfg.lowp.fp32_accumulate
        if fp32_accumulate is None:  # auto: emulate where the CPU has no native kernels for the dtype
            fp32_accumulate = low and device_type == "cpu" and native_half_training(_PARAM_DTYPE[mode]) is None
        unbiased_moments = cfg.lowp.get("unbiased_moments")
        if unbiased_moments is None:
            unbiased_moments = low
        unbiased_moments = bool(unbiased_moments) and low
        stochastic_weights = cfg.lowp.get("stochastic_weights")
        if stochastic_weights is None:  # bf16's 8 bits: SR spreads 3x wider than Kahan there (measured)
            stochastic_weights = mode == "fp16"
        stochastic_first_moment = cfg.lowp.get("stochastic_first_moment")
        if stochastic_first_moment is None:  # fp16's m of a few subnormal steps cannot decay rounded to nearest
            stochastic_first_moment = mode == "fp16"
        derived_target = cfg.lowp.get("derived_target")
        if derived_target is None:
            derived_target = low
        headroom_growth = cfg.lowp.get("headroom_growth")
        if headroom_growth is None:  # the paper's 10,000-step doubling left the full-size critic at S = 4.88
            headroom_growth = mode == "fp16"
        growth_interval = cfg.lowp.get("growth_interval")
        if growth_interval is None:
            growth_interval = 1000 if headroom_growth else 10_000
        adaptive_target_scale = cfg.lowp.get("adaptive_target_scale")
        if adaptive_target_scale is None:  # a fixed K stopped the full-size fp16 critic at |θ| > 6.55
            adaptive_target_scale = low
        fp32_q_output = cfg.lowp.get("fp32_q_output")
        if fp32_q_output is None:
            # bf16 rounds Q ~ 30 to 0.125: a quarter of the TD signal (tools/fidelity.py grad); fp16's S·loss
            # and squared TD errors overflow once returns reach the hundreds (the full-size critic's loss scale)
            fp32_q_output = mode == "bf16" or (mode == "fp16" and switches["loss_scaling"])
        fp32_actor_loss = cfg.lowp.get("fp32_actor_loss")
        if fp32_actor_loss is None:  # bf16 left 10-20% of the actor's gradient wrong (tools/fidelity.py grad)
            fp32_actor_loss = mode == "bf16"
        fp32_actor_features = cfg.lowp.get("fp32_actor_features")
        if fp32_actor_features is None:  # bf16's trunk left 4-10% of the actor's gradient wrong (grad_fidelity)
            fp32_actor_features = mode == "bf16"
        sync_free = cfg.perf.get("sync_free")
        if sync_free is None:
            sync_free = device_type == "cuda"
        channels_last = cfg.perf.get("channels_last")
        if channels_last is None:
            # oneDNN runs the DrQ trunk 1.4-2x faster in NHWC (forward and backward, fp32 and the
            # fp32-accumulated emulation); cuDNN's tensor-core kernels want NHWC for fp16/bf16
            channels_last = device_type == "cpu" or (device_type == "cuda" and mode != "fp32")
        split_k = cfg.perf.get("split_k")
        if split_k is None:  # the projection's K = 39,200 GEMM ran without split-K on an H200: 814 us a call
            split_k = 2048 if (low and device_type == "cuda") else 0
        return cls(
            mode=mode,
            device_type=device_type,
            fp32_accumulate=bool(fp32_accumulate) and low,
            init_scale=cfg.lowp.init_scale,
            growth_interval=int(growth_interval),
            headroom_growth=bool(headroom_growth) and switches["loss_scaling"],
            adam_eps=cfg.lowp.adam_eps_scaled if switches["loss_scaling"] else cfg.agent.adam_eps,
            target_scale=cfg.lowp.target_scale,
            sync_free=bool(sync_free),
            unbiased_moments=unbiased_moments,
            # stochastic rounding replaces a Kahan buffer only where the unbiased hAdam step writes
            stochastic_weights=bool(stochastic_weights) and unbiased_moments and switches["hadam"],
            stochastic_first_moment=bool(stochastic_first_moment) and unbiased_moments and switches["hadam"],
            derived_target=bool(derived_target) and switches["kahan_momentum"],
            adaptive_target_scale=bool(adaptive_target_scale) and switches["kahan_momentum"],
            fp32_q_output=bool(fp32_q_output) and low,
            fp32_actor_loss=bool(fp32_actor_loss) and low,
            fp32_actor_features=bool(fp32_actor_features) and low,
            channels_last=bool(channels_last),
            tf32=bool(cfg.perf.get("tf32")) and device_type == "cuda",
            emulate_batch_chunk=cfg.lowp.get("emulate_batch_chunk"),
            split_k_chunk=int(split_k) if split_k and low else None,
            compiled_optimizer=bool(cfg.perf.get("compile_optimizer")) and unbiased_moments and switches["hadam"],
            **switches,
        )

    # --- dtypes -------------------------------------------------------------------------------
    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype of every parameter, target copy and optimizer state tensor."""
        return _PARAM_DTYPE[self.mode] if self.mode in _PARAM_DTYPE else WIDE_DTYPES[self.mode]

    def widened(self, mode: str) -> PrecisionPolicy:
        """This policy computing in a wide dtype (``"fp32"`` or ``"fp64"``, :data:`WIDE_DTYPES`)
        with every switch kept: the arithmetic of a float64 judge, or of an agent trained in 16
        bits whose weights are widened exactly to act (``pixelsac-evaluate arithmetic=...``).
        Nothing is emulated or split: ``fp32_accumulate`` and split-K apply to 16-bit storage."""
        if mode not in WIDE_DTYPES:
            raise ValueError(f"widened() takes {' or '.join(WIDE_DTYPES)}, not {mode!r}")
        return dataclasses.replace(self, mode=mode, fp32_accumulate=False, split_k_chunk=None)

    @property
    def is_pure_low(self) -> bool:
        return self.mode in ("fp16", "bf16")

    def cpu_kernels(self) -> str | None:
        """How this run's fp16/bf16 convolutions and matmuls execute on a CPU, with the speed to
        expect against fp32 (None for fp32/AMP and off the CPU), e.g. ``bf16: native kernels
        (avx512_bf16), expect ~1.8x fp32's updates/s``."""
        if not self.is_pure_low or self.device_type != "cpu":
            return None
        isa = native_half_kernels(self.param_dtype)
        trains = native_half_training(self.param_dtype)
        if self.fp32_accumulate:
            if isa is None:
                why = "no native kernels on this CPU"
            elif trains is None:
                why = f"the native {isa} kernels compute convolution weight gradients in reference loops"
            else:
                why = f"chosen over the native {isa} kernels"
            speed = _CPU_SPEED_VS_FP32[self.param_dtype]
            return f"{self.mode}: emulated (fp32-accumulated conv/matmul; {why}), expect ~{speed:g}x fp32's updates/s"
        if isa is None:
            return (
                f"{self.mode}: native kernels requested (lowp.fp32_accumulate=false) but this CPU has none: "
                "expect 5-16x slower than fp32"
            )
        if trains is None:
            return (
                f"{self.mode}: native kernels ({isa}) requested (lowp.fp32_accumulate=false); their convolution "
                "weight gradients run reference loops: expect ~80x slower than fp32 in training"
            )
        return f"{self.mode}: native kernels ({isa}), expect ~{_CPU_SPEED_VS_FP32['native']:g}x fp32's updates/s"

    def configure_split_k(self, module: nn.Module) -> None:
        """Set every :class:`pixelsac.lowp.SplitKLinear` in ``module`` to this run's split-K
        chunk length (``perf.split_k``; None turns it off)."""
        for layer in module.modules():
            if isinstance(layer, lowp.SplitKLinear):
                layer.split_chunk = self.split_k_chunk

    def cast_module(self, module: nn.Module) -> nn.Module:
        return module.to(self.param_dtype)

    def cast_input(self, tensor: torch.Tensor) -> torch.Tensor:
        """Batch floats (actions, rewards, state observations) enter the model dtype once."""
        return tensor.to(self.param_dtype)

    def cast_observation(self, obs: torch.Tensor) -> torch.Tensor:
        """Observations as the networks read them, in the model dtype.

        uint8 pixels become ``float(obs) / 255`` -- DrQ's encoder's first op, bit for bit: the
        frame enters the model dtype exactly (0..255 are exact in fp16 and bf16) and the division
        is the same op in place -- once per batch instead of once per network that reads it (the
        critic, its target and the actor read the same copies), and in the convolutions' layout
        (channels-last where the policy lays them out so), so that no network makes its own copy.
        Anything else (state vectors) is cast like :meth:`cast_input`.
        """
        if obs.dtype != torch.uint8:
            return self.cast_input(obs)
        layout = torch.channels_last if self.channels_last and obs.dim() == 4 else torch.contiguous_format
        return obs.to(self.param_dtype, memory_format=layout).div_(255.0)

    def compute_context(self, save_low_precision: bool = True) -> contextlib.AbstractContextManager:
        """Wraps every forward pass: autocast for AMP, tensor-core emulation on a CPU, else nothing.
        ``save_low_precision``: what the emulation keeps for backward (see ``lowp.fp32_accumulate``;
        the benchmark times both forms)."""
        if self.mode == "amp":
            return torch.autocast(self.device_type, dtype=torch.float16)
        if self.fp32_accumulate:
            return lowp.fp32_accumulate(save_low_precision, batch_chunk=self.emulate_batch_chunk)
        return contextlib.nullcontext()

    # --- builders -----------------------------------------------------------------------------
    def make_optimizer(
        self, params: Iterable[nn.Parameter], lr: float, betas: tuple[float, float], kahan: bool, seed: int = 0
    ) -> torch.optim.Optimizer:
        """hAdam or torch Adam; ``kahan`` asks for the compensated update (critic and alpha only,
        as the authors ran it) and takes effect when ``lowp.kahan_gradients`` is on. ``seed``
        picks hAdam's stochastic-rounding stream (``lowp.unbiased_moments``); the same on every
        data-parallel rank, so replicas round alike."""
        use_kahan = kahan and self.kahan_gradients
        if self.hadam and use_kahan and self.stochastic_weights:
            use_kahan = False  # the unbiased step then writes the weight with stochastic rounding
        if self.hadam:
            return lowp.HAdam(
                params,
                lr=lr,
                betas=betas,
                eps=self.adam_eps,
                kahan=use_kahan,
                capturable=self.sync_free,
                unbiased_moments=self.unbiased_moments,
                stochastic_first_moment=self.stochastic_first_moment,
                seed=seed,
                chunk_numel=lowp.HAdam.chunk_for(self.device_type),  # cache-sized on a CPU, whole buckets on a GPU
                compiled=self.compiled_optimizer,
            )
        if use_kahan:
            return lowp.KahanAdam(params, lr=lr, betas=betas, eps=self.adam_eps)
        # torch's capturable Adam (step counts read on the device, graph-safe) exists for CUDA only;
        # on a CPU the host reads of the step count cost nothing
        capturable = self.sync_free and self.device_type == "cuda"
        # fp32 on CUDA: fused with or without perf.sync_free, which then changes only the step
        # count's place (capturable), not the kernels a benchmark of the switch compares
        fused_anyway = self.mode == "fp32" and self.device_type == "cuda"
        if (self.sync_free or fused_anyway) and not self.is_pure_low:
            # fused: step counts on the device, and GradScaler hands it found_inf instead of
            # reading it on the host (fp32 and AMP keep fp32 weights, which fused Adam expects);
            # a CPU has no capturable Adam: there the fused step is what makes fp32/AMP sync-free
            return torch.optim.Adam(params, lr=lr, betas=betas, eps=self.adam_eps, fused=True, capturable=capturable)
        # foreach keeps the elementwise Adam math in the parameter dtype on every device
        return torch.optim.Adam(params, lr=lr, betas=betas, eps=self.adam_eps, foreach=True, capturable=capturable)

    def make_scaler(self) -> Scaler:
        """The loss scaler of one loss, which backs it up, checks, steps and keeps the books
        (``scaler.step(optimizer, loss, backward)``): the compound scaler, AMP's GradScaler, or
        None (no scaling: backward and step)."""
        if self.loss_scaling:
            return lowp.CompoundLossScaler(
                init_scale=self.init_scale,
                growth_interval=self.growth_interval,
                headroom_growth=self.headroom_growth,
                compiled=self.compiled_optimizer and self.sync_free and self.hadam,
            )
        if self.mode == "amp":
            return AmpScaler(self.device_type)
        return None

    def make_target_updater(self, source: nn.Module, target: nn.Module | None) -> lowp.KahanEMA:
        """Soft target update: Kahan-momentum with the xK scaled copy, or the plain EMA; with
        ``derived_target`` the target is computed from the xK copy when used (``target`` None);
        with ``adaptive_target_scale`` each tensor's K is a power of two below ``target_scale``
        chosen on the device to keep the copy in range (``lowp/ema.py``)."""
        return lowp.KahanEMA(
            source,
            target,
            scale=self.target_scale,
            compensated=self.kahan_momentum,
            check_every_update=not self.sync_free,
            derived_target=self.derived_target,
            adaptive_scale=self.adaptive_target_scale,
            chunk_numel=lowp.HAdam.chunk_for(self.device_type),  # cache-sized passes on a CPU, whole on a GPU
            compiled=self.compiled_optimizer,  # the flat update as one compiled op (lowp/fused_target.py)
        )

    def distribution(self, mu: torch.Tensor, log_std: torch.Tensor) -> lowp.SquashedNormal:
        """The tanh-squashed Gaussian policy.

        With normal-fix the log-density of a sampled action is evaluated as
        ``-0.5·ε² - log σ - 0.5·log 2π`` from the cached noise ε and log σ itself: the same value
        and gradients as the divide-before-square form, without its two gradient paths of size
        ``|ε|/σ`` that cancel -- each overflows fp16 under loss scaling once σ is small (DrQ lets
        log σ reach -10). Without it: σ = exp(log σ) and torch's ``-(x-μ)²/(2σ²)`` form.
        """
        if self.normal_fix:
            return lowp.SquashedNormal(
                mu, log_scale=log_std, softplus_fix=self.softplus_fix, normal_fix=True, noise_form=True
            )
        return lowp.SquashedNormal(mu, log_std.exp(), softplus_fix=self.softplus_fix, normal_fix=False)

    def apply_global_numerics(self) -> None:
        """Set torch's process-wide fp32 matmul and convolution precision to this policy's: IEEE
        fp32 unless ``tf32`` (torch's CUDA convolutions would take TF32 by default otherwise).

        The legacy switches, on purpose: Lightning reads ``torch.get_float32_matmul_precision()``,
        which raises once the new ``fp32_precision`` API and the legacy one have both been used.

        fp16 and bf16 matmuls (pure or autocast) accumulate in fp32 on cuBLAS: its reduced-precision
        split-K reductions, on by default, are turned off, since the numerics were validated with
        fp32 accumulation (the CPU emulation's ``lowp.fp32_accumulate``).
        """
        torch.set_float32_matmul_precision("high" if self.tf32 else "highest")
        torch.backends.cuda.matmul.allow_tf32 = self.tf32
        torch.backends.cudnn.allow_tf32 = self.tf32
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False

    def describe(self) -> str:
        on = [name for name in SIX if getattr(self, name)]
        if self.unbiased_moments and self.hadam:
            on.append("unbiased_moments")
        if self.stochastic_first_moment:
            on.append("stochastic_first_moment")
        if self.stochastic_weights and self.kahan_gradients:
            on[on.index("kahan_gradients")] = "kahan_gradients (as stochastic rounding)"
        if self.derived_target:
            on.append("derived_target")
        if self.adaptive_target_scale:
            on.append("adaptive_target_scale")
        if self.headroom_growth:
            on.append("headroom_growth")
        if self.fp32_q_output:
            on.append("fp32_q_output")
        if self.fp32_actor_loss:
            on.append("fp32_actor_loss")
        if self.fp32_actor_features:
            on.append("fp32_actor_features")
        if self.compiled_optimizer:
            on.append(
                "compiled hAdam step"
                + (" and loss-scaler bookkeeping" if self.loss_scaling and self.sync_free else "")
                + (" and target update" if self.kahan_momentum else "")
                + (" (on a CPU ~2x slower than eager; meant for a GPU)" if self.device_type == "cpu" else "")
            )
        extra = " (fp32-accumulated conv/matmul on CPU)" if self.fp32_accumulate else ""
        if self.is_pure_low and self.device_type == "cpu" and not self.fp32_accumulate:
            extra = f" (native {native_half_kernels(self.param_dtype) or 'reference'} conv/matmul on CPU)"
        if self.device_type == "cuda" and self.mode in ("fp32", "amp"):
            extra += "; fp32 matmuls/convolutions on TF32 tensor cores" if self.tf32 else "; TF32 off (IEEE fp32)"
        mods = (
            f"; modifications: {', '.join(on) if on else 'none'}"
            if self.mode != "amp"
            else "; torch autocast + GradScaler"
        )
        return f"precision {self.mode}: parameters {str(self.param_dtype).removeprefix('torch.')}{mods}{extra}"


def nonfinite_names(groups: Mapping[str, torch.Tensor | Iterable[torch.Tensor]]) -> list[str]:
    """Names of the groups (one tensor or several each) that hold a NaN or an infinity, read with
    one host synchronisation for all; tensors that are not floating point are passed over."""
    names, flags = [], []
    for name, tensors in groups.items():
        floating = [
            t
            for t in ([tensors] if torch.is_tensor(tensors) else tensors)
            if torch.is_tensor(t) and t.is_floating_point()
        ]
        if floating:
            names.append(name)
            flags.append(torch.stack([lowp.all_finite(t) for t in floating]).all())
    if not flags:
        return []
    return [name for name, ok in zip(names, torch.stack(flags).tolist()) if not ok]


def tensors_not_in(dtype: torch.dtype, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> list[str]:
    """Names of floating parameters, buffers and optimizer-state tensors whose dtype is not ``dtype``
    (empty in a truly pure run: no fp32 master copies anywhere)."""
    wrong = [
        f"{name} ({t.dtype})"
        for name, t in [*module.named_parameters(), *module.named_buffers()]
        if t.is_floating_point() and t.dtype != dtype
    ]
    for i, opt in enumerate(optimizers):
        for state in opt.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.is_floating_point() and value.dim() > 0 and value.dtype != dtype:
                    wrong.append(f"optimizer {i} {key} ({value.dtype})")
    return wrong


def state_bytes(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, int]:
    """Bytes held by the learner's persistent state, by kind.

    ``parameters``: learnable tensors (actor, critic, log_alpha); ``optimizer``: every tensor in
    the optimizers' state (moments, root moments, Kahan buffers); ``target``: the target
    critic plus the Kahan-momentum scaled copy and its compensation buffer (any buffer of the
    module). Replay memory is reported separately: fp16 does not shrink uint8 frames.
    """

    def nbytes(tensors: Iterable[torch.Tensor]) -> int:
        seen, total = set(), 0
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    params = [p for p in module.parameters() if p.requires_grad]
    frozen = [p for p in module.parameters() if not p.requires_grad]
    buffers = [b for b in module.buffers() if b.is_floating_point()]
    opt_state = [
        v for opt in optimizers for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0
    ]
    sizes = {"parameters": nbytes(params), "optimizer": nbytes(opt_state), "target": nbytes(frozen + buffers)}
    sizes["total"] = sum(sizes.values())
    return sizes


def materialize_optimizer_state(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Allocate optimizers' lazily created state by one step on zero gradients (the update is
    zero, so parameters do not move); for measuring memory before training."""
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)


#: Param-group keys that say how torch's optimizers run, not what they compute. A checkpoint
#: written under other perf.*/trainer settings (another device, perf.sync_free, AMP) holds its own;
#: loaded as they are, fused AMP would meet a non-fused GradScaler path, or fp32 graphs capture a
#: step that reads its count on the host.
EXECUTION_FLAGS = ("foreach", "fused", "capturable", "differentiable")


def keep_execution_flags(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``optimizer.load_state_dict`` keep the :data:`EXECUTION_FLAGS` this optimizer was
    built with: the run's settings win over the checkpoint's ``param_groups``. A pre-hook, so
    that torch places each ``step`` count where these flags want it (on the parameter's device
    when fused or capturable, else where it was saved). A group key the checkpoint does not hold
    (a switch added since it was written, e.g. hAdam's ``stochastic_first_moment``) keeps the
    value the run built, as the run's config takes that key's default: torch would drop it.
    Returns ``optimizer``."""
    built_keys = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    built = [{key: keys[key] for key in EXECUTION_FLAGS if key in keys} for keys in built_keys]

    def run_flags_win(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any] | None:
        saved = state_dict.get("param_groups")
        if not isinstance(saved, list) or len(saved) != len(built):
            return None  # torch refuses a group mismatch itself
        groups = [{**keys, **group, **flags} for group, keys, flags in zip(saved, built_keys, built)]
        return {**state_dict, "param_groups": groups}

    optimizer.register_load_state_dict_pre_hook(run_flags_win)
    return optimizer
