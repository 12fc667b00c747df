"""What subsystems tell the metrics as it happens, without importing prometheus_client.

Images and VMs are handed a :class:`MetricsSink` when they are built; the daemon's Prometheus
metrics (auraed.metrics.prometheus) are one, and ``NO_METRICS``, which drops everything, is the
default: a daemon with its endpoint off (every guest) pays neither the import nor the counting.
What can be read from the domain when scraped (how many containers run) is not reported here.
"""

from __future__ import annotations


class MetricsSink:
    """Events the metrics count; every method does nothing here."""

    def image_pull_finished(self, result: str) -> None:
        """A pull ended: ``result`` is "ok" or the error kind's name ("unavailable", ...)."""

    def image_bytes_downloaded(self, count: int) -> None:
        """``count`` more bytes of layers came from a registry (may be called from threads)."""

    def vm_booted(self, seconds: float) -> None:
        """A VM started: ``seconds`` from launching its VMM until it was ready (a guest: serving)."""

    def vm_cloned(self, seconds: float) -> None:
        """A guest was cloned from a template: ``seconds`` from launching its VMM until it served."""


NO_METRICS = MetricsSink()
