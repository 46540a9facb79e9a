"""The daemon's contact with the OS: processes, locks, sd_notify, the unit, the trainer user, paths, logs."""
