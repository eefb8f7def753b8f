"""pixelsac: pixel-based SAC with DrQ augmentation on DeepMind Control, trainable in pure fp16."""

__version__ = "0.1.0"
