"""Deterministic stochastic rounding from float32 into a 16-bit float dtype.

Rounding to nearest is biased whenever a value is updated by relative amounts below half an
ulp: hAdam's root moment decays by ``1 - sqrt(β2) ≈ 5e-4`` per step (β2 = 0.999), at or below
half an fp16 ulp (2.4e-4 to 4.9e-4 relative) and far below a bf16 one (2e-3), so a decay that
rounds back up is lost every time while growth is kept. Stochastic rounding makes the stored
value an unbiased estimate of the float32 one::

    SR(x) = ⌈x⌉  with probability (x - ⌊x⌋) / (⌈x⌉ - ⌊x⌋),  else ⌊x⌋      E[SR(x)] = x

where ``⌊x⌋, ⌈x⌉`` are the neighbouring representable numbers of the target dtype. On the bit
pattern of a float32 this is: add a uniform random integer in ``[0, 2^k)`` to the ``k`` low
mantissa bits the target dtype drops (k = 13 for fp16, 16 for bf16), then truncate them (round
toward zero). The carry of that addition is the "round away from zero" event and has exactly the
probability above; sign-magnitude storage makes it symmetric for negative numbers.

fp16's subnormals (|x| < 2^-14 ≈ 6.1e-5) lie on a fixed grid of 2^-24, coarser than the 13 dropped
bits leave there, so the bit trick alone would end in a rounding to nearest, which is where a
decaying value sticks: ``RN(0.9·m) = m`` for ``m`` of 1-4 grid steps, ``RN(sqrt(β2)·s) = s`` for
every subnormal ``s`` at β2 = 0.999. Such ``x`` are first moved by ``±2^-14`` into
``[2^-14, 2^-13)``, whose float32 ulp is 2^-37 and fp16 ulp 2^-24 (again 13 bits apart), rounded
there as above and moved back, exactly: the subnormal grid is rounded stochastically too, the
shift's own float32 rounding (2^-38) far below the 2^-13 resolution of the probabilities. bf16
shares float32's exponent range and needs no shift.

The random integers come from a counter-based hash of ``(key, element index)`` (Wellons'
"lowbias32", itself two xorshift-multiply rounds, applied twice to ``index·C + key``, in int32
arithmetic, which wraps identically on every device), not from a generator: the same key gives
the same bits on any device, inside a CUDA graph (the key may be a device tensor) and after a
resume, with no generator state to save.
"""

from __future__ import annotations

import torch

from .finite import finite_pattern

__all__ = ["as_int32", "mix_key", "random_bits", "random_bits_at", "stochastic_round"]

_MASK32 = 0xFFFFFFFF
# lowbias32 multipliers as signed int32 (torch has no uint32 arithmetic on every device)
_MUL_A = 0x7FEB352D
_MUL_B = 0x846CA68B - (1 << 32)
# fp32 mantissa bits dropped when rounding into each 16-bit dtype
_DROPPED_BITS = {torch.float16: 13, torch.bfloat16: 16}
_FP16_SMALLEST_NORMAL = 2.0**-14


def _lowbias32_(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of an int32 tensor, in place (int32 multiplication wraps); the
    masks make ``>>`` a logical shift. In-place ops: the hash is most of stochastic rounding's
    cost, and temporaries per op made it several times slower on a CPU."""
    shifted = torch.bitwise_right_shift(x, 16).bitwise_and_(0xFFFF)
    x.bitwise_xor_(shifted).mul_(_MUL_A)
    torch.bitwise_right_shift(x, 15, out=shifted).bitwise_and_(0x1FFFF)
    x.bitwise_xor_(shifted).mul_(_MUL_B)
    torch.bitwise_right_shift(x, 16, out=shifted).bitwise_and_(0xFFFF)
    return x.bitwise_xor_(shifted)


def as_int32(value: int | torch.Tensor) -> int | torch.Tensor:
    """The low 32 bits of an integer as a signed int32 value (two's complement)."""
    if torch.is_tensor(value):
        if value.dtype == torch.int32:
            return value
        # bit 31 flipped, then subtracted: v - 2^32 for v >= 2^31, else v (v the low 32 bits)
        return ((value.to(torch.int64) ^ (1 << 31)) & _MASK32).sub_(1 << 31).to(torch.int32)
    value &= _MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


def mix_key(*parts: int | torch.Tensor, start: int | torch.Tensor | None = None) -> int | torch.Tensor:
    """Combine integers (or integer/float tensors, e.g. a device step count) into one 32-bit key;
    a tensor part keeps the result an int64 tensor on its device (no host read), elementwise for
    a vector of parts. ``start``: continue an earlier key, ``mix_key(a, b, c) == mix_key(c,
    start=mix_key(a, b))`` (int64 arithmetic wraps, and only the low 32 bits are kept)."""
    key: int | torch.Tensor = 0x2545F491 if start is None else start
    for part in parts:
        if torch.is_tensor(part):
            # part + key·C + C', one op for the first two (int64 arithmetic wraps alike)
            key = part.to(torch.int64).add(key, alpha=0x9E3779B1).add_(0x7F4A7C15) & _MASK32
        else:
            key = (key * 0x9E3779B1 + (part + 0x7F4A7C15)) & _MASK32
        key = key ^ (key >> 15)
    return key


def random_bits(
    numel: int, key: int | torch.Tensor, bits: int, device: torch.device | str, offset: int = 0
) -> torch.Tensor:
    """``numel`` uniform random integers in ``[0, 2^bits)`` (int32), a function of
    ``(key, offset + i)`` only."""
    index_dtype = torch.int32 if offset + numel < 1 << 31 else torch.int64
    return random_bits_at(torch.arange(offset, offset + numel, dtype=index_dtype, device=device), key, bits)


def random_bits_at(counter: torch.Tensor, key: int | torch.Tensor, bits: int) -> torch.Tensor:
    """Uniform random integers in ``[0, 2^bits)`` (int32), one per element of ``counter`` and
    ``key`` broadcast together, each a function of its ``(key, counter)`` only. ``key`` is an
    int, a 0-dim tensor, or an integer tensor of ``counter``'s shape (a key per element: several
    parameters' streams drawn in one call give exactly the bits of one call per parameter) or
    broadcastable with it (keys ``(2, 1)`` or ``(2, n)`` against counters ``(n,)``: two streams
    over the same elements, the bits of two calls)."""
    if not 0 < bits <= 24:
        raise ValueError(f"random_bits: bits must lie in 1..24, got {bits}")
    if torch.is_tensor(key):
        key = key.to(counter.device)
    # (counter·C + key) mod 2^32, computed in wrapping int32 arithmetic: the same low 32 bits
    mixed = counter.to(torch.int32).mul(0x27D4EB2F)  # element indices: below 2^31
    key = as_int32(key)
    if torch.is_tensor(key) and key.dim() > 0 and key.shape != mixed.shape:
        mixed = mixed + key  # broadcast: one op, as the in-place add below
    else:
        mixed.add_(key)
    hashed = _lowbias32_(_lowbias32_(mixed))
    return hashed.bitwise_right_shift_(8).bitwise_and_((1 << bits) - 1)


def stochastic_round(
    x: torch.Tensor, dtype: torch.dtype, key: int | torch.Tensor, offset: int = 0, counter: torch.Tensor | None = None
) -> torch.Tensor:
    """Round the float32 tensor ``x`` stochastically into ``dtype`` (fp16 or bf16), unbiased.

    Args:
        x: float32 values (any shape; contiguous or not).
        dtype: ``torch.float16`` or ``torch.bfloat16``; float32 returns ``x`` unchanged.
        key: selects the random stream (see :func:`mix_key`); equal keys give equal roundings.
        offset: index of ``x``'s first element in a larger stream that shares ``key``.
        counter: instead of ``offset``, every element's index in its stream (integers, ``x``'s
            numel), with ``key`` a tensor of keys per element: several streams rounded in one
            call, bit for bit as one call per stream. Or ``x`` of shape ``(k, n)``, ``counter``
            of ``n`` and ``key`` of shape ``(k, 1)`` or ``(k, n)``: ``k`` tensors of the same
            elements in one call, row ``r`` rounded as a call with ``key[r]`` would round it.

    Values that round past the largest finite number become inf, as rounding up would there.
    """
    if dtype == torch.float32:
        return x
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round: expects float32 input, got {x.dtype}")
    if dtype not in _DROPPED_BITS:
        raise ValueError(f"stochastic_round: no stochastic rounding into {dtype}")
    dropped = _DROPPED_BITS[dtype]
    flat = x if x.dim() == 1 else x.reshape(-1)  # (a view is an op too: none for a vector)
    shift, unshifted = None, flat
    if dtype == torch.float16:  # subnormal targets: onto the binade above and back (module docstring)
        shift = flat.abs().lt_(_FP16_SMALLEST_NORMAL).copysign_(flat).mul_(_FP16_SMALLEST_NORMAL)
        flat = flat + shift  # (NaN and inf: a shift of 0)
    if counter is None:
        noise = random_bits(flat.numel(), key, dropped, flat.device, offset)
    else:
        noise = random_bits_at(counter, key, dropped)
        noise = noise if noise.dim() == 1 else noise.reshape(-1)
    bits = flat.view(torch.int32)
    pattern = noise.add_(bits).bitwise_and_(~((1 << dropped) - 1))
    # NaN and inf patterns must not carry into a different value; leave them as they are
    pattern = torch.where(finite_pattern(bits), pattern, bits)
    rounded32 = pattern.view(torch.float32)
    if shift is not None:
        # exact (both on the 2^-24 grid below 2^-13); the sign back onto a zero (-0 stays -0)
        rounded32 = rounded32.sub_(shift).copysign_(unshifted)
    rounded = rounded32.to(dtype)
    return rounded if x.dim() == 1 else rounded.view(x.shape)
