"""Attention over paged KV: torch reference ops (CPU path, test oracle) and Triton kernels."""
