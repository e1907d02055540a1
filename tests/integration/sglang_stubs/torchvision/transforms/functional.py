"""Stand-in for torchvision.transforms.functional."""

from __future__ import annotations


class InterpolationMode:
    BICUBIC = "bicubic"
    BILINEAR = "bilinear"
    NEAREST = "nearest"
