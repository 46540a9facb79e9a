"""The frozen base's speed and memory: FP8 storage and compute, block swapping, prefetch, speedups."""
