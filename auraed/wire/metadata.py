"""The gRPC metadata keys auraed gives a meaning to, shared by the clients that send them and the
server code that reads them."""

from __future__ import annotations

# The metadata key by which a host routes a ContainerService call to a guest (vms/placement.py).
VM_METADATA_KEY = "aurae-vm"
