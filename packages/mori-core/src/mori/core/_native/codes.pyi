# mori.core._native.codes (csrc/base/codes_bindings.cpp): the native planes' one table of codes.
TRANSFER_CODES: dict[str, int]
OPS: dict[str, int]
ATOMIC_OPS: dict[str, int]
REASONS: dict[int, str]
