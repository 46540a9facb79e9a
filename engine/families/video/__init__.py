"""The video families (Wan 2.2, HunyuanVideo 1.5): the image families' base with frames as one more axis."""
