"""Run-time compilation of CUDA device code with NVRTC, cached on disk.

``compile(source)`` turns CUDA C++ into PTX or a cubin for one architecture, with mori's device
headers (``mori/device/*.cuh``) on the include path. NVRTC needs no GPU, so this works (and is
tested) on CPU-only machines.

Results are cached under ``$MORI_CACHE_DIR/nvrtc`` (default ``~/.cache/mori/nvrtc``). The key is
the SHA-256 of the source, name, arch, options, output kind, NVRTC's version and the content of
every header in the include directories, so editing a header recompiles what includes it. Cache
files are written to a temporary name and renamed, so concurrent compilers never see a torn file.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from . import config
from . import cuda as _cuda
from .log import get_logger

__all__ = ["NvrtcError", "CacheInfo", "compile", "cache_dir", "cache_info", "device_include_dir", "version"]

_log = get_logger("core.nvrtc")
_ARCH_RE = re.compile(r"^(sm|compute)_(\d{2,3})([af]?)$")
_OUTPUTS = ("ptx", "cubin")
_HEADER_SUFFIXES = {".h", ".hpp", ".cuh", ".hh", ".inc", ".inl"}


class NvrtcError(RuntimeError):
    """NVRTC rejected the source; ``log`` holds the compiler's messages."""

    def __init__(self, name: str, arch: str, log: str):
        self.log = log
        super().__init__(f"NVRTC failed to compile {name} for {arch}:\n{log.strip()}")


@dataclass(frozen=True)
class CacheInfo:
    """Cache statistics of this process: ``hits``, ``misses`` and the cache ``directory``."""

    hits: int
    misses: int
    directory: Path


_stats = {"hits": 0, "misses": 0}
_stats_lock = threading.Lock()


def device_include_dir() -> Path:
    """The directory that holds ``mori/device/*.cuh``: inside the wheel, or ``packages/mori-core/include``
    in an editable install."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "include", here.parents[2] / "include"):
        if (candidate / "mori" / "device").is_dir():
            return candidate
    raise FileNotFoundError(
        f"mori's device headers (mori/device/*.cuh) are missing: looked in {here / 'include'} (wheel) "
        f"and {here.parents[2] / 'include'} (source tree); reinstall mori-core"
    )


def cache_dir() -> Path:
    """Where compiled device code is kept: ``$MORI_CACHE_DIR/nvrtc`` or ``~/.cache/mori/nvrtc``."""
    root = config.get("MORI_CACHE_DIR")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "mori") / "nvrtc"


def cache_info() -> CacheInfo:
    """How many :func:`compile` calls of this process were served from the cache, and how many compiled."""
    with _stats_lock:
        return CacheInfo(_stats["hits"], _stats["misses"], cache_dir())


def version() -> tuple[int, int]:
    """NVRTC's (major, minor) version."""
    major, minor = _cuda.check(_cuda.nvrtc().nvrtcVersion(), "nvrtcVersion")
    return int(major), int(minor)


def _include_dirs(options: Sequence[str]) -> list[Path]:
    """Include directories named in ``options`` (``-I dir``, ``-Idir``, ``--include-path=dir``)."""
    dirs, it = [], iter(options)
    for opt in it:
        if opt in ("-I", "--include-path"):
            dirs.append(Path(next(it, "")))
        elif opt.startswith("--include-path="):
            dirs.append(Path(opt.split("=", 1)[1]))
        elif opt.startswith("-I"):
            dirs.append(Path(opt[2:]))
    return dirs


def _hash_headers(h: hashlib._Hash, dirs: Iterable[Path]) -> None:
    for d in dirs:
        if not d.is_dir():
            continue
        for path in sorted(p for p in d.rglob("*") if p.suffix in _HEADER_SUFFIXES and p.is_file()):
            h.update(str(path.relative_to(d)).encode() + b"\0")
            h.update(path.read_bytes())
            h.update(b"\0")


def _cache_key(source: str, name: str, arch: str, options: Sequence[str], output: str, dirs: list[Path]) -> str:
    h = hashlib.sha256()
    for part in (source, name, arch, output, "\0".join(options), ".".join(map(str, version()))):
        h.update(part.encode() + b"\0\0")
    _hash_headers(h, dirs)
    return h.hexdigest()


def _validate(source: str, name: str, arch: str, options: Sequence[str], output: str) -> tuple[str, ...]:
    if not isinstance(source, str):
        raise TypeError(f"nvrtc.compile: source must be a str, got {type(source).__name__}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"nvrtc.compile: name must be a non-empty str, got {name!r}")
    m = _ARCH_RE.match(arch) if isinstance(arch, str) else None
    if m is None:
        raise ValueError(f"nvrtc.compile: arch={arch!r} is not a CUDA architecture such as 'sm_90' or 'compute_90a'")
    if output not in _OUTPUTS:
        raise ValueError(f"nvrtc.compile: output={output!r}; expected one of {', '.join(_OUTPUTS)}")
    if output == "cubin" and m.group(1) != "sm":
        raise ValueError(f"nvrtc.compile: a cubin needs a real architecture (sm_XX), got {arch!r}")
    if isinstance(options, str):
        raise TypeError("nvrtc.compile: options must be a sequence of strings, not one string")
    opts = tuple(options)
    bad = [o for o in opts if not isinstance(o, str)]
    if bad:
        raise TypeError(f"nvrtc.compile: options must be strings, got {bad!r}")
    if any(o.startswith(("-arch", "--gpu-architecture")) for o in opts):
        raise ValueError("nvrtc.compile: give the architecture as arch=..., not in options")
    return opts


def _run_nvrtc(source: str, name: str, arch: str, options: Sequence[str], output: str) -> bytes:
    nv = _cuda.nvrtc()
    prog = _cuda.check(nv.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in options)]
        (result,) = nv.nvrtcCompileProgram(prog, len(opts), opts)
        log_size = _cuda.check(nv.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        # NVRTC writes into the buffers it is given: always a fresh bytearray, never ``b" " * n``,
        # which for n == 1 is CPython's shared one-byte ``b" "`` (a log of one NUL turned every
        # b" " of the process into b"\0").
        log = bytearray(log_size)
        _cuda.check(nv.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
        log_text = bytes(log).rstrip(b"\0").decode(errors="replace")
        if int(result) != 0:
            raise NvrtcError(name, arch, log_text)
        if log_text.strip():
            _log.debug("NVRTC messages for %s:\n%s", name, log_text)
        if output == "ptx":
            size = _cuda.check(nv.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
            buf = bytearray(size)
            _cuda.check(nv.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
            return bytes(buf).rstrip(b"\0")
        size = _cuda.check(nv.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        buf = bytearray(size)
        _cuda.check(nv.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
        return bytes(buf)
    finally:
        nv.nvrtcDestroyProgram(prog)


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def compile(
    source: str,
    name: str = "kernel.cu",
    arch: str = "sm_90",
    options: Sequence[str] = (),
    output: str = "ptx",
) -> bytes:
    """Compiles CUDA C++ ``source`` to PTX (``output="ptx"``) or a cubin (``"cubin"``) for ``arch``.

    mori's device headers are on the include path (``#include <mori/device/shmem.cuh>``), and
    ``-std=c++17`` is the dialect unless ``options`` name one; ``options`` are passed to NVRTC after those. Raises
    :class:`NvrtcError` with the compiler log when the source does not compile. The result is
    cached on disk (see the module documentation); a cache that cannot be written only logs.
    """
    opts = _validate(source, name, arch, options, output)
    include = device_include_dir()
    dialect = () if any(o.startswith(("-std", "--std")) for o in opts) else ("-std=c++17",)
    full = (f"-I{include}", *dialect, *opts)
    key = _cache_key(source, name, arch, full, output, [include, *_include_dirs(opts)])
    path = cache_dir() / f"{key}.{output}"
    try:
        data = path.read_bytes()
    except OSError:
        data = b""
    if data:
        with _stats_lock:
            _stats["hits"] += 1
        return data
    data = _run_nvrtc(source, name, arch, full, output)
    with _stats_lock:
        _stats["misses"] += 1
    try:
        _write_atomically(path, data)
    except OSError as err:
        _log.warning("nvrtc: could not cache %s in %s: %s", name, path.parent, err)
    return data
