"""grpc keepalive arguments, the same for auraed's server and its clients.

grpc pings a connection that has calls open and has been silent for the keepalive time; a ping
unanswered within the timeout drops the connection and ends its calls with UNAVAILABLE. Without
it, a call whose peer vanished without a word (a VM killed, a NAT that forgot the flow) waits for
its deadline, and a followed stream, or the server's side of one, forever.
"""

from __future__ import annotations

# The longest keepalive time or timeout a configuration may ask for: grpc takes milliseconds in a
# C int (at most ~24.8 days), and a day is already far longer than any useful setting.
MAX_KEEPALIVE_SECONDS = 86400.0


def milliseconds(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def keepalive_options(keepalive_time: float, keepalive_timeout: float) -> list[tuple[str, int]]:
    """grpc arguments pinging a silent connection while calls are open; none for a time of 0."""
    if keepalive_time <= 0:
        return []
    return [
        ("grpc.keepalive_time_ms", milliseconds(keepalive_time)),
        ("grpc.keepalive_timeout_ms", milliseconds(keepalive_timeout)),
        # grpc 1.85 drops a connection whose ping goes unanswered after this (60 s by default),
        # whatever keepalive_timeout_ms says.
        ("grpc.http2.ping_timeout_ms", milliseconds(keepalive_timeout)),
        # By default grpc stops pinging after two pings with no data sent: a quiet followed stream
        # would go unwatched.
        ("grpc.http2.max_pings_without_data", 0),
    ]
