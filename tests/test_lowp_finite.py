"""lowp.finite: one-pass finiteness checks, bit for bit the elementwise ones they replace."""

import pytest
import torch

from pixelsac.lowp.finite import all_finite, finite_bits

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def every_16_bit_value(dtype: torch.dtype) -> torch.Tensor:
    """All 65,536 bit patterns of a 16-bit float: every finite value, both infinities, NaNs."""
    return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_finite_agrees_with_isfinite_all(dtype):
    generator = torch.Generator().manual_seed(0)
    for bad in (None, float("nan"), float("inf"), -float("inf")):
        for trial in range(20):
            tensor = (torch.randn(257, generator=generator) * 10 ** (trial % 5)).to(dtype)
            if bad is not None:
                tensor[int(torch.randint(0, 257, (1,), generator=generator))] = bad
            assert bool(all_finite(tensor)) == bool(torch.isfinite(tensor).all()) == (bad is None)
    assert bool(all_finite(torch.empty(0, dtype=dtype)))
    assert bool(all_finite(torch.tensor(3.0, dtype=dtype)))  # 0-dim
    assert bool(all_finite(torch.arange(5)))  # integers are always finite


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("factor", [1.1 * 0.9005, 1.0001, 2.0, 1000.0, 1e-3, 65504.0])
def test_the_scaled_check_equals_the_elementwise_product_on_every_16_bit_value(dtype, factor):
    """The loss scaler's ``isfinite(margin·grad).all()``: exhaustively, each value alone, so the
    rounding of the product at the edge of the range is what decides."""
    values = every_16_bit_value(dtype)
    expected = torch.isfinite(values * factor)
    got = torch.stack([all_finite(v.reshape(1), factor) for v in values])
    assert torch.equal(got, expected)
    # and with many values at once: finite exactly when every product is
    assert bool(all_finite(values, factor)) == bool(expected.all()) is False
    finite_values = values[torch.isfinite(values) & (values.abs() < 1)]
    assert bool(all_finite(finite_values, factor)) == bool(torch.isfinite(finite_values * factor).all())


@pytest.mark.parametrize("factor", [1.0001, 1.0002])
def test_deciding_on_the_unrounded_product_would_disagree(factor):
    """The exhaustive test above can fail: comparing the exact product with fp16's largest value,
    instead of rounding it into fp16 first, calls products that round down to 65504 overflows."""
    values = every_16_bit_value(torch.float16)
    values = values[torch.isfinite(values)]
    unrounded = (values.double() * factor).abs() <= torch.finfo(torch.float16).max
    assert not torch.equal(unrounded, torch.isfinite(values * factor))


def test_a_non_positive_factor_is_refused():
    with pytest.raises(ValueError, match="positive"):
        all_finite(torch.ones(3, dtype=torch.float16), 0.0)


def test_finite_bits_is_isfinite_for_every_float32_pattern_class():
    generator = torch.Generator().manual_seed(1)
    bits = torch.randint(-(1 << 31), (1 << 31) - 1, (1 << 16,), dtype=torch.int64, generator=generator)
    values = bits.to(torch.int32).view(torch.float32)  # random patterns: NaN payloads, subnormals, ...
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, 3.4028235e38])
    for tensor in (values, specials):
        assert torch.equal(finite_bits(tensor), torch.isfinite(tensor))
    with pytest.raises(TypeError):
        finite_bits(torch.ones(2, dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("factor", [None, 1.1 * 0.9005, 2.0, 1000.0])
def test_the_foreach_list_check_decides_as_the_per_tensor_one(dtype, factor):
    """``all_finite_many``'s GPU form (×factor, ×0, L1 norms) against ``all_finite`` per tensor:
    every 16-bit value alone (so the rounding of the product decides), and lists with one bad
    element among finite tensors of several shapes (0-dim, empty and integer ones included)."""
    from pixelsac.lowp.finite import all_finite_many

    largest = torch.finfo(dtype).max
    edge = largest / (factor or 1.0)  # where factor·v leaves the range: the values that decide
    if dtype == torch.float32:
        values = torch.linspace(0.98 * edge, min(1.02 * edge, largest), 301)
    else:
        values = every_16_bit_value(dtype)
        values = values[(values.float().abs() - edge).abs() <= 0.02 * edge]
    values = torch.cat([values, -values, torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0])]).to(dtype)
    decided = [bool(all_finite_many([v.reshape(1)], factor, foreach=True)) for v in values]
    assert decided == [bool(all_finite(v, factor)) for v in values]
    assert True in decided and False in decided
    generator = torch.Generator().manual_seed(1)
    for bad in (None, float("nan"), float("inf"), -float("inf"), 6e4):
        tensors = [
            torch.randn(7, 5, generator=generator).to(dtype),
            torch.tensor(0.5, dtype=dtype),
            torch.empty(0, dtype=dtype),
            torch.arange(3),
            torch.randn(300, generator=generator).to(dtype),
        ]
        if bad is not None:
            tensors[4][123] = bad
        expected = all(bool(all_finite(t, factor)) for t in tensors)
        assert bool(all_finite_many(tensors, factor, foreach=True)) == expected
        assert bool(all_finite_many(tensors, factor, foreach=False)) == expected
        assert bad in (None, 6e4) or not expected  # the bad element was seen
