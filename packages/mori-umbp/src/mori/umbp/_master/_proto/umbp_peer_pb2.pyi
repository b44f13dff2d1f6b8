from mori.umbp._master._proto import umbp_pb2 as _umbp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AllocateSlotOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ALLOCATE_SLOT_OUTCOME_UNSPECIFIED: _ClassVar[AllocateSlotOutcome]
    ALLOCATE_SLOT_OUTCOME_SUCCESS_ALLOCATED: _ClassVar[AllocateSlotOutcome]
    ALLOCATE_SLOT_OUTCOME_SUCCESS_ALREADY_EXISTS: _ClassVar[AllocateSlotOutcome]
    ALLOCATE_SLOT_OUTCOME_FAILED: _ClassVar[AllocateSlotOutcome]
    ALLOCATE_SLOT_OUTCOME_FAILED_NO_SPACE: _ClassVar[AllocateSlotOutcome]
ALLOCATE_SLOT_OUTCOME_UNSPECIFIED: AllocateSlotOutcome
ALLOCATE_SLOT_OUTCOME_SUCCESS_ALLOCATED: AllocateSlotOutcome
ALLOCATE_SLOT_OUTCOME_SUCCESS_ALREADY_EXISTS: AllocateSlotOutcome
ALLOCATE_SLOT_OUTCOME_FAILED: AllocateSlotOutcome
ALLOCATE_SLOT_OUTCOME_FAILED_NO_SPACE: AllocateSlotOutcome

class GetPeerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPeerInfoResponse(_message.Message):
    __slots__ = ("engine_desc", "page_size", "buffer_desc", "buffer_size")
    ENGINE_DESC_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    BUFFER_DESC_FIELD_NUMBER: _ClassVar[int]
    BUFFER_SIZE_FIELD_NUMBER: _ClassVar[int]
    engine_desc: bytes
    page_size: int
    buffer_desc: bytes
    buffer_size: int
    def __init__(self, engine_desc: _Optional[bytes] = ..., page_size: _Optional[int] = ..., buffer_desc: _Optional[bytes] = ..., buffer_size: _Optional[int] = ...) -> None: ...

class AllocateSlotRequest(_message.Message):
    __slots__ = ("size", "tier", "key", "depth")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    size: int
    tier: _umbp_pb2.TierType
    key: str
    depth: int
    def __init__(self, size: _Optional[int] = ..., tier: _Optional[_Union[_umbp_pb2.TierType, str]] = ..., key: _Optional[str] = ..., depth: _Optional[int] = ...) -> None: ...

class AllocateSlotResponse(_message.Message):
    __slots__ = ("outcome", "slot_id", "page_size", "pending_ttl_ms", "offset")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PENDING_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    outcome: AllocateSlotOutcome
    slot_id: int
    page_size: int
    pending_ttl_ms: int
    offset: int
    def __init__(self, outcome: _Optional[_Union[AllocateSlotOutcome, str]] = ..., slot_id: _Optional[int] = ..., page_size: _Optional[int] = ..., pending_ttl_ms: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class BatchAllocateSlotsRequest(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[AllocateSlotRequest]
    def __init__(self, entries: _Optional[_Iterable[_Union[AllocateSlotRequest, _Mapping]]] = ...) -> None: ...

class BatchAllocateSlotsResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[AllocateSlotResponse]
    def __init__(self, entries: _Optional[_Iterable[_Union[AllocateSlotResponse, _Mapping]]] = ...) -> None: ...

class BatchCommitSlotEntry(_message.Message):
    __slots__ = ("slot_id", "key")
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    slot_id: int
    key: str
    def __init__(self, slot_id: _Optional[int] = ..., key: _Optional[str] = ...) -> None: ...

class BatchCommitSlotsRequest(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[BatchCommitSlotEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[BatchCommitSlotEntry, _Mapping]]] = ...) -> None: ...

class BatchCommitSlotsResponse(_message.Message):
    __slots__ = ("success",)
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    success: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, success: _Optional[_Iterable[bool]] = ...) -> None: ...

class BatchAbortSlotsRequest(_message.Message):
    __slots__ = ("slot_ids",)
    SLOT_IDS_FIELD_NUMBER: _ClassVar[int]
    slot_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, slot_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BatchAbortSlotsResponse(_message.Message):
    __slots__ = ("success",)
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    success: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, success: _Optional[_Iterable[bool]] = ...) -> None: ...

class BatchResolveKeysRequest(_message.Message):
    __slots__ = ("keys", "inline_max_bytes")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    INLINE_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    inline_max_bytes: int
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., inline_max_bytes: _Optional[int] = ...) -> None: ...

class BatchResolveKeysResponse(_message.Message):
    __slots__ = ("page_size", "found", "tier", "size", "offset", "lease_id", "lease_ms", "inline_pages")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    INLINE_PAGES_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    found: _containers.RepeatedScalarFieldContainer[bool]
    tier: _containers.RepeatedScalarFieldContainer[_umbp_pb2.TierType]
    size: _containers.RepeatedScalarFieldContainer[int]
    offset: _containers.RepeatedScalarFieldContainer[int]
    lease_id: _containers.RepeatedScalarFieldContainer[int]
    lease_ms: int
    inline_pages: bytes
    def __init__(self, page_size: _Optional[int] = ..., found: _Optional[_Iterable[bool]] = ..., tier: _Optional[_Iterable[_Union[_umbp_pb2.TierType, str]]] = ..., size: _Optional[_Iterable[int]] = ..., offset: _Optional[_Iterable[int]] = ..., lease_id: _Optional[_Iterable[int]] = ..., lease_ms: _Optional[int] = ..., inline_pages: _Optional[bytes] = ...) -> None: ...

class BatchReleaseKeysRequest(_message.Message):
    __slots__ = ("keys", "lease_id")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    lease_id: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., lease_id: _Optional[_Iterable[int]] = ...) -> None: ...

class BatchReleaseKeysResponse(_message.Message):
    __slots__ = ("held",)
    HELD_FIELD_NUMBER: _ClassVar[int]
    held: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, held: _Optional[_Iterable[bool]] = ...) -> None: ...

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
