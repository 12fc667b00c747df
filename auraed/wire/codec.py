"""The protobuf wire format of our betterproto2 messages, read and written by protobuf's C parser.

Messages stay betterproto2 dataclasses everywhere (DESIGN.md, decision 1); only the wire work moves
here. betterproto2 reads and writes the wire in pure Python, a byte at a time: ~0.1-0.2 ms for a
0.7 KB reply on these machines, about a third of a local round trip, and ten times that in a guest
under emulation. protobuf (already a dependency: descriptors, reflection) parses and serializes in
C (upb); copying fields between its message and the dataclass costs about a seventh of
betterproto2's own work.

Decoding is also strict where betterproto2 is not: malformed input is refused (:class:`CodecError`)
and a field sent with the wrong wire type is dropped, like an unknown field, not taken for whatever
arrived (an int where a string belongs). Encoding writes a double of -0.0, as protobuf does;
betterproto2 drops it. Two kinds of field are not handled, as our protos have none: well-known
wrapper types (which betterproto2 unwraps) and maps of messages; a test checks every message.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import sys
import typing
from collections.abc import Callable
from math import copysign
from typing import Any, TypeVar

import betterproto2
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.message import Message as ProtobufMessage

M = TypeVar("M", bound=betterproto2.Message)
Convert = Callable[[Any], Any]


class CodecError(ValueError):
    """Bytes that are not a valid message of the type, or a message that cannot be encoded."""


def decode(cls: type[M], data: bytes) -> M:
    """``data`` read as a ``cls`` message."""
    plan = _plan(cls)
    try:
        parsed = plan.protobuf_class.FromString(data)
    except DecodeError as exc:
        raise CodecError(f"malformed {cls.__name__}: {exc}") from None
    message: M = _from_protobuf(plan, parsed)
    return message


def encode(message: betterproto2.Message) -> bytes:
    """``message`` in the protobuf wire format."""
    plan = _plan(type(message))
    try:
        return _to_protobuf(plan, message).SerializeToString()
    except (TypeError, ValueError) as exc:  # a value of the wrong type or out of its range
        where = _failing_field(message)
        field = f" field {where}" if where else ""
        raise CodecError(f"cannot encode {type(message).__name__}{field}: {exc}") from None


class _Unset(enum.Enum):
    """Which values of a field are not written: proto3 leaves out a field at its default."""

    NONE = 1  # a field with presence (optional, oneof member, message): only None
    FALSY = 2  # 0, "", b"", False, [], {}
    POSITIVE_ZERO = 3  # a float: 0.0, but -0.0 is written (its bits are not zero)


def _left_out(value: Any, unset: _Unset) -> bool:
    """Whether a field holding ``value`` is not written: unset, or at proto3's default. A field
    with presence is never asked its truth (a message's would build betterproto2's metadata)."""
    if value is None:
        return True
    if unset is _Unset.NONE or value:
        return False
    return unset is _Unset.FALSY or (unset is _Unset.POSITIVE_ZERO and copysign(1, value) > 0)


def _unset_values(field: FieldDescriptor) -> _Unset:
    if field.has_presence:
        return _Unset.NONE
    if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE) and not field.is_repeated:
        return _Unset.POSITIVE_ZERO
    return _Unset.FALSY


class _Plan:
    """How to copy one message class's fields to and from protobuf's message of the same type."""

    def __init__(self, cls: type[betterproto2.Message], protobuf_class: type[ProtobufMessage]) -> None:
        self.cls = cls
        self.protobuf_class = protobuf_class
        # field number -> (dataclass field name, conversion of protobuf's value or None)
        self.readers: dict[int, tuple[str, Convert | None]] = {}
        # (dataclass field name, protobuf field name, conversion or None, which values are unset)
        self.writers: list[tuple[str, str, Convert | None, _Unset]] = []


@functools.cache
def _plan(cls: type[betterproto2.Message]) -> _Plan:
    descriptor = cls.DESCRIPTOR  # type: ignore[attr-defined]  # every generated class has it
    plan = _Plan(cls, message_factory.GetMessageClass(descriptor))
    fields = _fields_by_number(cls)
    hints: dict[str, Any] = {}  # the class's type hints, evaluated once when a field needs them
    for field in descriptor.fields:
        meta = fields[field.number]
        if meta.unwrap is not None:
            raise TypeError(f"{field.full_name}: well-known wrapper types are not handled")
        read, write = _conversions(cls, hints, meta, field)
        plan.readers[field.number] = (meta.name, read)
        plan.writers.append((meta.name, field.name, write, _unset_values(field)))
    return plan


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str  # the dataclass field's
    unwrap: Any  # betterproto2's wrapped well-known type, or None
    is_map: bool


def _fields_by_number(cls: type[betterproto2.Message]) -> dict[int, _Field]:
    """Field number -> the field, from its own betterproto2 metadata. Not betterproto2's class
    metadata (``cls._betterproto``): it evaluates every type hint of the class once per field,
    ~0.3 s of a ContainerServiceCreateRequest's first use in a guest under TCG; nor protobuf's
    descriptor options (``map_entry``), whose first read imports descriptor_pb2."""
    found = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]  # generated dataclasses
        meta = betterproto2.FieldMetadata.get(field)
        found[meta.number] = _Field(field.name, meta.unwrap, meta.proto_type == betterproto2.TYPE_MAP)
    return found


def _field_class(cls: type[betterproto2.Message], hints: dict[str, Any], name: str, index: int = 0) -> Any:
    """The class a field holds (a message's, an enum's; ``index`` 1: a map's values), from the
    class's type hints (``Optional[X]``, ``list[X]``, ``dict[K, V]``), as betterproto2 finds it."""
    if not hints:
        hints.update(typing.get_type_hints(cls, vars(sys.modules[cls.__module__]), {}))
    hint = hints[name]
    args = getattr(hint, "__args__", None)
    return args[index] if args else hint


def _conversions(
    cls: type[betterproto2.Message], hints: dict[str, Any], meta: _Field, field: FieldDescriptor
) -> tuple[Convert | None, Convert | None]:
    """How one field's value is read from protobuf's message and written to it (None: as it is)."""
    name = meta.name
    if meta.is_map and field.message_type is not None:  # a map is a repeated entry message
        value_field = field.message_type.fields_by_name["value"]
        value_cls = _field_class(cls, hints, name, index=1)
        if value_field.message_type is not None:
            raise TypeError(f"{field.full_name}: maps of messages are not handled")
        if value_field.enum_type is not None:
            return (lambda value: {k: value_cls(v) for k, v in value.items()}), None
        return dict, None
    if field.message_type is not None:
        sub_cls = _field_class(cls, hints, name)
        if field.is_repeated:
            return (
                lambda value: [_from_message(sub_cls, v) for v in value],
                lambda value: [_to_message(v) for v in value],
            )
        return (lambda value: _from_message(sub_cls, value)), _to_message
    if field.enum_type is not None:
        enum_cls = _field_class(cls, hints, name)
        if field.is_repeated:
            return (lambda value: [enum_cls(v) for v in value]), None
        return enum_cls, None
    return (list if field.is_repeated else None), None


# Sub-messages find their plans when first met, not when the outer plan is made: a message may
# contain its own type (a cell's children).


def _from_message(cls: type[betterproto2.Message], parsed: ProtobufMessage) -> Any:
    return _from_protobuf(_plan(cls), parsed)


def _to_message(message: betterproto2.Message) -> ProtobufMessage:
    return _to_protobuf(_plan(type(message)), message)


def _from_protobuf(plan: _Plan, parsed: ProtobufMessage) -> Any:
    readers = plan.readers
    values = {}
    for field, value in parsed.ListFields():  # the fields present, known ones only
        name, read = readers[field.number]
        values[name] = value if read is None else read(value)
    return plan.cls(**values)


def _to_protobuf(plan: _Plan, message: betterproto2.Message) -> ProtobufMessage:
    values = {}
    for name, proto_name, write, unset in plan.writers:
        value = getattr(message, name)
        if _left_out(value, unset):
            continue
        values[proto_name] = value if write is None else write(value)
    return plan.protobuf_class(**values)


def _failing_field(message: betterproto2.Message) -> str:
    """Where encoding ``message`` fails, as "field.sub[2].name" (protobuf's error names none)."""
    plan = _plan(type(message))
    for name, proto_name, write, unset in plan.writers:
        value = getattr(message, name)
        if _left_out(value, unset):
            continue
        try:
            plan.protobuf_class(**{proto_name: value if write is None else write(value)})
        except (TypeError, ValueError):
            return name + _failing_inside(value)
    return ""


def _failing_inside(value: Any) -> str:
    """The failing part of a message or list of messages, after its field's name."""
    if isinstance(value, betterproto2.Message):
        inner = _failing_field(value)
        return f".{inner}" if inner else ""
    for index, item in enumerate(value if isinstance(value, list) else ()):
        if isinstance(item, betterproto2.Message) and (inner := _failing_field(item)):
            return f"[{index}].{inner}"
    return ""
