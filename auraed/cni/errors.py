"""The CNI subsystem's one error type."""

from __future__ import annotations

from auraed.errors import AuraeError, ErrorKind

# The CNI spec's well-known error codes (SPEC.md, "Error"): 1-99 are the spec's, 100+ the plugin's.
CODE_INCOMPATIBLE_VERSION = 1
CODE_UNSUPPORTED_FIELD = 2
CODE_UNKNOWN_CONTAINER = 3
CODE_INVALID_ENVIRONMENT = 4
CODE_IO_FAILURE = 5
CODE_DECODING_FAILURE = 6
CODE_INVALID_CONFIG = 7
CODE_TRY_AGAIN_LATER = 11

# What the configuration (not the pod) got wrong: fixing it is the operator's job, so the request
# cannot succeed until then (FAILED_PRECONDITION), as with a missing plugin.
_CONFIG_CODES = frozenset(
    {
        CODE_INCOMPATIBLE_VERSION,
        CODE_UNSUPPORTED_FIELD,
        CODE_INVALID_ENVIRONMENT,
        CODE_DECODING_FAILURE,
        CODE_INVALID_CONFIG,
    }
)


class CniError(AuraeError):
    """A pod network operation that cannot be carried out; ``kind`` says why."""

    @classmethod
    def internal(cls, message: str) -> CniError:
        return cls(ErrorKind.INTERNAL, message)

    @classmethod
    def deadline(cls, message: str) -> CniError:
        return cls(ErrorKind.DEADLINE_EXCEEDED, message)


def kind_of_plugin_code(code: int) -> ErrorKind:
    """The ErrorKind for a plugin's error ``code``: configuration mistakes are
    FAILED_PRECONDITION, "try again later" UNAVAILABLE, anything else (I/O, the plugin's own
    codes) INTERNAL."""
    if code in _CONFIG_CODES:
        return ErrorKind.FAILED_PRECONDITION
    if code == CODE_TRY_AGAIN_LATER:
        return ErrorKind.UNAVAILABLE
    return ErrorKind.INTERNAL
