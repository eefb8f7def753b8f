"""Compound loss scaling: the scale is carried into the optimizer, never divided out.

There is no fp32 copy of the gradients to unscale into, and dividing ``S·g`` by ``S`` in fp16
would underflow again. So the scaled gradient goes straight into the optimizer, whose moments
and ε are kept in "×S" units (hAdam's ``m / (s + ε)`` does not depend on S)::

    (loss * S).backward()                     # into the optimizer's parameters only
    found_inf = not all grads finite           # checked as isfinite(margin * grad)
    optimizer.step(found_inf)                  # HAdam also refuses a step whose new state overflows
    skipped = found_inf or optimizer.state_overflow;   f = skipped ? backoff_factor : 1
    S *= f;  state *= f;  ε = max(ε·f, floor);  clean = (clean + 1)·!skipped
    if clean > growth_interval and the state stays finite at ×(growth_factor·1.1):
        S *= growth_factor;  state *= growth_factor;  ε = max(growth_factor·ε, floor);  clean = 0

A skipped step leaves the weights, the moments and ``t`` as they were (then backs off). The state
check goes beyond the paper: hAdam's root moment reaches ≈3.16·|g|, so it overflows fp16 for a
scaled gradient past ≈20.7k that is itself finite; counted as taken, such a step would move
nothing and could leave ``s`` inf for good (see hadam.py). Backing off cures it.

All of it is :meth:`CompoundLossScaler.step`, the one place a step is skipped, and it is decided
on the device: ``S``, the clean count and the step counters are 0-dim device tensors, ``found_inf``
and ``skipped`` 0-dim device flags, and HAdam with device step counts (``capturable=True``) is
handed ``found_inf`` and ``(backoff_factor, floor)`` and skips and backs off on the device (its
compiled step in its own pass over the moments). Nothing is read on the host then, and the step
can be captured in a CUDA graph. An optimizer that counts its steps on the host (HAdam
``capturable=False``, torch Adam, KahanAdam) cannot be told on the device: the scaler reads
``found_inf`` and does not step it, and backs it off on the host.

One scaler per loss (critic, actor, alpha). Under data parallelism every rank must take the
same skip/grow decision, so the found-inf flag can be passed through a caller-supplied
all-reduce.

Growth needs ``clean > growth_interval``, which cannot happen before ``growth_interval + 1 -
clean`` more steps; the host counts steps and reads ``clean`` only then (one synchronisation per
~growth_interval steps, and a growth at exactly the step the host-side rule would grow).

Growth from headroom (``headroom_growth=True``; beyond the paper). A burst of overflows halves
``S`` a dozen times in as many steps, and with the paper's rule it stays there for 10,000 clean
steps: the full-size fp16 critic sat at S = 4.88 for 2,500 updates without one more skip, where
fp16 stores scaled gradients below ~1e-6 with a few bits (against float64 Adam, hAdam's steps
for true gradients of 1e-7 to 1e-5 were 4% off at S = 4.88 and 30% at S = 1; within 1.3% from
S = 10 up). With the switch, the growth check (every ``growth_interval`` clean steps) reads the
largest peak ``P = max|S·g|`` of the steps taken since the last check and multiplies ``S`` by
the largest power of ``growth_factor`` that keeps ``P·f·headroom_margin`` within the dtype
(``headroom_margin`` = 4 covers hAdam's root moment, ≈ 3.16·|S·g|), up to ``max_growth``; no
room, no growth. So the scale climbs back as far as the gradients allow in one check, and never
into a known overflow. Without a recorded peak (just resumed) it doubles, as published.

The scale itself is the backward's first gradient (``∂(S·L)/∂L = S``), held in the loss's dtype:
for a loss computed in fp16 an ``S`` past 65504 is inf before any gradient is formed, and every
step overflows, whatever the gradients' peaks said. So headroom growth also keeps ``S·f`` within
the largest finite value of the dtype of the last loss :meth:`scale_loss` scaled (a float32
loss: no such limit; ``scale(loss)`` scales without noting it). Without it, the full-size fp16
agent's temperature (an fp16 loss, S = 40,000, its gradient's peak 2-4% of fp16's range) grew
×4-8 at every growth check and was backed off two or three times in the next steps, every 2,000
updates. The published doubling is left as it is (``headroom_growth=False``).

Headroom and overflow records (both forms, on the device, read when the host waits anyway):
every step also takes each gradient's peak ``max|S·g|`` (one foreach pass) and keeps

* :meth:`take_grad_peak`: the largest peak of the taken steps since the last read, as a fraction
  of the dtype's largest value -- how close ``S`` is to the next overflow (1 = overflowed);
* :meth:`last_overflow`: what overflowed at the last skipped step: the first parameter whose
  scaled gradient was not finite (by its position in the optimizer's order), or ``"state"``
  when the gradients were finite and the optimizer's new state was not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from . import fused_scaler
from .finite import all_finite, all_finite_many
from .hadam import HAdam
from .kahan_adam import KahanAdam

# Optimizers whose state is Adam's: exp_avg ∝ S, exp_avg_sq ∝ S².
_ADAM_LIKE = (torch.optim.Adam, KahanAdam)

__all__ = [
    "CompoundLossScaler",
    "graph_capturing",
    "LossScale",
    "rescale_optimizer_state_",
    "optimizer_state_is_finite_after",
]


def _unsupported(optimizer: Optimizer) -> TypeError:
    return TypeError(
        f"compound loss scaling needs to know how the optimizer state scales with the loss "
        f"scale; supported: HAdam (m, s ∝ S) and torch.optim.Adam/AdamW or KahanAdam "
        f"(m ∝ S, v ∝ S²), "
        f"got {type(optimizer).__name__}"
    )


@torch.no_grad()
def rescale_optimizer_state_(optimizer: Optimizer, factor: float, eps_floor: float = 1e-7) -> None:
    """Multiply an optimizer's scale-dependent state by the loss-scale change ``factor``.

    HAdam: ``exp_avg``, ``exp_avg_root`` ×factor. torch Adam (or KahanAdam): ``exp_avg`` ×factor,
    ``exp_avg_sq`` (and ``max_exp_avg_sq``) ×factor². In both, ``ε <- max(ε·factor, eps_floor)``
    since ε is added to a quantity in "×S" units.

    Raises:
        TypeError: for any other optimizer.
    """
    if isinstance(optimizer, HAdam):
        optimizer.rescale_state_(factor, eps_floor=eps_floor)
        return
    if not isinstance(optimizer, _ADAM_LIKE):
        raise _unsupported(optimizer)
    linear, quadratic = [], []
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                continue
            linear.append(state["exp_avg"])
            quadratic.append(state["exp_avg_sq"])
            if "max_exp_avg_sq" in state:
                quadratic.append(state["max_exp_avg_sq"])
        group["eps"] = max(group["eps"] * factor, eps_floor)
    if linear:
        torch._foreach_mul_(linear, factor)
        torch._foreach_mul_(quadratic, factor * factor)


@torch.no_grad()
def optimizer_state_is_finite_after(optimizer: Optimizer, factor: float) -> bool:
    """Would the optimizer state stay finite if the loss scale were multiplied by ``factor``?"""
    if isinstance(optimizer, HAdam):
        return optimizer.state_is_finite_after(factor)
    if not isinstance(optimizer, _ADAM_LIKE):
        raise _unsupported(optimizer)
    flags = []
    for state in optimizer.state.values():
        if not state:
            continue
        flags.append(all_finite(state["exp_avg"], factor))
        flags.append(all_finite(state["exp_avg_sq"], factor * factor))
    if not flags:
        return True
    return bool(torch.stack([f.to(flags[0].device) for f in flags]).all())


def graph_capturing() -> bool:
    """Is a CUDA graph capturing the current stream? (Then no Python runs at replay: host-side
    work must be left to the caller.) False without CUDA, nothing initialised."""
    return torch.backends.cuda.is_built() and torch.cuda.is_current_stream_capturing()


def _skips_on_device(optimizer: Optimizer) -> bool:
    """Can ``optimizer`` be told to skip (``step(found_inf=...)``) rather than not be stepped?
    HAdam with device step counts; an optimizer that counts on the host must be told on the host."""
    return isinstance(optimizer, HAdam) and all(group.get("capturable", False) for group in optimizer.param_groups)


class LossScale(float):
    """A loss scale value that doubles as the scaling function.

    ``CompoundLossScaler.scale`` is the number ``S`` (compare it, log it, do arithmetic with
    it: results are plain floats) and ``scaler.scale(loss)`` returns ``loss * S``, so both
    readings of the name work.
    """

    __slots__ = ()

    def __call__(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * float(self)


class CompoundLossScaler:
    """Dynamic loss scale ``S`` for one loss, with the scale carried into the optimizer state.

    Args:
        init_scale: ``S₀``.
        growth_interval: grow after more than this many consecutive clean steps.
        growth_factor: ``S``, the moments and ε are multiplied by this on growth.
        backoff_factor: ... and by this on overflow.
        eps_floor: lower bound on the optimizer's ε after any rescale.
        overflow_margin: gradients count as overflowed when ``overflow_margin·grad`` is not
            finite. The paper's value is ``1.1·0.9005`` (= 0.99055); in fp16 that product is
            rounded once, so it flags exactly the non-finite gradients.
        growth_margin: growth only happens when the state stays finite at
            ``growth_factor·growth_margin`` (the paper checks ``2.2·m`` and ``2.2·s``).
        compiled: the gradient check before each step (after one foreach norm) and the
            device bookkeeping after it as one op each, whose kernels ``torch.compile``
            generates (``fused_scaler.py``): the same values; compiled at the first step
            (seconds), for a GPU, where each 0-dim update is a kernel launch.

    Reading ``scale`` or the counters synchronises with the device: do it at logging time, not
    per step. Use::

        taken = scaler.step(optimizer, loss)    # backward of loss·S, check, step, bookkeeping
        # or, the backward your own:  scaler.scale_loss(loss).backward(); scaler.step(optimizer)
    """

    def __init__(
        self,
        init_scale: float = 1e4,
        growth_interval: int = 10_000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        eps_floor: float = 1e-7,
        overflow_margin: float = 1.1 * 0.9005,
        growth_margin: float = 1.1,
        headroom_growth: bool = False,
        headroom_margin: float = 4.0,
        max_growth: float = 2.0**10,
        compiled: bool = False,
    ) -> None:
        if not init_scale > 0:
            raise ValueError(f"init_scale must be positive, got {init_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must lie in (0, 1), got {backoff_factor}")
        if growth_interval < 0:
            raise ValueError(f"growth_interval must be >= 0, got {growth_interval}")
        self.growth_interval = int(growth_interval)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.eps_floor = float(eps_floor)
        self.overflow_margin = float(overflow_margin)
        self.growth_margin = float(growth_margin)
        self.headroom_growth = bool(headroom_growth)
        self.compiled = bool(compiled)
        self.headroom_margin = float(headroom_margin)
        self.max_growth = float(max_growth)
        # Host values until the first step puts them on its device (then only after load_state_dict)
        self._counts: dict[str, float | int] = {
            "scale": float(init_scale),
            "clean_steps": 0,
            "skipped_steps": 0,
            "taken_steps": 0,
        }
        self._device_counts: dict[str, torch.Tensor] | None = None
        self._one: torch.Tensor | None = None  # 1.0 on the device, with the counts
        self._steps_until_growth_check = 0
        # device records for the logs: the largest peak |S·g| of the taken steps since the last
        # read, and every gradient's peak at the last skipped step (a non-finite one names the
        # culprit; all finite: the optimizer's state overflowed); None until the first step
        self._grad_peak: torch.Tensor | None = None
        self._skipped_peaks: torch.Tensor | None = None
        self._interval_peak: torch.Tensor | None = None  # largest taken peak since the last growth check, in ×S units
        self._scale_limit = math.inf  # the largest S the last scaled loss's dtype holds (see scale_loss)

    def _get(self, name: str) -> Any:
        if self._device_counts is not None:
            value = self._device_counts[name].item()  # a host sync: read at logging time only
            return float(value) if name == "scale" else int(value)
        return self._counts[name]

    def _set(self, name: str, value: Any) -> None:
        self._counts[name] = value
        if self._device_counts is not None:
            self._device_counts[name].fill_(value)

    clean_steps = property(lambda self: self._get("clean_steps"), lambda self, v: self._set("clean_steps", int(v)))
    skipped_steps = property(
        lambda self: self._get("skipped_steps"), lambda self, v: self._set("skipped_steps", int(v))
    )
    taken_steps = property(lambda self: self._get("taken_steps"), lambda self, v: self._set("taken_steps", int(v)))

    @property
    def _scale(self) -> float:
        return self._get("scale")

    @_scale.setter
    def _scale(self, value: float) -> None:
        self._set("scale", float(value))

    @property
    def scale(self) -> LossScale:
        """The current loss scale ``S``: a float that can also be called, ``scale(loss) = loss·S``.

        Read from the device once a step has run (a synchronisation); :meth:`scale_loss` scales
        without reading it."""
        return LossScale(self._scale)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss·S``, without reading ``S`` on the host. Notes the loss's dtype:
        ``S`` is the backward's first gradient, in that dtype, so headroom growth keeps ``S``
        within its range (module docstring)."""
        self._scale_limit = torch.finfo(loss.dtype).max
        return loss * self._device_state(loss.device)["scale"].to(loss.dtype)

    def _device_state(self, device: torch.device) -> dict[str, torch.Tensor]:
        if self._device_counts is None:
            counts = self._counts
            self._device_counts = {
                "scale": torch.tensor(float(counts["scale"]), dtype=torch.float32, device=device),
                **{
                    k: torch.tensor(int(counts[k]), dtype=torch.int64, device=device)
                    for k in ("clean_steps", "skipped_steps", "taken_steps")
                },
            }
            self._one = torch.ones((), dtype=torch.float32, device=device)  # a constant, made once
            self._steps_until_growth_check = self.growth_interval + 1 - int(counts["clean_steps"])
        return self._device_counts

    @torch.no_grad()
    def found_inf(self, optimizer: Optimizer) -> torch.Tensor:
        """0-dim float tensor: 1.0 when any gradient of ``optimizer``'s params overflowed."""
        params = [param for group in optimizer.param_groups for param in group["params"]]
        device = params[0].device if params else None
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for param in params:
            if param.grad is not None:
                by_device.setdefault(param.grad.device, []).append(param.grad)
        if not by_device:
            # Still a tensor on the params' device, so a collective all-reduce can take it.
            return torch.zeros((), device=device)
        flags = [~all_finite_many(grads, self.overflow_margin).to(device) for grads in by_device.values()]
        return (flags[0] if len(flags) == 1 else torch.stack(flags).any()).to(torch.float32)

    def step(
        self,
        optimizer: Optimizer,
        loss: torch.Tensor | None = None,
        backward: Callable[..., Any] | None = None,
        reduce_found_inf: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """One step of ``optimizer``, skipped if it overflows (module docstring): backward, check,
        step, bookkeeping.

        Args:
            optimizer: HAdam, torch Adam or KahanAdam.
            loss: when given, the gradients are zeroed and ``S·loss`` is backpropagated into the
                optimizer's parameters only, through ``backward(tensor, inputs=...)`` (default
                ``Tensor.backward``); without it the parameters hold ``S``-scaled gradients
                already (:meth:`scale_loss`).
            reduce_found_inf: optional all-reduce (e.g. MAX over data-parallel ranks) of the
                0-dim found-inf flag. It is called on every step, clean or not, so all ranks
                participate. It may return the reduced tensor or reduce in place and return None.

        Returns:
            0-dim bool tensor: was the step taken. With HAdam counting on the device nothing is
            read on the host, and inside a CUDA graph capture the host half (:meth:`count_step`)
            is left to the caller, after each replay.
        """
        if loss is not None:
            optimizer.zero_grad(set_to_none=True)
            inputs = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
            (backward or torch.Tensor.backward)(self.scale_loss(loss), inputs=inputs)
        found_inf, peaks, peak = self._check_gradients(optimizer)
        if reduce_found_inf is not None:
            reduced = reduce_found_inf(found_inf)
            if reduced is not None:
                found_inf = reduced
        counts = self._device_state(found_inf.device)
        back_off_here = False  # the optimizer counts on the host: it is told on the host
        if _skips_on_device(optimizer):  # it skips, and backs off, on the device
            optimizer.step(found_inf=found_inf, backoff=(self.backoff_factor, self.eps_floor))
            state_overflow = optimizer.state_overflow
        elif found_inf.item() > 0:  # not stepped at all
            state_overflow, back_off_here = torch.zeros((), dtype=torch.bool, device=found_inf.device), True
        else:
            optimizer.step()
            # HAdam may refuse a step whose new state overflows; torch Adam and KahanAdam never do
            state_overflow = getattr(optimizer, "state_overflow", None)
            if state_overflow is None:
                state_overflow = torch.zeros((), dtype=torch.bool, device=found_inf.device)
            back_off_here = bool(state_overflow)
        record = peaks is not None and self._grad_peak is not None and peaks.shape == self._skipped_peaks.shape
        # one function either way (fused_scaler.py); compiled, it is one op of a few generated kernels
        _, taken, _ = (fused_scaler.after_step if self.compiled else fused_scaler.bookkeeping)(
            found_inf, state_overflow.to(found_inf.device), peaks if record else None, peak if record else None,
            self._skipped_peaks if record else None, self._grad_peak if record else None, self._interval_peak,
            counts["scale"], counts["skipped_steps"], counts["taken_steps"], counts["clean_steps"], self._one,
            self.backoff_factor,
        )  # fmt: skip
        if back_off_here:
            rescale_optimizer_state_(optimizer, self.backoff_factor, self.eps_floor)
        if not graph_capturing():
            self.count_step(optimizer)
        return taken

    def count_step(self, optimizer: Optimizer) -> None:
        """The host half of a step: count it, and look at growth when it may be due. :meth:`step`
        calls it, but not while a CUDA graph captures the step: after a replay, call it."""
        self._steps_until_growth_check -= 1
        if self._steps_until_growth_check <= 0:
            self._growth_check(optimizer)

    @torch.no_grad()
    def _check_gradients(self, optimizer: Optimizer) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """:meth:`found_inf`, each gradient's peak ``max|S·g|`` (:meth:`_gradient_peaks`) and the
        largest of them, from one pass over the gradients where they share a dtype and a device:
        rounding ``margin·g`` into the dtype is monotone in ``|g|`` (``finite.py``), so it overflows
        somewhere exactly when ``margin·max|g|`` does, and a NaN anywhere is a NaN peak (the
        foreach norm and ``max`` carry it). Elsewhere :meth:`found_inf`'s own check, and no peak.
        One function either way (``fused_scaler.verdict``); compiled (with the device's constant
        1.0), one op after the foreach norm."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if grads and self.overflow_margin > 0 and len({(g.device, g.dtype) for g in grads}) == 1:
            one = self._one
            compiled = self.compiled and one is not None and one.device == grads[0].device
            if one is None or one.device != grads[0].device:  # before the first step: no device constant yet
                one = torch.ones((), device=grads[0].device)
            check = fused_scaler.gradient_verdict if compiled else fused_scaler.verdict
            peaks, peak, found_inf = check(torch._foreach_norm(grads, float("inf")), self.overflow_margin, one)
            self._make_records(peaks)
            return found_inf, peaks, peak
        found_inf = self.found_inf(optimizer)
        return found_inf, self._gradient_peaks(optimizer, found_inf.device), None

    # --- records for the logs (device tensors; reading them is the caller's host sync) ----------
    @torch.no_grad()
    def _gradient_peaks(self, optimizer: Optimizer, device: torch.device) -> torch.Tensor | None:
        """Each gradient's peak ``max|S·g|`` in the gradients' dtype (inf/NaN where it overflowed):
        one foreach pass and a stack."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return None
        peaks = torch.stack(torch._foreach_norm(grads, float("inf"))).to(device)
        self._make_records(peaks)
        return peaks

    def _make_records(self, peaks: torch.Tensor) -> None:
        """The peak records, shaped and typed as ``peaks``, at the first step that has them."""
        if self._grad_peak is None:
            self._grad_peak = torch.zeros((), dtype=peaks.dtype, device=peaks.device)
            self._skipped_peaks = torch.zeros_like(peaks)
            if self.headroom_growth:
                self._interval_peak = torch.zeros((), dtype=peaks.dtype, device=peaks.device)

    def take_grad_peak(self) -> torch.Tensor | None:
        """The largest ``max|S·g|`` over the taken steps since the last call, ÷ the dtype's
        largest value (a 0-dim float32 device tensor, then reset; None before any step)."""
        if self._grad_peak is None:
            return None
        peak = self._grad_peak.float() / torch.finfo(self._grad_peak.dtype).max
        self._grad_peak.zero_()
        return peak

    def last_overflow(self) -> int | str | None:
        """What overflowed at the last skipped step: the position of the first parameter whose
        scaled gradient was not finite (among the parameters with a gradient, in the optimizer's
        order), ``"state"`` (every gradient finite, the optimizer's new state not), or None when
        no step was skipped. A host read."""
        if self._skipped_peaks is None:
            return None
        peaks = self._skipped_peaks.float().cpu()
        if not bool(peaks.any()):  # all zeros: never written, no step skipped yet
            return None
        bad = (~torch.isfinite(peaks)).nonzero()
        return int(bad[0]) if len(bad) else "state"

    def _growth_check(self, optimizer: Optimizer) -> None:
        """The host half of growth: read ``clean`` now that it may exceed the interval."""
        counts = self._device_counts
        clean = int(counts["clean_steps"].item())
        if clean > self.growth_interval:
            factor = self._growth_by()
            if factor > 1.0 and optimizer_state_is_finite_after(optimizer, factor * self.growth_margin):
                counts["scale"].mul_(factor)
                if self._interval_peak is not None:
                    self._interval_peak.zero_()
                rescale_optimizer_state_(optimizer, factor, self.eps_floor)
                counts["clean_steps"].zero_()
                clean = 0
            elif factor == 1.0:
                counts["clean_steps"].zero_()
                clean = 0
        self._steps_until_growth_check = max(self.growth_interval + 1 - clean, 1)

    def _growth_by(self) -> float:
        """The factor a due growth multiplies ``S`` by: ``growth_factor``, or (headroom growth)
        its largest power that keeps the interval's peak ``·headroom_margin`` in range and ``S``
        within the scaled loss's dtype, 1.0 for none. Reads the peak and ``S`` on the host, in
        one read: called at growth checks only."""
        if not self.headroom_growth or self._interval_peak is None:
            return self.growth_factor
        peak, scale = torch.stack([self._interval_peak.float(), self._device_counts["scale"].float()]).tolist()
        self._interval_peak.zero_()
        scale_room = self._scale_limit / scale
        if not peak > 0.0:  # nothing recorded since a resume: the published doubling, if S has room
            return self.growth_factor if scale_room >= self.growth_factor else 1.0
        room = min(torch.finfo(self._interval_peak.dtype).max / (peak * self.headroom_margin), scale_room)
        if not room >= self.growth_factor:
            return 1.0
        steps = int(math.floor(math.log(min(room, self.max_growth)) / math.log(self.growth_factor)))
        return self.growth_factor ** max(steps, 1)

    def state_dict(self) -> dict[str, Any]:
        """Plain python numbers: the scale and the counters."""
        return {
            "scale": self._scale,
            "clean_steps": self.clean_steps,
            "skipped_steps": self.skipped_steps,
            "taken_steps": self.taken_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._scale = float(state_dict["scale"])
        self.clean_steps = int(state_dict["clean_steps"])
        self.skipped_steps = int(state_dict["skipped_steps"])
        self.taken_steps = int(state_dict["taken_steps"])
        if self._device_counts is not None:
            self._steps_until_growth_check = self.growth_interval + 1 - self.clean_steps
