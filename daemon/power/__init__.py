"""Power: NVML telemetry, caps, the auto-tuned limit, schedules, outage timetables and the UPS."""
