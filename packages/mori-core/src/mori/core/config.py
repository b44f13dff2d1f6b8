"""Every ``MORI_*`` environment variable, parsed in one place.

Values are read from the environment at the moment they are asked for, so a variable set before
``shmem_init`` (or changed by a test) takes effect there. A malformed value raises
:class:`ConfigError` naming the variable, the value and the accepted forms.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

__all__ = ["ConfigError", "Variable", "VARIABLES", "get", "parse_size", "parse_bool", "describe"]


class ConfigError(ValueError):
    """A ``MORI_*`` variable holds a value mori cannot use."""


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE | re.ASCII)
_SIZE_SHIFT = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40, "p": 50}
SIZE_FORMS = (
    "a byte count with an optional binary unit: 4096, 64K, 512M, 6G, 2GiB, 1.5G (K=2^10, M=2^20, G=2^30, T=2^40)"
)
_TRUE = {"1", "on", "true", "yes", "y"}
_FALSE = {"0", "off", "false", "no", "n", ""}
BOOL_FORMS = "1/0, ON/OFF, true/false, yes/no (any case)"


def parse_size(text: str, name: str = "size") -> int:
    """Parses a size such as ``6G``, ``512M``, ``2GiB`` or ``4096`` into bytes (binary units)."""
    m = _SIZE_RE.match(text)
    # "iB"/"i" need a unit before them ("5iB" is malformed; "5B" and "5KiB" are not).
    if m is None or (m.group(3).lower().startswith("i") and not m.group(2)):
        raise ConfigError(f"{name}={text!r} is not a size; expected {SIZE_FORMS}")
    number, unit = m.group(1), m.group(2).lower()
    # Exact arithmetic: a float would round large fractional sizes such as 2.003P.
    return math.floor(Fraction(number) * (1 << _SIZE_SHIFT[unit]))


def parse_bool(text: str, name: str = "flag") -> bool:
    """Parses an on/off flag."""
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ConfigError(f"{name}={text!r} is not a flag; expected {BOOL_FORMS}")


def _parse_seconds(text: str, name: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):  # an infinite timeout would let a wait hang forever
        raise ConfigError(f"{name}={text!r} is not a timeout; expected a positive number of seconds, e.g. 30 or 2.5")
    return value


def _choice(*options: str, aliases: dict[str, str] | None = None) -> Callable[[str, str], str]:
    """Parses one of ``options`` (any case); ``aliases`` maps other spellings onto them."""
    spellings = dict(aliases or {})

    def parse(text: str, name: str) -> str:
        low = text.strip().lower()
        low = spellings.get(low, low)
        if low not in options:
            raise ConfigError(f"{name}={text!r} is not accepted; expected one of: {', '.join([*options, *spellings])}")
        return low

    return parse


def _device_list(text: str, name: str) -> tuple[bool, tuple[str, ...]]:
    """``mlx5_0,mlx5_1`` selects; ``^mlx5_2,mlx5_3`` excludes. Returns (exclude, names)."""
    exclude = text.startswith("^")
    names = tuple(n.strip() for n in text.lstrip("^").split(",") if n.strip())
    if not names or any(not re.fullmatch(r"[\w.\-:]+", n) for n in names):
        raise ConfigError(f"{name}={text!r} is not a device list; expected 'mlx5_0,mlx5_1' or '^mlx5_2'")
    return exclude, names


def _transport_list(text: str, name: str) -> tuple[str, ...]:
    """``tcp,sm`` -> ("tcp", "sm"): UCX transport names."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names or any(not re.fullmatch(r"[a-z][a-z0-9_]*", n) for n in names):
        raise ConfigError(
            f"{name}={text!r} is not a transport list; expected UCX transport names such as "
            "'rc,dc,self' or 'tcp,sm,self'"
        )
    return names


def _positive_int(text: str, name: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError(f"{name}={text!r} is not accepted; expected a positive integer")
    return value


# Host names as resolvers accept them in practice: RFC 1123 labels, plus "_" (container names).
_HOSTNAME_RE = re.compile(r"^(?!-)[\w-]{1,63}(?<!-)(\.(?!-)[\w-]{1,63}(?<!-))*\.?$", re.ASCII)


def _host(text: str, name: str) -> str:
    """An IP address or a DNS host name; empty means unset."""
    host = text.strip()
    if host and not _HOSTNAME_RE.match(host):
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ConfigError(f"{name}={text!r} is not accepted; expected an IP address or a host name") from None
    return host


def _text(text: str, name: str) -> str:
    return text


@dataclass(frozen=True)
class Variable:
    """One environment variable: its parser, its default (used when unset) and what it does."""

    name: str
    parse: Callable[[str, str], Any]
    default: Any
    doc: str
    forms: str


def _size(text: str, name: str) -> int:
    return parse_size(text, name)


def _bool(text: str, name: str) -> bool:
    return parse_bool(text, name)


VARIABLES: dict[str, Variable] = {
    v.name: v
    for v in [
        Variable(
            "MORI_SHMEM_HEAP_SIZE", _size, 2 << 30, "Symmetric heap size per PE; set before shmem init.", SIZE_FORMS
        ),
        Variable(
            "MORI_SHMEM_MODE",
            _choice("static", "vmm", aliases={"static_heap": "static", "vmm_heap": "vmm"}),
            "static",
            "GPU heap mode: 'static' maps the whole heap at init, 'vmm' maps it in chunks as it grows.",
            "static | vmm (MORI's STATIC_HEAP | VMM_HEAP too, any case)",
        ),
        Variable("MORI_SHMEM_VMM_CHUNK_SIZE", _size, 512 << 20, "Granule by which a vmm heap grows.", SIZE_FORMS),
        Variable(
            "MORI_SHMEM_BACKEND",
            _choice("auto", "gpu", "cpu"),
            "auto",
            "Where the heap lives: 'gpu' (CUDA VMM), 'cpu' (host shared memory) or 'auto' (GPU when CUDA sees one).",
            "auto | gpu | cpu",
        ),
        Variable(
            "MORI_DISABLE_P2P",
            _bool,
            False,
            "Reach every peer through mori.shmem's remote transport, on one host too: peers' heaps are not "
            "mapped and shmem_ptr_p2p returns 0 for them.",
            BOOL_FORMS,
        ),
        Variable(
            "MORI_SHMEM_GPU_DIRECT",
            _bool,
            False,
            "GPU heap with remote PEs: let UCX move GPU memory itself (GPUDirect RDMA on a NIC) instead of "
            "staging it through pinned host memory in a CUDA context of mori's own.",
            BOOL_FORMS,
        ),
        Variable(
            "MORI_SHMEM_DEBUG",
            _bool,
            False,
            "Check at every shmem_malloc/shmem_free that all PEs make the same call (a collective "
            "each); shmem_barrier_all checks the whole history either way.",
            BOOL_FORMS,
        ),
        Variable(
            "MORI_SHMEM_UCX_WORKERS",
            _positive_int,
            None,
            "UCX workers of mori.shmem's remote transport, each with a native progress thread (a put or get "
            "of 512 KiB or more is spread over them); unset: mori.core.ucx.auto_workers() (2 on a machine of "
            "8 cores or more, else 1).",
            "a positive integer",
        ),
        Variable(
            "MORI_SHMEM_TIMEOUT",
            _parse_seconds,
            120.0,
            "Seconds a host-side shmem wait (shmem_wait_until), and a host call to a remote PE, wait before failing.",
            "seconds > 0",
        ),
        Variable(
            "MORI_RDMA_DEVICES",
            _device_list,
            None,
            "RDMA NIC selection: 'mlx5_0,mlx5_1' or '^mlx5_2'.",
            "'mlx5_0,mlx5_1' or '^mlx5_2,mlx5_3'",
        ),
        Variable(
            "MORI_NUM_QP_PER_PE",
            _positive_int,
            1,
            "MORI's RDMA queue pairs per PE; only reported back (shmem_num_qp_per_pe).",
            "a positive integer",
        ),
        Variable(
            "MORI_BOOTSTRAP_TIMEOUT",
            _parse_seconds,
            120.0,
            "Seconds a bootstrap collective waits for every rank before failing.",
            "seconds > 0",
        ),
        Variable(
            "MORI_BOOTSTRAP_HOST",
            _host,
            None,
            "Address rank 0 advertises in the unique id (default: the host's outward address).",
            "an IP address or a host name",
        ),
        Variable(
            "MORI_LOG_LEVEL",
            _choice("trace", "debug", "info", "warning", "error", "critical"),
            "warning",
            "Default log level of every mori logger.",
            "trace | debug | info | warning | error | critical",
        ),
        Variable(
            "MORI_CACHE_DIR", _text, None, "Where compiled device code is cached (default ~/.cache/mori).", "a path"
        ),
        Variable(
            "MORI_IO_AUTH_TOKEN",
            _text,
            None,
            "Shared secret every control and data connection must present.",
            "any string",
        ),
        Variable(
            "MORI_NODE_ID",
            _text,
            None,
            "This machine's identity in mori-io's EngineDesc.node_id (default: the kernel's boot id, "
            "else the hostname).",
            "any string",
        ),
        Variable(
            "MORI_IO_TIMEOUT", _parse_seconds, 30.0, "Seconds before an unanswered transfer fails.", "seconds > 0"
        ),
        Variable(
            "MORI_IO_MAX_CONNECTIONS",
            _positive_int,
            1024,
            "Connections an engine keeps open on each of its listening planes (control, TCP data); "
            "more are closed at accept.",
            "a positive integer",
        ),
        Variable(
            "MORI_IO_MAX_HANDSHAKES",
            _positive_int,
            64,
            "Connections per plane still in their hello; a new one drops the oldest.",
            "a positive integer",
        ),
        Variable(
            "MORI_IO_HELLO_TIMEOUT",
            _parse_seconds,
            10.0,
            "Seconds from accepting a connection to its complete hello.",
            "seconds > 0",
        ),
        Variable(
            "MORI_IO_IDLE_TIMEOUT",
            _parse_seconds,
            600.0,
            "Seconds an authenticated control connection may stay silent before it is closed (clients reconnect).",
            "seconds > 0",
        ),
        Variable(
            "MORI_IO_CONTROL_BUFFER",
            _size,
            64 << 20,
            "Bytes of control frames being received that an engine holds at once, over all connections.",
            SIZE_FORMS,
        ),
        Variable(
            "MORI_IO_MAX_INBOUND_RECORDS",
            _positive_int,
            100_000,
            "Completion records (pop_inbound_transfer_status) kept per engine, in one table every channel "
            "writes; the oldest is dropped first.",
            "a positive integer",
        ),
        Variable(
            "MORI_IO_INBOUND_RECORD_TTL",
            _parse_seconds,
            600.0,
            "Seconds a completion record is kept before it is dropped.",
            "seconds > 0",
        ),
        Variable(
            "MORI_IO_NVLINK_KERNEL_MAX",
            _size,
            1 << 20,
            "NVLink backend: blocks smaller than this go to the gather kernel, larger ones to the copy engines.",
            SIZE_FORMS,
        ),
        Variable(
            "MORI_STAGING_PROFILE",
            _text,
            None,
            "A file to which each process appends, at exit, one JSON line per GPU Stager it made "
            "(mori.core.staging.device_stager): its copies, bytes, copy and wait times (a profile of "
            "staged transfers).",
            "a path",
        ),
        Variable(
            "MORI_TRACE_DIR",
            _text,
            None,
            "A folder where each process records the steps of UCX transfers, remote atomics and signal "
            "puts with timestamps (read by mori-core's native code at its first step; ci/trace_report.py "
            "reads them).",
            "a path",
        ),
        Variable(
            "MORI_UCX_LIB",
            _text,
            None,
            "The UCX that mori.core.ucx loads: a libucp.so or its folder. Unset: a system UCX with verbs "
            "(its ucx/ folder holds libuct_ib), else the libucx wheel, else a system UCX without verbs.",
            "a path, e.g. /usr/lib/x86_64-linux-gnu or /opt/ucx/lib/libucp.so.0",
        ),
        Variable(
            "MORI_IO_RDMA_TRANSPORTS",
            _transport_list,
            None,
            "RDMA backend: the UCX transports it may use (UCX_TLS); unset: UCX's choice, and the backend "
            "refuses a host where UCX finds no RDMA NIC.",
            "'rc,dc,self', 'tcp,sm,self', 'tcp,cuda_copy'",
        ),
        Variable(
            "MORI_IO_RDMA_SAME_HOST",
            _bool,
            True,
            "RDMA backend: host memory between two engines of one host takes the UCX engine's same-host "
            "path (process_vm_readv/writev) instead of UCX's transports; 0 keeps it on UCX.",
            "1 or 0",
        ),
        Variable(
            "MORI_IO_SQ_BACKOFF_TIMEOUT_US",
            _positive_int,
            5_000_000,
            "RDMA backend: microseconds a transfer waits for room in a full send queue before it fails "
            "with 'SQ full' (MORI's setting and default).",
            "a positive integer (microseconds)",
        ),
        Variable(
            "MORI_IO_TCP_STAGING_SIZE",
            _size,
            256 << 20,
            "mori-io's GPU staging (TCP backend, and the RDMA backend where no transport has GPUDirect): "
            "pinned host memory kept between transfers, per device and process (more is lent while "
            "transfers need it, and freed when it comes back).",
            SIZE_FORMS,
        ),
        Variable(
            "MORI_SHMEM_BC",
            _text,
            None,
            "Path of libmori_shmem_device.bc to use instead of the packaged one.",
            "a path",
        ),
        # MORI-EP (mori.ops), read when an EpDispatchCombineOp is built.
        Variable(
            "MORI_EP_LAUNCH_CONFIG_MODE",
            _choice("manual", "auto"),
            "manual",
            "mori.ops launch geometry: 'manual' takes block_num/warp_per_block from the config and each "
            "call; 'auto' uses MORI's fallback geometry per kernel type and ignores the calls' values.",
            "MANUAL | AUTO (any case)",
        ),
        Variable(
            "MORI_FP8_COMBINE_SCALE_DIM",
            _positive_int,
            56,
            "Scales per token row of the blockwise combine quantizations (fp8_blockwise, fp4_blockwise): "
            "blocks of ceil(hidden / scale_dim) elements; 56 gives blocks of 128 at hidden 7168.",
            "a positive integer",
        ),
        Variable(
            "MORI_EP_COMM",
            _choice("shmem", "cco"),
            "shmem",
            "What holds mori.ops' symmetric buffers: 'shmem' (mori.shmem's heap); MORI's 'cco' (mori.cco "
            "LSA windows) is not provided and is refused when an op is built.",
            "shmem | cco",
        ),
        Variable(
            "MORI_ENABLE_SDMA",
            _bool,
            False,
            "MORI's copy-engine (SDMA) path for AsyncLL's transfers. NVIDIA has no SDMA engines: mori.ops "
            "accepts the flag and its kernels move the data either way (docs/ops.md, 'Settings').",
            BOOL_FORMS,
        ),
    ]
}


def get(name: str) -> Any:
    """Returns the parsed value of ``name`` from the environment, or its default when unset."""
    try:
        var = VARIABLES[name]
    except KeyError:
        raise KeyError(f"{name} is not a mori variable; known: {', '.join(sorted(VARIABLES))}") from None
    raw = os.environ.get(name)
    if raw is None:
        return var.default
    return var.parse(raw, name)


def describe() -> str:
    """A table of every variable, its current value and what it does (for docs and ``--help``)."""
    rows = []
    for var in VARIABLES.values():
        rows.append(f"{var.name:28} {os.environ.get(var.name, '(unset)')!s:12} {var.doc}")
    return "\n".join(rows)
