"""DrQ's random shift: an exact integer shift of the replicate-padded image, per sample."""

import pytest
import torch
import torch.nn.functional as F

from pixelsac.augment import BACKENDS, RandomShift


def _find_shift(out: torch.Tensor, padded: torch.Tensor, size: int, pad: int) -> tuple[int, int] | None:
    for dy in range(2 * pad + 1):
        for dx in range(2 * pad + 1):
            if torch.equal(out, padded[:, dy : dy + size, dx : dx + size]):
                return dy, dx
    return None


def _check(dtype: torch.dtype, backend: str = "kornia", samples: int = 12) -> list:
    torch.manual_seed(0)
    size, pad = 16, 4
    images = torch.randint(0, 256, (samples, 9, size, size)).to(dtype)
    out = RandomShift(size, pad, backend)(images)
    assert out.shape == images.shape and out.dtype == dtype
    padded = F.pad(images.float(), (pad,) * 4, mode="replicate").to(dtype)
    shifts = []
    for i in range(images.shape[0]):
        shift = _find_shift(out[i], padded[i], size, pad)
        assert shift is not None, f"sample {i} is not an integer shift of the padded image"
        shifts.append(shift)
    return shifts


@pytest.mark.parametrize("backend", BACKENDS)
def test_shift_is_exact_in_fp32(backend):
    assert len(set(_check(torch.float32, backend))) > 3  # independent per sample, not one shift for the batch


@pytest.mark.parametrize("backend", BACKENDS)
def test_shift_is_exact_in_fp16(backend):
    assert len(set(_check(torch.float16, backend))) > 3


def test_index_backend_draws_every_offset_uniformly():
    """81 offsets for pad 4: over 1,620 samples each is expected 20 times; a shift biased to the
    centre, a missing edge offset or dy tied to dx fails the counts."""
    shifts = _check(torch.float16, "index", samples=1620)
    counts = torch.zeros(9, 9)
    for dy, dx in shifts:
        counts[dy, dx] += 1
    assert (counts > 0).all(), counts
    chi2 = float(((counts - 20.0) ** 2 / 20.0).sum())
    assert chi2 < 130.0, chi2  # 80 degrees of freedom: p < 0.001 above ~125


@pytest.mark.parametrize("backend", BACKENDS)
def test_copies_are_independent_and_zero_pad_is_identity(backend):
    torch.manual_seed(1)
    images = torch.randint(0, 256, (4, 3, 16, 16)).float()
    copies = RandomShift(16, 4, backend).copies(images, 2)
    assert copies.shape == (8, 3, 16, 16)
    assert not torch.equal(copies[:4], copies[4:])
    assert torch.equal(RandomShift(16, 0, backend)(images), images)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="kornia, index"):
        RandomShift(16, 4, "opencv")


def test_index_shift_equals_pad_then_crop_with_the_same_offsets():
    """The clamped gather is the replicate-padded crop, offset for offset (the spec's form)."""
    torch.manual_seed(2)
    pad, size = 4, 12
    images = torch.randint(0, 256, (32, 6, size, size), dtype=torch.uint8)
    state = torch.get_rng_state()
    out = RandomShift(size, pad, "index")(images)
    torch.set_rng_state(state)
    offsets = torch.randint(0, 2 * pad + 1, (32, 2))
    padded = F.pad(images.float(), (pad,) * 4, mode="replicate")
    expected = torch.stack(
        [padded[i, :, dy : dy + size, dx : dx + size] for i, (dy, dx) in enumerate(offsets.tolist())]
    )
    assert torch.equal(out.float(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_shifting_frames_before_the_cast_equals_shifting_after(dtype):
    """The agent shifts uint8 frames and then casts: the same values as casting first."""
    images = torch.randint(0, 256, (16, 9, 16, 16), dtype=torch.uint8)
    torch.manual_seed(3)
    before = RandomShift(16, 4, "index").copies(images, 2).to(dtype)
    torch.manual_seed(3)
    after = RandomShift(16, 4, "index").copies(images.to(dtype), 2)
    assert before.dtype == after.dtype == dtype and torch.equal(before, after)


def test_kornia_takes_integer_frames_as_float32():
    images = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    out = RandomShift(16, 4, "kornia")(images)
    assert out.dtype == torch.float32 and out.shape == images.shape
    assert torch.equal(out, out.round()) and out.min() >= 0 and out.max() <= 255
