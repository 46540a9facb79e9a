"""Datasets and the deterministic sample order."""
