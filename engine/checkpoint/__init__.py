"""Checkpoints: when to save (cadence), host copies at a step boundary, and the crash-safe store."""
