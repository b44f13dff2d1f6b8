"""NVRTC compilation to PTX and cubin, with the on-disk cache (no GPU needed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mori.core import nvrtc
from mori.core.testing import run_procs

KERNEL = r"""
extern "C" __global__ void scale(float* out, const float* in, float factor, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = in[i] * factor;
}
"""


@pytest.fixture(autouse=True)
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MORI_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _cached_files(root: Path) -> list[Path]:
    return sorted((root / "nvrtc").glob("*"))


def test_compiles_ptx_for_the_requested_arch() -> None:
    for arch in ("sm_90", "sm_80", "compute_90"):
        ptx = nvrtc.compile(KERNEL, name="scale.cu", arch=arch).decode()
        assert re.search(rf"^\.target {arch.replace('compute', 'sm')}\b", ptx, re.M), ptx[:400]
        assert ".visible .entry scale(" in ptx
        assert "mul.f32" in ptx and "\0" not in ptx


def test_a_clean_compile_leaves_python_constants_alone() -> None:
    """A kernel with no diagnostics has a log of one NUL byte: NVRTC writes it into a buffer of
    ours, never into CPython's shared one-byte ``b" "`` (which once turned every b" " of the
    process into b"\\0", and broke later code splitting on spaces)."""
    space = bytes([32])
    nvrtc.compile(KERNEL + "\n// clean log\n", arch="sm_90", output="cubin")
    nvrtc.compile(KERNEL + "\n// clean log, ptx\n", arch="sm_90")
    assert space == b" " and b"a b".split(b" ") == [b"a", b"b"]
    assert " ".join(["a", "b"]) == "a b"


def test_second_compile_is_a_cache_hit_and_options_change_the_key(cache_root: Path) -> None:
    before = nvrtc.cache_info()
    first = nvrtc.compile(KERNEL)
    after_first = nvrtc.cache_info()
    assert after_first.misses == before.misses + 1 and after_first.directory == cache_root / "nvrtc"
    (entry,) = _cached_files(cache_root)
    assert entry.suffix == ".ptx" and entry.read_bytes() == first
    second = nvrtc.compile(KERNEL)
    after_second = nvrtc.cache_info()
    assert second == first
    assert (after_second.hits, after_second.misses) == (after_first.hits + 1, after_first.misses)
    nvrtc.compile(KERNEL, options=["-DUNUSED=1"])
    nvrtc.compile(KERNEL, arch="sm_80")
    nvrtc.compile(KERNEL + "\n// a comment\n")
    assert nvrtc.cache_info().misses == after_second.misses + 3
    assert len(_cached_files(cache_root)) == 4
    assert not [p for p in _cached_files(cache_root) if p.name.endswith(".tmp")]


def test_a_changed_header_recompiles(tmp_path: Path) -> None:
    inc = tmp_path / "inc"
    inc.mkdir()
    header = inc / "factor.cuh"
    source = '#include "factor.cuh"\nextern "C" __global__ void put(int* p) { *p = MAGIC; }\n'
    header.write_text("#define MAGIC 123457\n")
    assert "123457" in nvrtc.compile(source, options=[f"-I{inc}"]).decode()
    header.write_text("#define MAGIC 765431\n")
    misses = nvrtc.cache_info().misses
    assert "765431" in nvrtc.compile(source, options=["-I", str(inc)]).decode()
    assert nvrtc.cache_info().misses == misses + 1


def test_mori_device_headers_are_on_the_include_path() -> None:
    inc = nvrtc.device_include_dir()
    assert (inc / "mori" / "device" / "shmem.cuh").is_file()
    source = r"""
#define MORI_DEVICE_DEFINE_STATE
#include <mori/device/shmem.cuh>
extern "C" __global__ void who(int* out) { out[0] = mori::device::ShmemMyPe(); out[1] = mori::device::ShmemNPes(); }
"""
    ptx = nvrtc.compile(source, name="who.cu", options=["-rdc=true"]).decode()
    assert ".visible .entry who(" in ptx
    assert re.search(r"\.visible \.global \.align \d+ \.b8 globalGpuStates\[64\]", ptx), "state not emitted"


def test_cubin_output_is_an_elf_for_sm_arch() -> None:
    cubin = nvrtc.compile(KERNEL, arch="sm_90", output="cubin")
    assert cubin[:4] == b"\x7fELF" and b"scale" in cubin
    with pytest.raises(ValueError, match="real architecture"):
        nvrtc.compile(KERNEL, arch="compute_90", output="cubin")


def test_compile_errors_carry_the_nvrtc_log(cache_root: Path) -> None:
    source = 'extern "C" __global__ void broken(int* p) {\n  *p = undefined_thing;\n}\n'
    with pytest.raises(nvrtc.NvrtcError) as info:
        nvrtc.compile(source, name="broken.cu")
    message = str(info.value)
    assert "broken.cu(2)" in message and "undefined_thing" in message and "sm_90" in message
    assert "undefined_thing" in info.value.log
    assert _cached_files(cache_root) == []


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"arch": "90"}, ValueError, "arch='90'"),
        ({"arch": "sm_9"}, ValueError, "arch="),
        ({"output": "sass"}, ValueError, "output='sass'"),
        ({"options": "-O3"}, TypeError, "sequence of strings"),
        ({"options": [b"-O3"]}, TypeError, "must be strings"),
        ({"options": ["-arch=sm_80"]}, ValueError, "arch=..."),
        ({"name": ""}, ValueError, "name"),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict, error: type, match: str, cache_root: Path) -> None:
    with pytest.raises(error, match=re.escape(match)):
        nvrtc.compile(KERNEL, **kwargs)
    assert _cached_files(cache_root) == []


def test_a_corrupt_empty_cache_entry_is_recompiled(cache_root: Path) -> None:
    good = nvrtc.compile(KERNEL)
    (entry,) = _cached_files(cache_root)
    entry.write_bytes(b"")
    assert nvrtc.compile(KERNEL) == good and entry.read_bytes() == good


def test_default_cache_dir_is_under_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MORI_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert nvrtc.cache_dir() == tmp_path / ".cache" / "mori" / "nvrtc"


def _compile_in_child(cache: str, tag: int) -> bytes:
    import os

    os.environ["MORI_CACHE_DIR"] = cache
    return nvrtc.compile(KERNEL + f"\n// shared {tag}\n")


def test_concurrent_compiles_share_one_cache_entry(cache_root: Path) -> None:
    results = run_procs(_compile_in_child, [(str(cache_root), 1)] * 3)
    assert results[0] == results[1] == results[2] and b".entry scale" in results[0]
    (entry,) = _cached_files(cache_root)
    assert entry.read_bytes() == results[0]


def test_nvrtc_version_is_reported() -> None:
    major, minor = nvrtc.version()
    assert major >= 12 and minor >= 0
