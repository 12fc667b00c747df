"""Prometheus metrics: what the subsystems report (sink.py) and the daemon's endpoint (prometheus.py)."""
