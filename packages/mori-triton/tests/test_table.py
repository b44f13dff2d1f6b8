"""One table, three views: the table, the generated wrapper file and the bitcode agree exactly."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mori.ir
import mori.ir.triton
from mori.triton import DEVICE_FUNCTIONS, BitcodeError, build_bitcode, find_bitcode, shmem
from mori.triton._bitcode import bundled_bitcode, defined_functions, input_digest
from mori.triton._gen import WRAPPER_PATH, generated_files, main
from mori.triton._table import TYPES, by_name

_LLVM = {"i32": "i32", "u32": "i32", "i64": "i64", "u64": "i64", "f32": "float", "f64": "double", "ptr": "i64"}
_WRAPPER_RE = re.compile(r"^MORI_WRAPPER (\w+) (mori_shmem_\w+)\(([^)]*)\) \{", re.MULTILINE)


def _table_view():
    return {f.symbol: (TYPES[f.ret], tuple(TYPES[t] for _, t in f.args)) for f in DEVICE_FUNCTIONS}


def test_generated_files_are_current():
    stale = [str(p) for p, text in generated_files().items() if not p.exists() or p.read_text() != text]
    assert not stale, f"run python -m mori.triton._gen: {stale}"
    assert main(["--check"]) == 0


def test_wrapper_file_declares_exactly_the_table():
    found = {}
    for ret, symbol, params in _WRAPPER_RE.findall(WRAPPER_PATH.read_text()):
        types = () if params == "void" else tuple(p.rsplit(" ", 1)[0] for p in params.split(", "))
        assert symbol not in found, f"{symbol} defined twice"
        found[symbol] = (ret, types)
    assert found == _table_view()


def test_bitcode_defines_exactly_the_table_with_matching_llvm_types():
    defined = defined_functions(bundled_bitcode())
    expected = {f.symbol: (_LLVM[f.ret], tuple(_LLVM[t] for _, t in f.args)) for f in DEVICE_FUNCTIONS}
    assert {k: v for k, v in defined.items() if k.startswith("mori_shmem_")} == expected
    # Anything else is one of the device API's out-of-line C++ helpers, never an extra C symbol.
    others = set(defined) - set(expected)
    assert all(k.startswith("_ZN4mori6device") for k in others), f"unexpected definitions: {others}"


def test_bitcode_defines_global_gpu_states():
    text = subprocess.run(
        ["llvm-dis-19", str(bundled_bitcode()), "-o", "-"], capture_output=True, text=True, check=True
    ).stdout
    assert re.search(r"^@globalGpuStates = .*addrspace\(1\).* global %\S+ zeroinitializer", text, re.MULTILINE)
    # and the hot paths' constant-memory mirror, which shmem_module_init writes too
    assert re.search(
        r"^@globalGpuStatesFast = .*addrspace\(4\).* (global|constant) %\S+ zeroinitializer", text, re.MULTILINE
    )


def test_committed_bitcode_is_up_to_date_with_headers_and_wrappers():
    sidecar = json.loads(bundled_bitcode().with_suffix(".json").read_text())
    assert sidecar["input_sha256"] == input_digest(), (
        "device headers or wrappers changed since the bitcode was built: run python -m mori.triton._bitcode"
    )
    assert set(sidecar["functions"]) == {f.symbol for f in DEVICE_FUNCTIONS}


@pytest.mark.slow
def test_rebuilding_gives_the_same_functions(tmp_path):
    """Through the command docs/triton.md gives, from wherever mori-triton is installed (CI runs these
    tests from an installed wheel too: ci/newest.sh)."""
    out = tmp_path / "rebuilt.bc"
    done = subprocess.run(
        [sys.executable, "-m", "mori.triton._bitcode", "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"wrote {out}"
    assert defined_functions(out) == defined_functions(bundled_bitcode())
    rebuilt = json.loads(out.with_suffix(".json").read_text())
    committed = json.loads(bundled_bitcode().with_suffix(".json").read_text())
    assert rebuilt["input_sha256"] == committed["input_sha256"]
    assert rebuilt["functions"] == committed["functions"]


def test_build_rejects_bad_arch(tmp_path):
    with pytest.raises(BitcodeError, match="not a CUDA arch"):
        build_bitcode(tmp_path / "x.bc", arch="gfx942")
    assert not (tmp_path / "x.bc").exists()


def test_find_bitcode_honours_override(tmp_path, monkeypatch):
    assert find_bitcode() == str(bundled_bitcode())
    mine = tmp_path / "mine.bc"
    mine.write_bytes(bundled_bitcode().read_bytes())
    monkeypatch.setenv("MORI_SHMEM_BC", str(mine))
    assert find_bitcode() == str(mine)
    monkeypatch.setenv("MORI_SHMEM_BC", str(tmp_path / "missing.bc"))
    with pytest.raises(BitcodeError, match="MORI_SHMEM_BC"):
        find_bitcode()


def test_every_row_is_an_extern_of_both_spellings():
    for f in DEVICE_FUNCTIONS:
        assert getattr(shmem, f.name).__triton_builtin__
        assert getattr(mori.ir.triton, f.name) is getattr(shmem, f.name)
        assert f.name in shmem.__all__
    assert (shmem.SIGNAL_SET, shmem.SIGNAL_ADD) == (mori.ir.SIGNAL_SET, mori.ir.SIGNAL_ADD) == (9, 10)


def test_mori_view_of_the_table():
    view = mori.ir.MORI_DEVICE_FUNCTIONS
    assert view["putmem_nbi_signal_block"] == {
        "symbol": "mori_shmem_putmem_nbi_signal_block",
        "args": ["uint64", "uint64", "uint64", "uint64", "uint64", "int32", "int32", "int32"],
        "ret": "int32",
        "pure": False,
    }
    assert view["my_pe"]["args"] == [] and view["ptr_p2p"]["ret"] == "uint64"
    assert len(view) == len(DEVICE_FUNCTIONS)


def test_mori_names_are_present():
    # The symbols MORI's kernels and the seed use.
    for name in (
        "my_pe",
        "n_pes",
        "ptr_p2p",
        "putmem_nbi_block",
        "putmem_nbi_signal_block",
        "getmem_nbi_thread",
        "uint64_wait_until_equals",
        "quiet_thread",
        "barrier_all_block",
        "int32_p",
        "put_uint32_nbi_warp",
        "get_double_block",
        "uint64_atomic_fetch_add_thread",
        "int64_wait_until_greater_than",
    ):
        assert by_name(name).symbol == f"mori_shmem_{name}"
    with pytest.raises(KeyError, match="not a mori device function"):
        by_name("nope")


def test_moris_generic_atomics_and_immediate_put():
    """The entries of MORI's MORI_DEVICE_FUNCTIONS that take MORI's atomicType or a byte count,
    with MORI's argument and return types."""
    view = mori.ir.MORI_DEVICE_FUNCTIONS
    for t in ("uint32", "uint64", "int64"):
        assert view[f"atomic_{t}_nonfetch_thread"] == {
            "symbol": f"mori_shmem_atomic_{t}_nonfetch_thread",
            "args": ["uint64", t, "int32", "int32", "int32"],
            "ret": "int32",
            "pure": False,
        }
        assert view[f"atomic_{t}_fetch_thread"] == {
            "symbol": f"mori_shmem_atomic_{t}_fetch_thread",
            "args": ["uint64", t, t, "int32", "int32", "int32"],
            "ret": t,
            "pure": False,
        }
    assert view["atomic_size_nonfetch_thread"]["args"] == ["uint64", "uint64", "uint64", "int32", "int32", "int32"]
    assert view["put_size_imm_nbi_thread"]["args"] == ["uint64", "uint64", "uint64", "int32", "int32"]


def test_bitcode_path_as_mori_asks_for_it():
    path = str(bundled_bitcode())
    assert mori.ir.find_bitcode() == mori.ir.get_bitcode_path() == path
    assert mori.ir.find_bitcode(cov=5) == mori.ir.get_bitcode_path(cov=6) == find_bitcode(arch="sm_90") == path
    for bad in (0, "5", True):
        with pytest.raises(ValueError, match="cov must be"):
            mori.ir.find_bitcode(cov=bad)


def test_wheel_ships_the_bitcode_and_what_rebuilds_it(tmp_path):
    import zipfile

    package_dir = Path(__file__).resolve().parents[1]  # packages/mori-triton, beside these tests
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(package_dir),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("mori_triton-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {
        "mori/triton/lib/libmori_shmem_device.bc",
        "mori/triton/lib/libmori_shmem_device.json",
        "mori/ir/triton/__init__.py",
        "mori/triton/csrc/mori_shmem_wrappers.cu",
    } <= names
