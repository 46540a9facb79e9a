"""The image families (FLUX.1, FLUX.2, Qwen-Image) on one shared base: data, cache, loss, samples, exports."""
