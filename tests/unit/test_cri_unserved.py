"""The RuntimeService RPCs not built yet, or never served: each refused the way its kind of RPC is
served, with what it answers."""

from __future__ import annotations

import pytest

from auraed.api.runtime import v1 as cri
from auraed.cri.errors import CriError
from auraed.cri.unserved import NOT_SUPPORTED, NOT_YET, STREAMING, Unserved
from auraed.errors import ErrorKind
from auraed.wire.descriptors import service_descriptor, snake_case


def test_the_unserved_are_rpcs_and_streaming_ones_stream() -> None:
    methods = service_descriptor("runtime.v1.RuntimeService").methods
    names = {snake_case(m.name) for m in methods}
    streaming = {snake_case(m.name) for m in methods if m.server_streaming}
    assert set(NOT_YET) <= names
    assert {n for n in NOT_YET if n in streaming} == set(STREAMING)
    assert set(NOT_SUPPORTED) <= names - streaming


async def test_checkpointing_is_refused_saying_so() -> None:
    checkpoint = Unserved().checkpoint_container  # type: ignore[attr-defined]
    for _ in range(2):  # each call its own error
        with pytest.raises(CriError) as refused:
            await checkpoint(cri.CheckpointContainerRequest(container_id="c", location="/tmp/x"), None)
        assert refused.value.kind is ErrorKind.UNIMPLEMENTED
        assert refused.value.message == "checkpointing containers is not supported by auraed"
