"""What tests share besides fixtures: child processes, tiny jobs, a daemon, images, the dashboard, fakes."""
