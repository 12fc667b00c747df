"""Start-up: role detection and the duties of PID 1."""
