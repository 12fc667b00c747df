"""The RuntimeService RPCs not built yet: each still refused the way its kind of RPC is served."""

from __future__ import annotations

from auraed.api.runtime import v1 as cri  # noqa: F401  (registers the CRI's descriptors)
from auraed.cri.unserved import NOT_YET, STREAMING
from auraed.wire.descriptors import service_descriptor, snake_case


def test_the_unserved_are_rpcs_and_streaming_ones_stream() -> None:
    methods = service_descriptor("runtime.v1.RuntimeService").methods
    names = {snake_case(m.name) for m in methods}
    streaming = {snake_case(m.name) for m in methods if m.server_streaming}
    assert set(NOT_YET) <= names
    assert {n for n in NOT_YET if n in streaming} == set(STREAMING)
