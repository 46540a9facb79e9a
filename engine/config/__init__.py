"""The job file: its schema, validation, and the daemon's policy over what a job may name."""
