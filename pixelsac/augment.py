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
* ``kornia``: ``kornia.geometry.transform.translate`` by ``(-dx, -dy)`` with ``mode="nearest"``
  and ``padding_mode="border"``: a per-sample affine warp whose sampling grid lands within
  rounding of integer coordinates, which nearest sampling rounds back to them, and the border
  mode clamps them -- the replicate-padded crop again, exactly, in fp32, fp16 and bf16. (Bilinear
  sampling is not exact: the grid is computed in floating point, so coordinates are integers
  only to within rounding, and the interpolation blends in a neighbour by that error.) uint8
  frames are warped as float32 on a CPU and float16 elsewhere (0..255 are exact in both) and
  returned as uint8. About 120 ops per call: on a GPU, more launches than ``index`` unless the
  update runs as a CUDA graph.

``backend=None`` (``perf.aug_backend: null``) picks per device: ``kornia`` on CUDA, ``index``
elsewhere. On a 2-core AMD EPYC (Zen 3, one thread, torch 2.13), two copies of a batch of 84×84
9-channel frames, medians of 7 interleaved rounds: from uint8, kornia took 3.6x the gather at
batch 128 (325 against 91 ms) and 3.7x at 512 (1,563 against 419 ms); from fp16, 1.6x
(404 against 253 ms) and 1.55x (1,811 against 1,168 ms).
"""

from __future__ import annotations

import torch
from kornia.geometry.transform import translate
from torch import nn

BACKENDS = ("kornia", "index")


def default_backend(device_type: str) -> str:
    """The random shift ``perf.aug_backend: null`` runs: kornia's warp on CUDA, the gather elsewhere."""
    return "kornia" if device_type == "cuda" else "index"


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
        return self._shift_by_warp(images, offsets)

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
    def _shift_by_warp(images: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The same shift as kornia's translation by ``(-dx, -dy)`` (nearest, border)."""
        if images.is_floating_point():
            work = images
        else:  # grid sampling needs floats; frames 0..255 are exact in either
            work = images.to(torch.float32 if images.device.type == "cpu" else torch.float16)
        translation = offsets.flip(1).neg().to(work.dtype)  # kornia's (x, y): content moves by +t
        shifted = translate(work, translation, mode="nearest", padding_mode="border", align_corners=True)
        return shifted if shifted.dtype == images.dtype else shifted.to(images.dtype)

    def copies(self, images: torch.Tensor, n: int) -> torch.Tensor:
        """``n`` independently augmented copies stacked along the batch: (n*B, C, H, W).

        One call for all copies keeps the work in a single batched kernel.
        """
        return self(images.repeat(n, *([1] * (images.dim() - 1))))
