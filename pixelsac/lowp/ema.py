"""Kahan-momentum: a compensated soft (EMA) update of a target network.

The target update ``θ̄ <- θ̄ + τ(θ - θ̄)`` loses the whole increment in fp16 when ``τ(θ - θ̄)``
is below half an ulp of ``θ̄`` (θ≈0.03, θ-θ̄≈1e-5, τ=0.005: the increment is 5e-8, the ulp
1.5e-5), and θ̄ stops moving. Kahan-momentum keeps a scaled copy ``θ̄_S = K·θ̄`` (K = 1e4)
plus a Kahan buffer ``c``, all in the parameter dtype::

    u   = τ * (K*θ - θ̄_S)
    y   = u - c
    t   = θ̄_S + y
    c   = (t - θ̄_S) - y
    θ̄_S = t
    θ̄   = θ̄_S / K              # the copy used in forward passes

Scaling by K moves the increments out of the subnormal range; the Kahan buffer keeps what
still falls below an ulp of ``θ̄_S``. As published, K is one constant, so every parameter is
held to ``|K·θ| < 65504`` in fp16, i.e. ``|θ| < 6.55``: a ceiling that training reaches (a
full-size DrQ critic crossed it after ~4,850 updates at lr 1e-3, and the run had to stop).

Adaptive scale (``adaptive_scale=True``; beyond the paper). Each parameter tensor ``i`` gets its
own scale ``K_i = K·2^{k_i}`` with an integer shift ``k_i <= 0``, chosen before every update from
the tensor's own peak ``P_i = max(max|θ_i|, max|θ̄_i|)``::

    k_i <- clamp(floor(log2(H / (K·P_i))), k_min, 0)        H = headroom · (dtype's largest value)
    θ̄_S,i <- θ̄_S,i · 2^{k_i' - k_i}     c_i <- c_i · 2^{k_i' - k_i}     (exact: powers of two)

then the update above with ``K_i`` in place of K. With ``headroom = 1/4`` every ``|K_i·θ_i|`` and
``|θ̄_S,i|`` stays below 16,376 in fp16, and ``u``, ``y`` and ``t`` (at most ``(1 + 2τ)`` times
that) below 65,504: there is no ceiling on the weights, only the dtype's own range. Multiplying
by a power of two only moves the exponent, so the rescale loses nothing unless an element falls
into the subnormal range (below 6.1e-5 in fp16; in ``θ̄_S`` that needs ``|θ̄| < 6.1e-5 / K_i``).
``K_i`` stays at K (``k_i = 0``) while ``K·P_i <= H``, which is every tensor of a freshly
initialised network: until a parameter grows past ``H/K`` (1.64 for K = 1e4) the update is the
published one, bit for bit. The decision is made on the device from the tensors themselves (no
host read, graph-safe), so every data-parallel rank, holding the same weights, takes the same one.
The shifts are a buffer (``scale_shifts``) and travel with checkpoints; a checkpoint written
before they existed loads with every shift 0 (its scaled copy is ``K·θ̄``).

Detection (compensated forms): after every update the module records on the device the
number of the first target update after which ``θ̄_S`` held a NaN or inf (``first_nonfinite``,
-1 while none has). Reading it (:meth:`first_nonfinite_update`, :meth:`check_finite`) is a host
synchronisation: do it where the host waits anyway, and the failure is still pinned to the
update where it happened.

One buffer per kind (beyond the paper). The per-parameter scales ``K_i`` multiply
each tensor by its own 0-dim device value, and CUDA runs a foreach op over such a list tensor by
tensor (its multi-tensor kernel needs the operands of one shape): ~4 kernels per parameter per
update. So where the parameters share a dtype and a device, ``θ̄_S`` and ``c``
are views into one flat buffer each, in the parameters' memory order (the ``state_dict`` keys
and values are unchanged); the source is joined once, or read in place when it already lies in
one buffer in this order (hAdam's compiled step keeps it so); and an update is a handful of
whole-buffer ops with the scales spread over the elements (``repeat_interleave``: a float32 value
per element while a pass runs, so a CPU takes the buffers in cache-sized passes, ``chunk_numel``,
and a GPU whole): the same products, each rounded once, as CUDA's per-tensor
form rounds them, τ in float32 on every device (torch's in-place foreach on a CPU would round a
Python scalar to the tensors' dtype, 0.005 to 0.0050011).

Compiled (``compiled=True``, the policy's ``perf.compile_optimizer``): the flat update runs as
one op whose kernels ``torch.compile`` generates (``fused_target.py``), after one foreach norm of
the peaks: the same bits as the flat form, a few kernels instead of ~40 on a GPU; a derived
target's division likewise (one op instead of 6 kernels).

Derived target (``derived_target=True``; a memory saving beyond the paper): ``θ̄ = θ̄_S / K`` is
a function of state already kept, so it need not be stored. The target network is then evaluated
by running the *source* network with the parameters ``θ̄_S / K`` substituted
(``torch.func.functional_call``), computed when the target is used -- the same division, so the
same bits as the stored copy -- and freed after the forward pass. This saves one parameter-sized
tensor (for DrQ's critic, 8 MiB of fp16) at the cost of one elementwise division per use. Until
the first :meth:`update_` the target is ``θ`` itself (as the stored copy is at init): exact when,
as in SAC, the first target update follows the first source step before the target is used
again (a caller that steps the source several times first should call ``update_`` or keep the
stored copy).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from .finite import all_finite
from .kahan import kahan_add_
from .layout import flat_view, segment_views

__all__ = ["KahanEMA"]

#: The smallest shift: ``K·2^-100`` is still a normal float32 for any sensible K, and no parameter
#: of a finite fp16 or bf16 network needs less (fp16's largest value needs k >= -16 at K = 1e4).
MIN_SHIFT = -100


def _after_load(module: nn.Module, incompatible_keys: Any) -> None:
    """A loaded state says whether θ̄ is still θ (one host read, at load time only)."""
    if module.derived_target:
        module._fresh = int(module.updates_applied) == 0


def _fill_missing_buffers(
    module: KahanEMA, state_dict: dict[str, Any], prefix: str, local_metadata: Any, *args: Any
) -> None:
    """A state written before the adaptive scale and the failure record existed holds ``K·θ̄``
    with one K: every shift is 0, and no target update is known to have failed."""
    if not module.compensated:
        return
    defaults = {
        "scale_shifts": torch.zeros_like(module.scale_shifts),
        "first_nonfinite": torch.full_like(module.first_nonfinite, -1),
        "target_updates": torch.zeros_like(module.target_updates),
    }
    for name, value in defaults.items():
        state_dict.setdefault(prefix + name, value)


def _peaks(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``max|t|`` of each tensor as a float32 vector (exact: a 16-bit value widens exactly)."""
    return torch.stack(torch._foreach_norm(tensors, float("inf"))).float()


class _BufferBag(nn.Module):
    """Holds one buffer per target parameter, named after it (dots become ``__``)."""


def _buffer_name(param_name: str) -> str:
    return param_name.replace(".", "__")


class KahanEMA(nn.Module):
    """Keeps ``target`` an exponential moving average of ``source``, compensated in low precision.

    Args:
        source: the online network θ (e.g. the critic).
        target: the network θ̄ used in forward passes (e.g. the target critic); its parameters
            are overwritten in place, at init with θ and on every :meth:`update_`.
        scale: ``K``, the factor of the scaled copy ``θ̄_S = K·θ̄`` (with ``adaptive_scale``, the
            largest per-tensor factor).
        compensated: False gives the naive in-dtype EMA ``θ̄ += τ(θ - θ̄)`` with no extra
            buffers (the baseline).
        check_every_update: check ``K·θ`` after every :meth:`update_` (a host synchronisation
            each time). False leaves it to the caller's :meth:`check_finite` at a moment when the
            host waits anyway (e.g. logging): the update where it first failed is recorded on the
            device, so a later check still names it.
        derived_target: do not keep ``θ̄``; compute it from ``θ̄_S`` whenever the target runs
            (module docstring). Needs ``compensated=True``; ``target`` may then be None. Adds the
            buffer ``updates_applied`` (0 until the first update, then 1).
        adaptive_scale: a power-of-two scale per tensor, ``K_i = K·2^{k_i} <= K``, chosen from
            the tensor's peak before each update so that ``K_i·θ`` keeps ``headroom`` of the
            dtype's range (module docstring). False is the published single K.
        headroom: the fraction of the dtype's largest value that ``|K_i·θ|`` may reach.
        chunk_numel: elements per pass of the flat update (module docstring), which bounds its
            float32 temporaries to ``4·chunk_numel`` bytes each; None: the whole buffer at once
            (a GPU, where every pass is a launch). The result does not depend on it, bit for bit.
        compiled: run the flat update as one op whose kernels ``torch.compile`` generates
            (``fused_target.py``: the same bits, ~40 fewer kernels an update on a GPU); where the
            buffers are not flat (mixed dtypes or devices) the per-tensor form runs as before.

    With ``compensated=True`` the buffers ``scaled_params.<name>`` (θ̄_S) and
    ``kahan_comp.<name>`` (c) are registered on this module, in the parameters' dtype, so they
    appear in a parent module's ``state_dict`` and follow its ``.to()``; beside them the integer
    buffers ``scale_shifts`` (k_i, one per parameter), ``target_updates`` (updates applied) and
    ``first_nonfinite`` (the first update after which θ̄_S was not finite, -1 for none). ``source``
    and ``target`` are referenced, not registered: their parameters stay owned by whoever owns
    the networks.

    Raises:
        FloatingPointError: when ``K·θ`` is not finite at init, after an update (with
            ``check_every_update``) or in :meth:`check_finite`.
        ValueError: when source and target parameters do not match by name and shape.
    """

    def __init__(
        self,
        source: nn.Module,
        target: nn.Module | None,
        scale: float = 1e4,
        compensated: bool = True,
        check_every_update: bool = True,
        derived_target: bool = False,
        adaptive_scale: bool = False,
        headroom: float = 0.25,
        chunk_numel: int | None = None,
        compiled: bool = False,
    ) -> None:
        super().__init__()
        if not scale > 0:
            raise ValueError(f"KahanEMA: scale K must be positive, got {scale}")
        if not 0.0 < headroom <= 0.25:
            # u, y and t reach (1 + 2τ)·headroom of the range: 1/4 leaves room for any τ <= 1
            raise ValueError(f"KahanEMA: headroom must lie in (0, 0.25], got {headroom}")
        if derived_target and not compensated:
            raise ValueError("KahanEMA: derived_target needs compensated=True (θ̄ is derived from the scaled copy)")
        if adaptive_scale and not compensated:
            raise ValueError("KahanEMA: adaptive_scale needs compensated=True (it scales the scaled copy)")
        self.derived_target = bool(derived_target)
        if target is None:
            if not self.derived_target:
                raise ValueError("KahanEMA: a target network is needed unless derived_target=True")
            target = source  # only its structure is used: parameters are names and shapes here
        # A tuple keeps nn.Module from registering them as submodules (no duplicate params).
        self._networks = (source, target)
        self.scale = float(scale)
        self.compensated = bool(compensated)
        self.check_every_update = bool(check_every_update)
        self.adaptive_scale = bool(adaptive_scale)
        self.headroom = float(headroom)
        self._flat: dict[str, Any] | None = None  # see _flat_buffers
        self.chunk_numel = None if chunk_numel is None else int(chunk_numel)
        self.compiled = bool(compiled)

        source_named = list(source.named_parameters())
        target_named = list(target.named_parameters())
        source_names = [name for name, _ in source_named]
        target_names = [name for name, _ in target_named]
        if source_names != target_names:
            raise ValueError(
                "KahanEMA: source and target parameters differ: "
                f"only in source {sorted(set(source_names) - set(target_names))}, "
                f"only in target {sorted(set(target_names) - set(source_names))}"
                + ("" if set(source_names) != set(target_names) else " (order differs)")
            )
        for (name, src), (_, tgt) in zip(source_named, target_named):
            if src.shape != tgt.shape:
                raise ValueError(
                    f"KahanEMA: shape mismatch for {name!r}: source {tuple(src.shape)}, target {tuple(tgt.shape)}"
                )
        self.param_names = source_names

        if not self.derived_target:
            with torch.no_grad():
                for (_, src), (_, tgt) in zip(source_named, target_named):
                    tgt.copy_(src)

        if self.compensated:
            self.scaled_params = _BufferBag()
            self.kahan_comp = _BufferBag()
            buffer_names = [_buffer_name(name) for name in source_names]
            if len(set(buffer_names)) != len(buffer_names):
                raise ValueError(f"KahanEMA: parameter names collide as buffer names: {buffer_names}")
            device = source_named[0][1].device if source_named else None
            shifts = torch.zeros(len(source_named), dtype=torch.int32, device=device)
            if self.adaptive_scale and source_named:
                with torch.no_grad():
                    peaks = torch.stack([p.detach().abs().amax().float() for _, p in source_named])
                    shifts = self._shifts_for(peaks, source_named[0][1].dtype)
            self.register_buffer("scale_shifts", shifts)
            self.register_buffer("target_updates", torch.zeros((), dtype=torch.int64, device=device))
            self.register_buffer("first_nonfinite", torch.full((), -1, dtype=torch.int64, device=device))
            with torch.no_grad():
                factors = self.tensor_scales().tolist()  # at construction only: a host read is fine
                for buffer_name, (_, src), factor in zip(buffer_names, source_named, factors):
                    # K_i·θ in fp32 (exact enough), rounded once into the parameter dtype.
                    scaled = (src.detach().float() * factor).to(src.dtype)
                    self.scaled_params.register_buffer(buffer_name, scaled)
                    self.kahan_comp.register_buffer(buffer_name, torch.zeros_like(src))
            self._register_load_state_dict_pre_hook(_fill_missing_buffers, with_module=True)
            self._flat_buffers()
            self.check_finite()
        if self.derived_target:
            # 0 until the first update_ (the target is θ itself then), 1 after; a buffer so that a
            # checkpoint remembers it, mirrored on the host so that forward never reads the device
            self.register_buffer("updates_applied", torch.zeros((), dtype=torch.int64))
            self._fresh = True
        self.register_load_state_dict_post_hook(_after_load)

    @torch.no_grad()
    def start_from_(self, average: list[torch.Tensor], target_updates: int) -> None:
        """Continue from an average ``θ̄`` held in a wider dtype (one tensor per name of
        :attr:`param_names`, e.g. an fp32 run's target critic), ``target_updates`` updates into it.

        Exactly as at construction, but from ``θ̄`` instead of ``θ``: each shift from the tensor's
        peak (adaptive scale), ``θ̄_S = K_i·θ̄`` in float32 and rounded once into the dtype, ``c = 0``;
        the target counts as updated. The stored target (without ``derived_target``) is ``θ̄``
        rounded once.
        """
        if len(average) != len(self.param_names):
            raise ValueError(f"KahanEMA: {len(average)} tensors for {len(self.param_names)} parameters")
        if self.compensated:
            scaled, comps = self._buffers_in_order()
            if self.adaptive_scale:
                peaks = torch.stack([value.detach().abs().amax().float() for value in average])
                self.scale_shifts.copy_(self._shifts_for(peaks.to(self.scale_shifts.device), scaled[0].dtype))
            for buffer, comp, value, factor in zip(scaled, comps, average, self.tensor_scales().tolist()):
                buffer.copy_((value.detach().float() * factor).to(buffer.dtype))
                comp.zero_()
            self.target_updates.fill_(int(target_updates))
            self.first_nonfinite.fill_(-1)
            self.check_finite()
        if self.derived_target:
            self.updates_applied.fill_(1)
            self._fresh = False
        else:
            for (_, target), value in zip(self._networks[1].named_parameters(), average):
                target.copy_(value)

    @property
    def source(self) -> nn.Module:
        return self._networks[0]

    @property
    def target(self) -> nn.Module | None:
        """The averaged network θ̄; its parameter objects are the ones updated in place (None
        with ``derived_target``: nothing holds θ̄ between uses)."""
        return None if self.derived_target else self._networks[1]

    # --- scales -----------------------------------------------------------------------------
    def tensor_scales(self) -> torch.Tensor:
        """``K_i = K·2^{k_i}`` per parameter, a float32 vector on the buffers' device (exact: a
        power of two times K). Without compensation: K for every parameter."""
        if not self.compensated:
            return torch.full((len(self.param_names),), self.scale, dtype=torch.float32)
        return torch.exp2(self.scale_shifts.float()).mul_(self.scale)

    def _shifts_for(self, peaks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The shifts ``k_i = clamp(floor(log2(H / (K·P_i))), MIN_SHIFT, 0)`` for the float32
        peaks ``P_i``; a peak of 0 keeps K, a non-finite one is left to the finiteness check
        (its shift comes out as MIN_SHIFT for inf and 0 for NaN: the run stops either way)."""
        limit = self.headroom * torch.finfo(dtype).max
        wanted = torch.log2(peaks.reciprocal().mul_(limit / self.scale)).floor_()
        wanted = torch.nan_to_num(wanted, nan=0.0, posinf=0.0, neginf=float(MIN_SHIFT))
        return wanted.clamp_(MIN_SHIFT, 0).to(torch.int32)

    def peak_fraction(self) -> torch.Tensor:
        """``max_i max|θ̄_S,i| ÷ (dtype's largest value)``, a 0-dim float32 tensor (no host read):
        how close the scaled copy is to overflowing. It approaches 1 before a fixed K fails; the
        adaptive scale holds it at or below ``headroom·(1 + 2τ)``."""
        if not self.compensated or not self.param_names:
            return torch.zeros(())
        scaled, _ = self._buffers_in_order()
        return _peaks(scaled).max() / torch.finfo(scaled[0].dtype).max

    def first_nonfinite_update(self) -> int | None:
        """The number (1-based) of the first :meth:`update_` after which ``θ̄_S`` held a NaN or
        inf, or None. A host read."""
        if not self.compensated:
            return None
        first = int(self.first_nonfinite)
        return first if first >= 0 else None

    # --- the target network -------------------------------------------------------------------
    def _derived(self) -> list[torch.Tensor]:
        """``θ̄_i = θ̄_S,i / K_i``: one rounding of the exact quotient (K_i is a power of two
        times K), the same bits wherever it is computed (views into one buffer where the scaled
        copy is one: :meth:`_flat_buffers`)."""
        flat = self._flat_buffers()
        scaled, _ = self._buffers_in_order()
        if flat is None:
            return list(torch._foreach_div(scaled, list(self.tensor_scales().unbind())))
        if self.compiled:
            from . import fused_target

            ends, hyper = self._compiled_tables(flat)
            return segment_views(fused_target.derive(flat["scaled"], self.scale_shifts, ends, hyper), scaled)
        derived = torch.empty_like(flat["scaled"])
        for scale, scaled_part, derived_part in self._passes(flat, self.tensor_scales(), flat["scaled"], derived):
            torch.div(scaled_part, scale, out=derived_part)  # float32 quotients, each rounded once
        return segment_views(derived, scaled)

    # --- one buffer per kind ------------------------------------------------------------------
    def _flat_buffers(self) -> dict[str, Any] | None:
        """``θ̄_S`` and ``c`` as one 1-D buffer each, every parameter's buffer a view into it in
        the parameter's memory order (module docstring), or None where the buffers differ in
        dtype or device (the per-tensor form then). Made at construction and again when a buffer
        was given other storage since (``.to(...)``, a load that replaced it): the values copied in."""
        if not self.compensated or not self.param_names:
            return None
        scaled, comps = self._buffers_in_order()
        cached = self._flat
        if cached is not None and [t.data_ptr() for t in (*scaled, *comps)] == cached["where"]:
            return cached
        first = scaled[0]
        if any(t.dtype != first.dtype or t.device != first.device for t in (*scaled, *comps)):
            self._flat = None
            return None
        names = [_buffer_name(name) for name in self.param_names]
        total = sum(t.numel() for t in scaled)
        flats = {}
        for kind, bag, tensors in (("scaled", self.scaled_params, scaled), ("comps", self.kahan_comp, comps)):
            flats[kind] = torch.empty(total, dtype=first.dtype, device=first.device)
            for name, view, tensor in zip(names, segment_views(flats[kind], tensors), tensors):
                view.copy_(tensor)
                setattr(bag, name, view)  # the registered buffer, now a view
        scaled, comps = self._buffers_in_order()
        self._flat = {
            **flats,
            "numels": [t.numel() for t in scaled],
            "where": [t.data_ptr() for t in (*scaled, *comps)],
            "source": None,  # see _joined_source
        }
        return self._flat

    def _passes(self, flat: dict[str, Any], values: torch.Tensor, *tensors: torch.Tensor) -> Iterator[tuple]:
        """The flat buffers in passes of at most ``chunk_numel`` elements: for each pass, the
        per-parameter ``values`` spread over its elements (float32, ``repeat_interleave``) and
        the pass's part of each of ``tensors`` (the tensors themselves in a single pass)."""
        plans = flat.setdefault("plans", {})
        if self.chunk_numel not in plans:
            plans[self.chunk_numel] = self._plan(flat["numels"], self.chunk_numel, flat["scaled"].device)
        plan = plans[self.chunk_numel]
        if len(plan) == 1:
            yield (torch.repeat_interleave(values, plan[0][4], output_size=plan[0][1]), *tensors)
            return
        for start, end, first, last, counts in plan:
            spread = torch.repeat_interleave(values[first:last], counts, output_size=end - start)
            yield (spread, *(tensor[start:end] for tensor in tensors))

    @staticmethod
    def _plan(numels: list[int], chunk: int | None, device: torch.device) -> list[tuple]:
        """``(start, end, first parameter, last parameter + 1, elements of each in the pass)``
        per pass; the counts a device tensor, made once."""
        bounds = [0, *itertools.accumulate(numels)]
        total = bounds[-1]
        chunk = total if chunk is None else max(1, chunk)
        passes = []
        for start in range(0, total, chunk):
            end = min(start + chunk, total)
            first = next(i for i in range(len(numels)) if bounds[i + 1] > start)
            last = next(i for i in range(first, len(numels)) if bounds[i + 1] >= end) + 1
            counts = [min(end, bounds[i + 1]) - max(start, bounds[i]) for i in range(first, last)]
            passes.append((start, end, first, last, torch.tensor(counts, dtype=torch.int64, device=device)))
        return passes

    def _joined_source(self, sources: list[torch.Tensor], scaled: list[torch.Tensor], flat: dict[str, Any]) -> Any:
        """θ as one 1-D tensor in the buffers' order: a view of the buffer the parameters already
        lie in back to back, with the buffers' strides (kept while they stay there), else one ``cat``."""
        where = [param.data_ptr() for param in sources]
        if flat["source"] is not None and flat["source"][1] == where:
            return flat["source"][0]
        first, size = sources[0], sources[0].element_size()
        offsets = [0, *itertools.accumulate(flat["numels"])]  # elements before each parameter
        in_place = all(
            param.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and param.stride() == buffer.stride()
            and ptr == where[0] + size * offset
            for param, buffer, ptr, offset in zip(sources, scaled, where, offsets)
        )
        if not in_place:
            return torch.cat([flat_view(param.detach(), like=buffer) for param, buffer in zip(sources, scaled)])
        joined = first.detach().as_strided((offsets[-1],), (1,), first.storage_offset())
        flat["source"] = (joined, where)
        return joined

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the target network θ̄ (derived from ``θ̄_S / K`` when it is not stored)."""
        if not self.derived_target:
            return self.target(*args, **kwargs)
        if self._fresh:
            return self.source(*args, **kwargs)
        return functional_call(self.source, dict(zip(self.param_names, self._derived())), args, kwargs)

    def target_parameters(self) -> list[torch.Tensor]:
        """θ̄ as tensors: the stored target's parameters, or (derived) freshly computed copies."""
        if not self.derived_target:
            return list(self.target.parameters())
        if self._fresh:
            return [p.detach() for p in self.source.parameters()]
        return self._derived()

    def _buffers_in_order(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        names = [_buffer_name(name) for name in self.param_names]
        return (
            [getattr(self.scaled_params, n) for n in names],
            [getattr(self.kahan_comp, n) for n in names],
        )

    def check_finite(self) -> None:
        """Raise FloatingPointError if ``K·θ̄`` is not finite (one host sync; no-op uncompensated),
        naming the parameter and the first update after which it was not."""
        if not self.compensated:
            return
        scaled, _ = self._buffers_in_order()
        if not scaled:
            return
        first = self.first_nonfinite_update()
        flags = torch.stack([all_finite(t).to(scaled[0].device) for t in scaled])
        if first is None and bool(flags.all()):
            return
        scales = self.tensor_scales().tolist()
        when = f" since target update {first} of {int(self.target_updates)}" if first is not None else ""
        for name, tensor, factor in zip(self.param_names, scaled, scales):
            if not bool(all_finite(tensor)):
                if self.adaptive_scale:
                    raise FloatingPointError(
                        f"KahanEMA: K·θ is not finite for parameter {name!r}{when} (K = {factor:g}, adaptive, "
                        f"dtype {tensor.dtype}): the critic's weights themselves are no longer finite"
                    )
                raise FloatingPointError(
                    f"KahanEMA: K·θ is not finite for parameter {name!r}{when} (K = {factor:g}, "
                    f"dtype {tensor.dtype}); |θ| must stay below "
                    f"{torch.finfo(tensor.dtype).max / factor:.4g} with a fixed K (the adaptive scale has "
                    "no such ceiling)"
                )
        raise FloatingPointError(f"KahanEMA: the scaled target copy was not finite{when}")

    @torch.no_grad()
    def update_(self, tau: float) -> None:
        """``θ̄ <- θ̄ + τ(θ - θ̄)``, Kahan-compensated on the scaled copy when enabled (each
        tensor's scale first re-chosen when ``adaptive_scale``)."""
        sources = [p for _, p in self.source.named_parameters()]
        targets = [] if self.derived_target else [p for _, p in self.target.named_parameters()]
        if not self.compensated:
            increments = torch._foreach_sub(sources, targets)
            torch._foreach_mul_(increments, tau)
            torch._foreach_add_(targets, increments)
            return
        flat = self._flat_buffers()
        scaled, comps = self._buffers_in_order()
        if self.compiled and flat is not None:
            self._update_compiled(tau, sources, targets, scaled, flat)
            return
        scales = self.tensor_scales()
        if self.adaptive_scale and sources:
            count = len(sources)
            peaks = _peaks([*sources, *scaled]).view(2, count)  # max|θ_i|, then max|θ̄_S,i|
            shifts = self._shifts_for(torch.maximum(peaks[0], peaks[1] / scales), sources[0].dtype)
            new_scales = torch.exp2(shifts.float()).mul_(self.scale)
            factors = new_scales / scales  # powers of two: 1 where a tensor keeps its scale
            if flat is None:
                per_tensor = list(factors.unbind())
                torch._foreach_mul_(scaled, per_tensor)
                torch._foreach_mul_(comps, per_tensor)
            else:
                for factor, scaled_part, comps_part in self._passes(flat, factors, flat["scaled"], flat["comps"]):
                    scaled_part.mul_(factor)
                    comps_part.mul_(factor)
            self.scale_shifts.copy_(shifts)
            scales = new_scales
        if flat is None:
            # u = τ (K_i θ - θ̄_S)
            updates = torch._foreach_mul(sources, list(scales.unbind()))
            torch._foreach_sub_(updates, scaled)
            # not in place: on a CPU torch's in-place foreach rounds a Python scalar to fp16 first
            # (τ = 0.005 becomes 0.0050011); out of place it multiplies by the float32 τ, as CUDA does
            updates = torch._foreach_mul(updates, tau)
            kahan_add_(scaled, updates, comps)
            # an L1 norm carries any inf or NaN into its sum (a max-like reduction need not)
            total = torch.stack(torch._foreach_norm(scaled, 1, dtype=torch.float32)).sum()
        else:
            # u = τ (K_i θ - θ̄_S): K_i θ in float32, rounded once into the dtype, as the per-tensor form
            source = self._joined_source(sources, scaled, flat)
            for scale, source_part, scaled_part, comps_part in self._passes(
                flat, scales, source, flat["scaled"], flat["comps"]
            ):
                update = torch.empty_like(scaled_part)
                torch.mul(source_part, scale, out=update)
                update.sub_(scaled_part).mul_(tau)
                kahan_add_([scaled_part], [update], [comps_part])
            total = torch.linalg.vector_norm(flat["scaled"], 1, dtype=torch.float32)
        finite = total <= torch.finfo(torch.float32).max  # one comparison: False for inf and NaN (isfinite is six ops)
        self.target_updates.add_(1)
        failed_now = ~finite & (self.first_nonfinite < 0)
        self.first_nonfinite.copy_(torch.where(failed_now, self.target_updates, self.first_nonfinite))
        self._after_update(targets, None)

    def _after_update(self, targets: list[torch.Tensor], derived: list[torch.Tensor] | None) -> None:
        """The check (when asked for every update) and the target: marked as no longer θ itself,
        or the stored copy given ``θ̄ = θ̄_S / K_i`` (``derived``: already computed)."""
        if self.check_every_update:
            self.check_finite()
        if self.derived_target:
            if self._fresh:
                self.updates_applied.fill_(1)
                self._fresh = False
            return
        torch._foreach_copy_(targets, self._derived() if derived is None else derived)

    def _compiled_tables(self, flat: dict[str, Any], tau: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The compiled ops' parameter ends and hyperparameters (``fused_target``), made once per
        flat buffer and again when τ changes; ``tau`` None (the derived target's division, which
        reads only K) keeps the τ last used."""
        from . import fused_target

        first = flat["scaled"]
        if "ends" not in flat:
            flat["ends"] = fused_target.ends_table(flat["numels"], first.device)
        if tau is None:
            tau = flat["hyper"][0][0] if "hyper" in flat else 0.0
        key = (float(tau), self.scale, self.headroom * torch.finfo(first.dtype).max / self.scale)
        if flat.get("hyper", (None,))[0] != key:
            flat["hyper"] = (key, fused_target.hyperparameters(*key, first.device))
        return flat["ends"], flat["hyper"][1]

    def _update_compiled(
        self,
        tau: float,
        sources: list[torch.Tensor],
        targets: list[torch.Tensor],
        scaled: list[torch.Tensor],
        flat: dict[str, Any],
    ) -> None:
        """The flat update as one compiled op (``fused_target.py``): the same bits as the flat
        form above. The peaks that choose the adaptive scale are one foreach norm before it."""
        from . import fused_target

        norms = list(torch._foreach_norm([*sources, *scaled], float("inf"))) if self.adaptive_scale else []
        target = None if self.derived_target else torch.empty_like(flat["scaled"])
        fused_target.target_update(
            self._joined_source(sources, scaled, flat), flat["scaled"], flat["comps"], target, norms,
            self.scale_shifts, self.target_updates, self.first_nonfinite, *self._compiled_tables(flat, tau), MIN_SHIFT,
        )  # fmt: skip
        self._after_update(targets, None if target is None else segment_views(target, scaled))
