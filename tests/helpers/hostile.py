"""Job files a socket-group member might send to hurt the daemon (tests of issue 38's boundaries)."""

from __future__ import annotations


def alias_bomb(data_path: str, model_path: str = "builtin:tiny-llama", chars: int = 36_000) -> str:
    """A ~40 KB job file whose lora.targets expands, through 15 YAML aliases (under the daemon's cap of 16),
    to 4**4 copies of a `chars`-long string: megabytes for any message that echoes the value whole."""
    s = "A" * chars
    targets = f'&t4 [&t3 [&t2 [&t1 [&t0 "{s}", *t0, *t0, *t0], *t1, *t1, *t1], *t2, *t2, *t2], *t3, *t3, *t3]'
    return (f"name: bomb\nmodel:\n  path: {model_path}\n  dtype: float32\ndata:\n  path: {data_path}\n"
            f"  seq_len: 32\ntrain:\n  steps: 5\nlora:\n  targets: {targets}\n")
