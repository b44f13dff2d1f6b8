from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StandaloneBackendMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STANDALONE_BACKEND_UNKNOWN: _ClassVar[StandaloneBackendMode]
    STANDALONE_BACKEND_LOCAL: _ClassVar[StandaloneBackendMode]
    STANDALONE_BACKEND_DISTRIBUTED: _ClassVar[StandaloneBackendMode]
STANDALONE_BACKEND_UNKNOWN: StandaloneBackendMode
STANDALONE_BACKEND_LOCAL: StandaloneBackendMode
STANDALONE_BACKEND_DISTRIBUTED: StandaloneBackendMode

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ("ready", "deployment_mode", "supports_ranged_io")
    READY_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_MODE_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_RANGED_IO_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    deployment_mode: StandaloneBackendMode
    supports_ranged_io: bool
    def __init__(self, ready: _Optional[bool] = ..., deployment_mode: _Optional[_Union[StandaloneBackendMode, str]] = ..., supports_ranged_io: _Optional[bool] = ...) -> None: ...

class BoolResponse(_message.Message):
    __slots__ = ("ok", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class CountResponse(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class BatchKeysRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class BatchDataRequest(_message.Message):
    __slots__ = ("keys", "client_id", "shm_offsets", "sizes", "region_bases")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    REGION_BASES_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    client_id: str
    shm_offsets: _containers.RepeatedScalarFieldContainer[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    region_bases: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., client_id: _Optional[str] = ..., shm_offsets: _Optional[_Iterable[int]] = ..., sizes: _Optional[_Iterable[int]] = ..., region_bases: _Optional[_Iterable[int]] = ...) -> None: ...

class BatchDataWithDepthRequest(_message.Message):
    __slots__ = ("keys", "client_id", "shm_offsets", "sizes", "depths", "region_bases")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    DEPTHS_FIELD_NUMBER: _ClassVar[int]
    REGION_BASES_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    client_id: str
    shm_offsets: _containers.RepeatedScalarFieldContainer[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    depths: _containers.RepeatedScalarFieldContainer[int]
    region_bases: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., client_id: _Optional[str] = ..., shm_offsets: _Optional[_Iterable[int]] = ..., sizes: _Optional[_Iterable[int]] = ..., depths: _Optional[_Iterable[int]] = ..., region_bases: _Optional[_Iterable[int]] = ...) -> None: ...

class BatchBoolResponse(_message.Message):
    __slots__ = ("ok",)
    OK_FIELD_NUMBER: _ClassVar[int]
    ok: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, ok: _Optional[_Iterable[bool]] = ...) -> None: ...
