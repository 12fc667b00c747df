"""The Python client for auraed, and ``aer``, the command line built on it."""

from auraed.client.client import AuraeClient, ClientConfig, ClientError, load_client_config, log_lines

__all__ = ["AuraeClient", "ClientConfig", "ClientError", "load_client_config", "log_lines"]
