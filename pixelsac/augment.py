"""DrQ's image augmentation: replicate-pad by ``pad`` pixels, then a random crop back to the
original size -- a random integer shift of up to ±pad pixels, drawn independently per sample.

Runs in whatever floating dtype the images arrive in (fp16 in pure-fp16 training): padding by
replication and cropping only move pixel values, so the result is an exact shift of the padded
image in any dtype. Randomness comes from torch's global generator (seeded per run).
"""

from __future__ import annotations

import kornia.augmentation as K
import torch
from torch import nn


class RandomShift(nn.Module):
    """Replicate-pad ``pad`` then random-crop to the input size, independently per sample.

    ``pad=0`` is the identity (state observations, or augmentation switched off).
    """

    def __init__(self, image_size: int, pad: int = 4) -> None:
        super().__init__()
        self.pad = pad
        self.crop = (
            K.RandomCrop((image_size, image_size), padding=pad, padding_mode="replicate")
            if pad > 0 else None
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.crop is None or images.dim() != 4:
            return images
        return self.crop(images)

    def copies(self, images: torch.Tensor, n: int) -> torch.Tensor:
        """``n`` independently augmented copies stacked along the batch: (n*B, C, H, W).

        One kornia call for all copies keeps the work in a single batched kernel.
        """
        return self(images.repeat(n, *([1] * (images.dim() - 1))))
