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
probability above; sign-magnitude storage makes it symmetric for negative numbers. Below fp16's
normal range (|x| < 6.1e-5) fp16 keeps fewer bits than this leaves, and the final conversion
rounds to nearest there.

The random integers come from a counter-based hash of ``(key, element index)`` (Wellons'
"lowbias32", two xorshift-multiply rounds in int32 arithmetic, which wraps identically on every
device), not from a generator: the same key gives the same bits on any device, inside a CUDA
graph (the key may be a device tensor) and after a resume, with no generator state to save.
"""

from __future__ import annotations

import torch

__all__ = ["mix_key", "random_bits", "stochastic_round"]

_MASK32 = 0xFFFFFFFF
# lowbias32 multipliers as signed int32 (torch has no uint32 arithmetic on every device)
_MUL_A = 0x7FEB352D
_MUL_B = 0x846CA68B - (1 << 32)
# fp32 mantissa bits dropped when rounding into each 16-bit dtype
_DROPPED_BITS = {torch.float16: 13, torch.bfloat16: 16}


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (int32 in, int32 out); the masks make ``>>`` a logical shift."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _MUL_A
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _MUL_B
    return x ^ ((x >> 16) & 0xFFFF)


def mix_key(*parts: int | torch.Tensor) -> int | torch.Tensor:
    """Combine integers (or 0-dim integer/float tensors, e.g. a device step count) into one
    32-bit key; a tensor part keeps the result a 0-dim int64 tensor on its device (no host read)."""
    key: int | torch.Tensor = 0x2545F491
    for part in parts:
        if torch.is_tensor(part):
            part = part.to(torch.int64)
        key = (key * 0x9E3779B1 + part + 0x7F4A7C15) & _MASK32
        key = key ^ (key >> 15)
    return key


def random_bits(numel: int, key: int | torch.Tensor, bits: int, device: torch.device | str,
                offset: int = 0) -> torch.Tensor:
    """``numel`` uniform random integers in ``[0, 2^bits)`` (int32), a function of
    ``(key, offset + i)`` only."""
    if not 0 < bits <= 24:
        raise ValueError(f"random_bits: bits must lie in 1..24, got {bits}")
    counter = torch.arange(offset, offset + numel, dtype=torch.int64, device=device)
    if torch.is_tensor(key):
        key = key.to(device=device, dtype=torch.int64)
    counter = ((counter * 0x27D4EB2F + key) & _MASK32)
    counter = torch.where(counter >= 1 << 31, counter - (1 << 32), counter).to(torch.int32)
    hashed = _lowbias32(_lowbias32(counter))
    return (hashed >> 8) & ((1 << bits) - 1)


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, key: int | torch.Tensor,
                     offset: int = 0) -> torch.Tensor:
    """Round the float32 tensor ``x`` stochastically into ``dtype`` (fp16 or bf16), unbiased.

    Args:
        x: float32 values (any shape; contiguous or not).
        dtype: ``torch.float16`` or ``torch.bfloat16``; float32 returns ``x`` unchanged.
        key: selects the random stream (see :func:`mix_key`); equal keys give equal roundings.
        offset: index of ``x``'s first element in a larger stream that shares ``key``.

    Values that round past the largest finite number become inf, as rounding up would there.
    """
    if dtype == torch.float32:
        return x
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round: expects float32 input, got {x.dtype}")
    if dtype not in _DROPPED_BITS:
        raise ValueError(f"stochastic_round: no stochastic rounding into {dtype}")
    dropped = _DROPPED_BITS[dtype]
    flat = x.reshape(-1)
    noise = random_bits(flat.numel(), key, dropped, flat.device, offset)
    pattern = flat.view(torch.int32) + noise
    # NaN and inf patterns must not carry into a different value; leave them as they are
    pattern = torch.where(torch.isfinite(flat), pattern & ~((1 << dropped) - 1), flat.view(torch.int32))
    return pattern.view(torch.float32).to(dtype).view(x.shape)
