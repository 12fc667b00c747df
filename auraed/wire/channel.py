"""grpc arguments of auraed's connections: keepalive, the same for the server and its clients, and
the options of every channel a client opens (``aer``'s, the host's to its guests).

grpc pings a connection that has calls open and has been silent for the keepalive time; a ping
unanswered within the timeout drops the connection and ends its calls with UNAVAILABLE. Without
it, a call whose peer vanished without a word (a VM killed, a NAT that forgot the flow) waits for
its deadline, and a followed stream, or the server's side of one, forever.
"""

from __future__ import annotations

# The longest keepalive time or timeout a configuration may ask for: grpc takes milliseconds in a
# C int (at most ~24.8 days), and a day is already far longer than any useful setting.
MAX_KEEPALIVE_SECONDS = 86400.0
# How long one connection attempt (TCP, TLS, HTTP/2 settings) may take. grpc reads it from
# min_reconnect_backoff_ms; a small value there fails every link or server slower than that
# (a far client, a guest busy booting under TCG) at once with UNAVAILABLE. 20 s is grpc's default.
CONNECT_ATTEMPT_TIMEOUT_MS = 20_000
# Retry a refused connection every 100 ms (grpc's floor) instead of grpc's 1 s growing to 2 min:
# a booting guest is reachable the moment it listens.
RECONNECT_BACKOFF_MS = 100
# A client's pings on a silent connection with calls open; auraed accepts one every
# keepalive_client_min_interval (10 s) or more.
DEFAULT_KEEPALIVE_TIME = 30.0
DEFAULT_KEEPALIVE_TIMEOUT = 20.0
# How often a guest's auraed lets the host ping it (its keepalive_client_min_interval, set in the
# config the host gives it): the host's pings to a guest (guest_keepalive_time) are never more
# frequent, or the guest would drop the connection for pinging too often.
GUEST_PING_INTERVAL_MIN = 5.0


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


def channel_options(
    keepalive_time: float = DEFAULT_KEEPALIVE_TIME, keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT
) -> list[tuple[str, int]]:
    """The grpc arguments of every channel auraed's clients open, the host's to its guests too."""
    return [
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
        ("grpc.min_reconnect_backoff_ms", CONNECT_ATTEMPT_TIMEOUT_MS),
        *keepalive_options(keepalive_time, keepalive_timeout),
    ]
