"""The dashboard and Prometheus endpoint served by `lorad serve` (see docs/dashboard-and-metrics.md)."""
