"""The gRPC plumbing auraed's server and its clients share, below both.

The daemon's server and its clients speak the same wire: messages encoded one way (codec), looked
up in one descriptor pool (descriptors), errors told as one set of status codes (status), the same
TLS rules (tls), channel arguments (channel) and metadata keys (metadata). Domain code that speaks
gRPC itself (servicers, the host's channels to its guests, the image placer) takes them from here
too, so nothing below the server imports the server or the client. The package imports nothing
itself: each module is imported where it is used, and a guest's start path pays only for those
it needs.
"""
