"""The dashboard and Prometheus endpoint served by `lorad serve` (see README "Dashboard and metrics")."""
