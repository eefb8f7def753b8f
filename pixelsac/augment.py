"""DrQ's image augmentation: replicate-pad by ``pad`` pixels, then a random crop back to the
original size -- a random integer shift of up to ±pad pixels, drawn independently per sample.

Runs on the raw uint8 frames (what the agent augments, before casting to the model dtype: a
quarter of the bytes to move) or on floats, and returns the dtype it was given. Padding by
replication and cropping only move pixel values, so the result is an exact shift in any dtype,
and augmenting before or after the cast gives the same values. Randomness comes from torch's
global generator (seeded per run), drawn on the images' device: no host read, so a GPU never
stalls and a CUDA graph can capture either backend.

Two implementations of the same shift; both draw the offsets ``(dy, dx)`` uniform on
``{-pad..pad}²`` per sample with the same single call, so for the same generator state they give
the same images bit for bit:

* ``index``: the shifted image read in one ``gather`` with clamped coordinates --
  ``out[i, j] = img[clamp(i + dy), clamp(j + dx)]``, which is the replicate-padded crop without
  building the padded copy. About ten ops per call.
* ``kornia``: ``kornia.geometry.transform.remap`` with nearest sampling and border padding, on a
  map built from the offsets: output pixel ``(i, j)`` reads ``(i + dy, j + dx)``, in the
  normalised coordinates of ``align_corners=True`` (``2·c/(size - 1) - 1``); nearest sampling
  rounds each coordinate back to its integer and the border mode clamps it -- the
  replicate-padded crop again, exactly. The map is built on two vectors (a row and a column of
  coordinates per sample), so the call is a few ops; kornia's ``translate`` derives the same map
  from an affine matrix through several times as many on 3×3 matrices (docs/performance.md).
  Exact when the map's coordinates are integers of the sampling dtype and their normalised
  values round back to them (:func:`sampling_dtype`: the images' dtype up to size - 1 + pad of
  1,024 in fp16 and 128 in bf16, float32 beyond; uint8 frames in float32 on a CPU, float16
  elsewhere; 0..255 are exact in both). (Bilinear sampling is not exact: rounding of
  the normalised coordinates blends in a neighbour.) On a GPU one gather kernel does what
  ``grid_sample`` does here; this backend is kornia's way of doing it.

``backend=None`` (``perf.aug_backend: null``) picks per device: ``kornia`` on CUDA, ``index``
elsewhere, where kornia takes several times the gather's time from uint8 frames (measured:
docs/performance.md).
"""

from __future__ import annotations

import torch
from kornia.geometry.transform import remap
from torch import nn

BACKENDS = ("kornia", "index")


def default_backend(device_type: str) -> str:
    """The random shift ``perf.aug_backend: null`` runs: kornia's warp on CUDA, the gather elsewhere."""
    return "kornia" if device_type == "cuda" else "index"


def sampling_dtype(dtype: torch.dtype, device_type: str, reach: int) -> torch.dtype:
    """The dtype the ``kornia`` backend builds its map and samples in, for images of ``dtype``
    whose coordinates reach ``reach`` (size - 1 + pad): the images' floating dtype while
    ``reach <= 2^(mantissa bits)`` (fp16 1,024, bf16 128), else float32; uint8 frames in
    float32 on a CPU (whose half ``grid_sample`` kornia runs in float32 anyway), float16
    elsewhere. Within that bound the map's coordinates are integers of the dtype and its
    normalised values land within half a pixel of them even if ``grid_sample`` unnormalises in
    the 16-bit dtype itself (torch's CUDA kernel does it in float32, which allows twice the
    reach); tests/test_augment.py checks every size to 2,100 under both."""
    work = dtype if dtype.is_floating_point else (torch.float32 if device_type == "cpu" else torch.float16)
    if reach * torch.finfo(work).eps > 1:  # eps = 2^-(mantissa bits)
        return torch.float32
    return work


def normalised_coordinates(size: int, offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``2·(c + offset)/(size - 1) - 1`` for ``c = 0..size-1``, one row per offset (``offsets``:
    (n, 1) integers): where along one axis each output pixel reads, in ``grid_sample``'s
    ``align_corners=True`` coordinates, computed in ``dtype``."""
    coordinates = torch.arange(size, device=offsets.device, dtype=dtype).add(offsets)
    return coordinates.mul_(2.0 / max(size - 1, 1)).sub_(1.0)


class RandomShift(nn.Module):
    """Replicate-pad ``pad`` then random-crop to the input size, independently per sample.

    ``pad=0`` is the identity (state observations, or augmentation switched off). ``backend``
    picks the implementation (module docstring; None: per device); it may be changed after
    construction. ``image_size`` is the frames' height and width (kept for the signature: both
    backends read the size from the images).
    """

    def __init__(self, image_size: int, pad: int = 4, backend: str | None = None) -> None:
        super().__init__()
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"RandomShift backend {backend!r}: choose one of {', '.join(BACKENDS)}")
        self.image_size = image_size
        self.pad = pad
        self.backend = backend

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.pad <= 0 or images.dim() != 4:
            return images
        pad = self.pad
        offsets = torch.randint(0, 2 * pad + 1, (images.shape[0], 2), device=images.device) - pad  # (dy, dx)
        if (self.backend or default_backend(images.device.type)) == "index":
            return self._shift_by_gather(images, offsets)
        return self._shift_by_warp(images, offsets, pad)

    @staticmethod
    def _shift_by_gather(images: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """``out[n, c, i, j] = images[n, c, clamp(i + dy_n), clamp(j + dx_n)]``: the replicate-padded
        image cropped at ``(pad + dy, pad + dx)``."""
        n, c, h, w = images.shape
        device = images.device
        rows = (torch.arange(h, device=device).view(1, h, 1) + offsets[:, 0].view(n, 1, 1)).clamp_(0, h - 1)
        cols = (torch.arange(w, device=device).view(1, 1, w) + offsets[:, 1].view(n, 1, 1)).clamp_(0, w - 1)
        flat_index = (rows * w + cols).view(n, 1, h * w).expand(n, c, h * w)
        return images.reshape(n, c, h * w).gather(2, flat_index).view(n, c, h, w)

    @staticmethod
    def _shift_by_warp(images: torch.Tensor, offsets: torch.Tensor, pad: int) -> torch.Tensor:
        """The same shift as :meth:`_shift_by_gather`, sampled by kornia's ``remap`` (nearest, border)."""
        n, _, h, w = images.shape
        work = sampling_dtype(images.dtype, images.device.type, max(h, w) - 1 + pad)
        source = images if images.dtype == work else images.to(work)
        cols = normalised_coordinates(w, offsets[:, 1:2], work)  # (n, w)
        rows = normalised_coordinates(h, offsets[:, 0:1], work)  # (n, h)
        shifted = remap(
            source,
            cols.view(n, 1, w).expand(n, h, w),
            rows.view(n, h, 1).expand(n, h, w),
            mode="nearest",
            padding_mode="border",
            align_corners=True,
            normalized_coordinates=True,
        )
        return shifted if shifted.dtype == images.dtype else shifted.to(images.dtype)

    def copies(self, images: torch.Tensor, n: int) -> torch.Tensor:
        """``n`` independently augmented copies stacked along the batch: (n*B, C, H, W).

        One call for all copies keeps the work in a single batched kernel.
        """
        return self(images.repeat(n, *([1] * (images.dim() - 1))))
