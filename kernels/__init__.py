"""Attention and layer kernels: a torch reference (also the CPU path), Triton, flash-attn."""
