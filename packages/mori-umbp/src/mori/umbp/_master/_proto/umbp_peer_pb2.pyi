from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EvictKeyEntry(_message.Message):
    __slots__ = ("key", "bytes_freed")
    KEY_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    key: str
    bytes_freed: int
    def __init__(self, key: _Optional[str] = ..., bytes_freed: _Optional[int] = ...) -> None: ...

class EvictKeyRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class EvictKeyResponse(_message.Message):
    __slots__ = ("evicted",)
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    evicted: _containers.RepeatedCompositeFieldContainer[EvictKeyEntry]
    def __init__(self, evicted: _Optional[_Iterable[_Union[EvictKeyEntry, _Mapping]]] = ...) -> None: ...
