"""Torch-free: assemble a control plane from settings, and THE driver loop over a Backend."""
