"""Services and messages by their proto names, from the descriptor pool the generated code fills.

The protos are the single source of truth: the server binds each RPC of a service's descriptor to
a servicer method, and the client finds a method's kind and reply class, by the same lookups.
"""

from __future__ import annotations

import functools
import importlib
import re

import betterproto2
from google.protobuf.descriptor import ServiceDescriptor

from auraed.api.google_proto_descriptor_pool import default_google_proto_descriptor_pool
from auraed.api.message_pool import default_message_pool


def snake_case(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _import_package_of(full_name: str) -> None:
    """Import the generated module defining ``full_name``, registering its descriptors and messages.

    A proto package maps to one module (aurae.cells.v0 -> auraed.api.aurae.cells.v0), so only what
    is used gets imported: a guest never pays for the CRI's large module.
    """
    parts = full_name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        try:
            importlib.import_module("auraed.api." + ".".join(parts[:end]))
            return
        except ModuleNotFoundError:
            continue


@functools.cache  # a client looks its method up on every call
def service_descriptor(service: str) -> ServiceDescriptor:
    _import_package_of(service)
    return default_google_proto_descriptor_pool.FindServiceByName(service)


def message_class(full_name: str) -> type[betterproto2.Message]:
    url = f"type.googleapis.com/{full_name}"
    if url not in default_message_pool.url_to_type:
        _import_package_of(full_name)
    return default_message_pool.url_to_type[url]
