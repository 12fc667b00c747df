"""auraed: a nested host/guest container runtime in the shape of Aurae."""

__version__ = "0.1.0"
