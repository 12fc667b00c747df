"""ObserveService: auraed's own log, executables' output and the signals they received."""
