"""DrQ's random shift: an exact integer shift of the replicate-padded image, per sample."""

import pytest
import torch
import torch.nn.functional as F

from pixelsac.augment import BACKENDS, RandomShift, default_backend, normalised_coordinates, sampling_dtype


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


def _reads(size: int, pad: int, dtype: torch.dtype, unnormalise_in: torch.dtype) -> torch.Tensor:
    """The pixel each output column reads for every offset, as ``grid_sample`` (nearest, border,
    ``align_corners=True``) finds it from the kornia backend's normalised coordinates:
    ``((g + 1) / 2)·(size - 1)`` computed in ``unnormalise_in``, rounded half to even, clamped."""
    offsets = torch.arange(-pad, pad + 1).view(-1, 1)
    g = normalised_coordinates(size, offsets, dtype).to(unnormalise_in)
    return ((g + 1) / 2 * (size - 1)).float().round().clamp(0, size - 1).long()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_kornia_map_reads_the_right_pixel_wherever_it_samples_in_half(dtype):
    """Every size to 2,100 and pads 1, 4 and 16: where ``sampling_dtype`` keeps the 16-bit
    dtype, each coordinate comes back to its integer whether ``grid_sample`` unnormalises in
    float32 (torch's CUDA and CPU kernels) or in the 16-bit dtype itself; and the bound is
    needed: just past it (fp16 from size 1,028, bf16 from 134) the 16-bit unnormalisation
    reads a wrong pixel, which the float32 fallback avoids."""
    for pad in (1, 4, 16):
        offsets = torch.arange(-pad, pad + 1).view(-1, 1)
        for size in range(2, 2101):
            if sampling_dtype(dtype, "cuda", size - 1 + pad) != dtype:
                continue
            want = (torch.arange(size) + offsets).clamp(0, size - 1)
            for unnormalise_in in (torch.float32, dtype):
                assert torch.equal(_reads(size, pad, dtype, unnormalise_in), want), (size, pad, unnormalise_in)
    first_wrong = {torch.float16: 1028, torch.bfloat16: 134}[dtype]
    want = (torch.arange(first_wrong) + torch.arange(-4, 5).view(-1, 1)).clamp(0, first_wrong - 1)
    assert not torch.equal(_reads(first_wrong, 4, dtype, dtype), want)
    assert sampling_dtype(dtype, "cuda", first_wrong - 1 + 4) == torch.float32


def test_the_kornia_backend_samples_uint8_in_fp16_on_a_gpu_and_large_images_in_float32():
    assert sampling_dtype(torch.uint8, "cuda", 87) == torch.float16
    assert sampling_dtype(torch.uint8, "cpu", 87) == torch.float32
    assert sampling_dtype(torch.bfloat16, "cuda", 128) == torch.bfloat16
    assert sampling_dtype(torch.bfloat16, "cuda", 129) == torch.float32
    assert sampling_dtype(torch.float16, "cuda", 1024) == torch.float16
    assert sampling_dtype(torch.float16, "cuda", 1025) == torch.float32
    assert sampling_dtype(torch.float32, "cuda", 10**6) == torch.float32


@pytest.mark.parametrize(("dtype", "size"), [(torch.bfloat16, 125), (torch.bfloat16, 126), (torch.bfloat16, 160)])
def test_kornia_and_index_agree_on_both_sides_of_the_half_sampling_bound(dtype, size):
    """bf16 images at size - 1 + pad = 128 (sampled in bf16), 129 and 163 (in float32)."""
    images = torch.randint(0, 256, (16, 2, size, size), dtype=torch.uint8).to(dtype)
    torch.manual_seed(6)
    by_index = RandomShift(size, 4, "index")(images)
    torch.manual_seed(6)
    by_kornia = RandomShift(size, 4, "kornia")(images)
    assert by_kornia.dtype == dtype and torch.equal(by_kornia, by_index)


def test_the_kornia_shift_is_a_few_kernels():
    """The map is built on a row and a column of coordinates per sample: 14 kernels a call from
    uint8, the offsets' draw included (kornia's translate took 56: an affine matrix per sample,
    normalised and inverted)."""
    from pixelsac.perf.opcount import DispatchCount

    images = torch.randint(0, 256, (4, 9, 20, 20), dtype=torch.uint8)
    with DispatchCount() as count:
        RandomShift(20, 4, "kornia")(images)
    assert count.kernels <= 14, dict(count.ops)
