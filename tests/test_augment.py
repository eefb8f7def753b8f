"""DrQ's random shift: an exact integer shift of the replicate-padded image, per sample."""

import pytest
import torch
import torch.nn.functional as F

from pixelsac.augment import BACKENDS, RandomShift, default_backend


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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16])
def test_shift_is_exact_from_uint8_and_in_bf16(backend, dtype):
    """uint8 frames (what the agent shifts) come back as uint8, the exact crop; bf16 likewise."""
    assert len(set(_check(dtype, backend))) > 3


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.bfloat16, torch.float32])
def test_kornia_and_index_give_the_same_images_for_the_same_draws(dtype):
    """Same generator state, same offsets, same images bit for bit: at DrQ's size (84×84, 9
    channels, pad 4), where the warp's grid coordinates are furthest from small integers."""
    images = torch.randint(0, 256, (64, 9, 84, 84), dtype=torch.uint8).to(dtype)
    torch.manual_seed(4)
    by_index = RandomShift(84, 4, "index")(images)
    torch.manual_seed(4)
    by_kornia = RandomShift(84, 4, "kornia")(images)
    assert by_kornia.dtype == by_index.dtype == dtype
    assert torch.equal(by_kornia, by_index)
    assert not torch.equal(by_index, images)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16])
def test_the_shift_reads_nothing_on_the_host(backend, dtype):
    """No ``aten._local_scalar_dense`` (a device-to-host sync on CUDA, an error in graph capture),
    no ``.item()``/``.tolist()``/``.cpu()``/``.numpy()`` (which on a CPU tensor dispatch nothing),
    and no tensor made from host data (``lift_fresh``: a host-to-device copy during capture)."""
    from dispatch_count import DispatchCount
    from test_lowp_sync_free import HostReads

    images = torch.randint(0, 256, (8, 9, 20, 20), dtype=torch.uint8).to(dtype)
    shift = RandomShift(20, 4, backend)
    with DispatchCount() as count, HostReads() as calls:
        shift.copies(images, 2)
    assert count.host_reads == 0 and calls.total == 0, (dict(count.read_sites), calls.calls)
    assert not any("lift_fresh" in op for op in count.ops), count.ops


def test_the_default_backend_is_kornia_on_cuda_and_the_gather_elsewhere():
    assert default_backend("cuda") == "kornia" and default_backend("cpu") == "index"
    images = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8)
    torch.manual_seed(5)
    by_default = RandomShift(16, 4)(images)
    torch.manual_seed(5)
    assert torch.equal(by_default, RandomShift(16, 4, "index")(images))
