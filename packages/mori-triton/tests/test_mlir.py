"""The MLIR path (mori.triton.mlir): the seed's kernels and the whole device-function table compile
to sm_90 PTX with every mori_shmem_* call inlined; malformed modules fail with a named reason."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from mori.triton import DEVICE_FUNCTIONS, BitcodeError
from mori.triton.mlir import KERNELS, call, check_module, compile_mlir, declare, function_type, kernel

STATE_RE = re.compile(r"^\.visible \.global \.align \d+ \.b8 globalGpuStates\[64\];", re.MULTILINE)
CALL_RE = re.compile(r"^\s*call[^;]*mori_shmem_", re.MULTILINE)


def _check_ptx(ptx: str, name: str) -> None:
    assert re.search(r"^\.target sm_90\b", ptx, re.MULTILINE)
    assert f".visible .entry {name}(" in ptx
    assert STATE_RE.search(ptx), "globalGpuStates must stay a visible global (shmem_module_init writes it)"
    assert not CALL_RE.search(ptx), "every mori_shmem_* call must be inlined"


def test_cli_writes_the_seed_kernels(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mori.triton.mlir", "--arch", "sm_90", "--out", str(tmp_path), "--cubin"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{name}{suffix}" for name in KERNELS for suffix in (".ptx", ".cubin")
    )
    for name in KERNELS:
        _check_ptx((tmp_path / f"{name}.ptx").read_text(), name)
        assert (tmp_path / f"{name}.cubin").read_bytes()[:4] == b"\x7fELF"
    put = (tmp_path / "shmem_put_kernel.ptx").read_text()
    assert re.search(r"^\s*st(\.global)?\.b32\s+\[", put, re.MULTILINE)  # the inlined 4-byte P2P store


def _every_function_module():
    """One kernel calling every function of the table once, pointers from the kernel's argument."""
    from mlir import ir
    from mlir.dialects import llvm

    constants = {"i32": 32, "u32": 32, "i64": 64, "u64": 64}
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            for f in DEVICE_FUNCTIONS:
                declare(f.name)
            _, entry = kernel("every_function", ["!llvm.ptr"])
            with ir.InsertionPoint(entry):
                values = {}
                for t, bits in constants.items():
                    values[t] = llvm.mlir_constant(ir.IntegerAttr.get(ir.IntegerType.get_signless(bits), 0))
                values["f32"] = llvm.mlir_constant(ir.FloatAttr.get(ir.F32Type.get(), 1.5))
                values["f64"] = llvm.mlir_constant(ir.FloatAttr.get(ir.F64Type.get(), 2.5))
                values["ptr"] = entry.arguments[0]
                for f in DEVICE_FUNCTIONS:
                    call(f.name, *(values[t] for _, t in f.args))
                llvm.return_()
        return module


def test_every_device_function_declares_calls_and_inlines():
    module = _every_function_module()
    assert check_module(module) == ["every_function"]
    text = str(module)
    for f in DEVICE_FUNCTIONS:
        assert f"llvm.func @{f.symbol}(" in text
    ptx, cubin = compile_mlir(module)
    _check_ptx(ptx, "every_function")
    assert cubin[:4] == b"\x7fELF"


def test_compile_accepts_module_text():
    ptx, _ = compile_mlir(str(KERNELS["shmem_basic_kernel"]()))
    _check_ptx(ptx, "shmem_basic_kernel")


_BASIC = """module {
  llvm.func @mori_shmem_my_pe() -> i32 attributes {sym_visibility = "private"}
  llvm.func @k(%arg0: !llvm.ptr) attributes {nvvm.kernel} {
    %0 = llvm.call @mori_shmem_my_pe() : () -> i32
    llvm.store %0, %arg0 : i32, !llvm.ptr
    llvm.return
  }
}"""


_DECLS = '  llvm.func @mori_shmem_my_pe() -> i32 attributes {sym_visibility = "private"}\n'


def _with_decl(line: str) -> str:
    return _BASIC.replace(_DECLS, _DECLS + f'  llvm.func {line} attributes {{sym_visibility = "private"}}\n')


@pytest.mark.parametrize(
    "text, reason",
    [
        (_BASIC.replace("llvm.return\n", ""), "(?s)does not parse.*block with no terminator"),
        # the parser verifies: a type mismatch, a call of an undeclared function
        (_BASIC.replace("%arg0 : i32", "%arg0 : i64"), "(?s)does not parse.*expects different type than prior uses"),
        (
            _BASIC.replace("@mori_shmem_my_pe() :", "@mori_shmem_n_pes() :"),
            "(?s)does not parse.*'mori_shmem_n_pes' does not reference a symbol",
        ),
        # the seed's AMD declarations (void result, ptr arguments) do not match mori's ABI
        (
            _with_decl("@mori_shmem_quiet_thread()"),
            r"mori_shmem_quiet_thread is declared !llvm.func<void \(\)>, the device library defines !llvm.func<i32 \(\)>",
        ),
        (
            _with_decl("@mori_shmem_int32_p(!llvm.ptr, i32, i32, i32)"),
            r"(?s)mori_shmem_int32_p is declared !llvm.func<void \(ptr, i32, i32, i32\)>.*pointers cross as i64",
        ),
        (_with_decl("@mori_shmem_no_such() -> i32"), "mori_shmem_no_such is not a function of the device library"),
        (_BASIC.replace(" attributes {nvvm.kernel}", ""), "no kernel"),
    ],
)
def test_malformed_modules_are_named(text, reason):
    with pytest.raises(BitcodeError, match=reason):
        compile_mlir(text)


def test_unverifiable_module_is_named():
    # A module built through the bindings is not verified until it is checked.
    from mlir import ir
    from mlir.dialects import llvm

    with ir.Context(), ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            _, entry = kernel("k", [])
            with ir.InsertionPoint(entry):
                call("my_pe")  # never declared
                llvm.return_()
        with pytest.raises(BitcodeError, match="(?s)does not verify.*'mori_shmem_my_pe' does not reference a symbol"):
            compile_mlir(module)


def test_untranslatable_module_reports_the_translation_error():
    # Verifies in MLIR, but MLIR has no translation of the arith dialect to LLVM IR.
    text = _BASIC.replace("llvm.store %0", "%1 = arith.constant 1 : i32\n    llvm.store %0")
    with pytest.raises(BitcodeError, match="(?s)MLIR could not translate.*arith.constant"):
        compile_mlir(text)


def test_helpers_name_their_mistakes():
    assert function_type("int32_p") == function_type("mori_shmem_int32_p") == "!llvm.func<i32 (i64, i32, i32, i32)>"
    with pytest.raises(ValueError, match="mori_shmem_nope is not a function"):
        declare("nope")
    from mlir import ir

    with ir.Context(), ir.Location.unknown(), pytest.raises(TypeError, match="takes 4 operands"):
        call("int32_p")


def test_missing_bindings_say_which_extra(monkeypatch):
    from mori.triton.mlir import build_shmem_put_kernel

    monkeypatch.setitem(sys.modules, "mlir", None)
    with pytest.raises(ImportError, match=r"mori-triton\[mlir\]"):
        build_shmem_put_kernel()
