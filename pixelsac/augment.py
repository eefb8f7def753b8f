"""DrQ's image augmentation: replicate-pad by ``pad`` pixels, then a random crop back to the
original size -- a random integer shift of up to ±pad pixels, drawn independently per sample.

Runs in whatever floating dtype the images arrive in (fp16 in pure-fp16 training): padding by
replication and cropping only move pixel values, so the result is an exact shift of the padded
image in any dtype. Randomness comes from torch's global generator (seeded per run).

Two implementations of the same distribution (offsets uniform on {0..2·pad}², per sample):

* ``kornia``: ``kornia.augmentation.RandomCrop`` with replicate padding, the reference.
* ``index``: the offsets are drawn on the images' device and the crop is one ``gather`` from the
  padded images. kornia's crop copies its random offsets to the host (three synchronisations per
  call, found by counting them in the update step), which stalls a GPU and rules out CUDA
  graphs; this one never leaves the device.
"""

from __future__ import annotations

import kornia.augmentation as K
import torch
import torch.nn.functional as F
from torch import nn

BACKENDS = ("kornia", "index")


class RandomShift(nn.Module):
    """Replicate-pad ``pad`` then random-crop to the input size, independently per sample.

    ``pad=0`` is the identity (state observations, or augmentation switched off). ``backend``
    picks the implementation (module docstring); it may be changed after construction.
    """

    def __init__(self, image_size: int, pad: int = 4, backend: str = "kornia") -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"RandomShift backend {backend!r}: choose one of {', '.join(BACKENDS)}")
        self.pad = pad
        self.backend = backend
        self.crop = (
            K.RandomCrop((image_size, image_size), padding=pad, padding_mode="replicate")
            if pad > 0 else None
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.crop is None or images.dim() != 4:
            return images
        if self.backend == "index":
            return self._shift_by_gather(images)
        return self.crop(images)

    def _shift_by_gather(self, images: torch.Tensor) -> torch.Tensor:
        """``out[n, c, i, j] = padded[n, c, i + dy_n, j + dx_n]`` with ``dy, dx ~ U{0..2·pad}``."""
        n, c, h, w = images.shape
        pad = self.pad
        padded = F.pad(images, (pad, pad, pad, pad), mode="replicate")
        padded_w = w + 2 * pad
        offsets = torch.randint(0, 2 * pad + 1, (n, 2), device=images.device)
        rows = torch.arange(h, device=images.device).view(1, h, 1) + offsets[:, 0].view(n, 1, 1)
        cols = torch.arange(w, device=images.device).view(1, 1, w) + offsets[:, 1].view(n, 1, 1)
        flat_index = (rows * padded_w + cols).view(n, 1, h * w).expand(n, c, h * w)
        return padded.flatten(2).gather(2, flat_index).view(n, c, h, w)

    def copies(self, images: torch.Tensor, n: int) -> torch.Tensor:
        """``n`` independently augmented copies stacked along the batch: (n*B, C, H, W).

        One call for all copies keeps the work in a single batched kernel.
        """
        return self(images.repeat(n, *([1] * (images.dim() - 1))))
