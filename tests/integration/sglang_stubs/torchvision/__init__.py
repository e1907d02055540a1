"""Stand-in for torchvision."""

__version__ = "0.0.0"
