"""DrQ's random shift: an exact integer shift of the replicate-padded image, per sample."""

import torch
import torch.nn.functional as F

from pixelsac.augment import RandomShift


def _find_shift(out: torch.Tensor, padded: torch.Tensor, size: int, pad: int) -> tuple[int, int] | None:
    for dy in range(2 * pad + 1):
        for dx in range(2 * pad + 1):
            if torch.equal(out, padded[:, dy:dy + size, dx:dx + size]):
                return dy, dx
    return None


def _check(dtype: torch.dtype) -> set:
    torch.manual_seed(0)
    size, pad = 16, 4
    images = torch.randint(0, 256, (12, 9, size, size)).to(dtype)
    out = RandomShift(size, pad)(images)
    assert out.shape == images.shape and out.dtype == dtype
    padded = F.pad(images.float(), (pad,) * 4, mode="replicate").to(dtype)
    shifts = set()
    for i in range(images.shape[0]):
        shift = _find_shift(out[i], padded[i], size, pad)
        assert shift is not None, f"sample {i} is not an integer shift of the padded image"
        shifts.add(shift)
    return shifts


def test_shift_is_exact_in_fp32():
    assert len(_check(torch.float32)) > 3  # independent per sample, not one shift for the batch


def test_shift_is_exact_in_fp16():
    assert len(_check(torch.float16)) > 3


def test_copies_are_independent_and_zero_pad_is_identity():
    torch.manual_seed(1)
    images = torch.randint(0, 256, (4, 3, 16, 16)).float()
    copies = RandomShift(16, 4).copies(images, 2)
    assert copies.shape == (8, 3, 16, 16)
    assert not torch.equal(copies[:4], copies[4:])
    assert torch.equal(RandomShift(16, 0)(images), images)
