"""The streaming server's settings, with the defaults the kubelet's own streaming server uses."""

from __future__ import annotations

import dataclasses
import ipaddress

from auraed.cri.streaming.spdy import SpdyLimits


@dataclasses.dataclass(frozen=True)
class StreamingConfig:
    """Where the streaming server listens and how long it waits for what."""

    bind_address: str = "127.0.0.1"
    """Address to listen on (IPv4 or IPv6 literal)."""
    port: int = 0
    """TCP port; 0 picks a free one at start."""
    url_host: str = ""
    """Host put in the URLs handed out; empty: the bound address (loopback for a wildcard)."""
    token_ttl: float = 60.0
    """Seconds a URL's one-time token stays valid (the kubelet's: 1 minute)."""
    max_pending_tokens: int = 1000
    """Most tokens handed out and not yet used or expired; more are refused (the kubelet's 1000)."""
    stream_creation_timeout: float = 30.0
    """Seconds a SPDY client has to open the streams of its request (the kubelet's 30 s)."""
    idle_timeout: float = 4 * 3600.0
    """Seconds a session may pass with no byte in either direction before it is closed (4 h)."""
    request_timeout: float = 10.0
    """Seconds a new connection has to send its whole HTTP request head."""
    max_request_head: int = 64 * 1024
    """Largest HTTP request head accepted (bytes)."""
    max_connections: int = 1024
    """Most connections served at once; further ones are answered 503."""
    close_grace: float = 10.0
    """Seconds left to a client to read the end of a session and hang up before it is cut."""
    websocket_max_message: int = 1 << 20
    """Largest WebSocket message accepted (bytes)."""
    spdy: SpdyLimits = dataclasses.field(default_factory=SpdyLimits)

    def __post_init__(self) -> None:
        try:
            ipaddress.ip_address(self.bind_address)
        except ValueError:
            raise ValueError(f"bind_address: {self.bind_address!r} is not an IP address") from None
        if not 0 <= self.port <= 65535:
            raise ValueError("port: must be 0 to 65535")
        for name in (
            "token_ttl",
            "stream_creation_timeout",
            "idle_timeout",
            "request_timeout",
            "close_grace",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be positive")
        for name in ("max_pending_tokens", "max_request_head", "max_connections", "websocket_max_message"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive")
