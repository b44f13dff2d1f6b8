"""Triton (and LLVM IR) kernels calling mori's device API compile to sm_90 PTX on a machine without a GPU."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import triton
from triton.backends.compiler import GPUTarget

from mori.triton import DEVICE_FUNCTIONS, BitcodeError, compile_ir, find_bitcode
from mori.triton._all_reduce import DEFAULT_TABLE, SWEEP_LARGE, SWEEP_SMALL
from mori.triton._all_reduce_fast import all_reduce_fast_kernel
from mori.triton._all_reduce_lamport import all_reduce_lamport_kernel
from mori.triton._llvm_ir import _binding_parameters, _translate_to_asm
from mori.triton.kernels import (
    PUT_RING_IR,
    allreduce_p2p_kernel,
    allreduce_put_signal_kernel,
    get_ring_kernel,
    put_ring_kernel,
)

TARGET = GPUTarget("cuda", 90, 32)
STATE_RE = re.compile(r"^\.visible \.global \.align \d+ \.b8 globalGpuStates\[64\];", re.MULTILINE)
FAST_STATE_RE = re.compile(r"^\.visible \.const \.align \d+ \.b8 globalGpuStatesFast\[544\];", re.MULTILINE)
# Values for each argument of a generated call: pointers from the kernel's pointer argument,
# comparison operators in range, everything else a small constant.
_ARG_VALUES = {"ptr": "p", "i32": "1", "u32": "1", "i64": "1", "u64": "1", "f32": "1.5", "f64": "2.5"}
_SPECIAL = {"cmp": "0", "sig_op": "ms.SIGNAL_ADD", "pe": "pe", "dest_pe": "pe", "my_pe": "pe"}


def _compile(fn, signature, constexprs=None, num_warps=4):
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs or {})
    options = {"extern_libs": (("libmori_shmem_device", find_bitcode()),), "num_warps": num_warps}
    return triton.compile(src, target=TARGET, options=options).asm["ptx"]


def _check_linked(ptx: str) -> None:
    assert STATE_RE.search(ptx), "globalGpuStates is not a visible global of the PTX"
    # the constant-memory mirror, where the kernel uses it, must be visible too (the host writes it)
    assert "globalGpuStatesFast" not in ptx or FAST_STATE_RE.search(ptx), "globalGpuStatesFast is not visible"
    externs = re.findall(r"^\.extern \.func[^\n]*?(\w+)\(", ptx, re.MULTILINE)
    externs += re.findall(r"^\.extern \.func \([^)]*\) (\w+)", ptx, re.MULTILINE)
    assert set(externs) <= {"vprintf"}, f"unresolved device functions: {externs}"
    # a callee that was not inlined has a .func line (block comments name inlined callees, so the
    # match is anchored to a line's first token)
    assert not re.search(r"^\s*(call[^;\n]*|\.func[^\n]*)mori_shmem_", ptx, re.MULTILINE), (
        "a mori_shmem_* call was not inlined"
    )


def _write_all_externs_module(path: Path, chunk: int = 40) -> list[str]:
    """A Python file of @triton.jit kernels that together call every generated extern once."""
    lines = ["import triton", "import triton.language as tl", "from mori.triton import shmem as ms", ""]
    names = []
    for k in range(0, len(DEVICE_FUNCTIONS), chunk):
        name = f"calls_{k // chunk}"
        names.append(name)
        lines += ["@triton.jit", f"def {name}(p, out):", "    pe = ms.my_pe()", "    acc = 0"]
        for fn in DEVICE_FUNCTIONS[k : k + chunk]:
            args = ", ".join(_SPECIAL.get(a, _ARG_VALUES[t]) for a, t in fn.args)
            lines.append(f"    acc += ms.{fn.name}({args}).to(tl.float64)")
        lines += ["    tl.store(out, acc)", ""]
    path.write_text("\n".join(lines))
    return names


def test_every_generated_extern_compiles_and_links(tmp_path):
    names = _write_all_externs_module(tmp_path / "all_externs.py")
    spec = importlib.util.spec_from_file_location("all_externs", tmp_path / "all_externs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["all_externs"] = module
    try:
        spec.loader.exec_module(module)
        for name in names:
            ptx = _compile(getattr(module, name), {"p": "*i8", "out": "*fp64"})
            _check_linked(ptx)
    finally:
        sys.modules.pop("all_externs", None)


@pytest.mark.parametrize("kernel", [put_ring_kernel, get_ring_kernel])
def test_ring_kernels_compile(kernel):
    ptx = _compile(kernel, {"dst": "*u8", "src": "*u8", "nbytes": "i64", "per_block": "i64"})
    _check_linked(ptx)


def test_seed_allreduce_kernels_compile():
    a = _compile(
        allreduce_p2p_kernel, {"sym_in": "*bf16", "out": "*bf16", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 1024}
    )
    _check_linked(a)
    b = _compile(
        allreduce_put_signal_kernel,
        {
            "sym_in": "*bf16",
            "sym_recv": "*bf16",
            "sig": "*u64",
            "out": "*bf16",
            "n": "i32",
            "epoch": "i64",
            "CHUNKS_PER_PE": "constexpr",
            "BLOCK": "constexpr",
        },
        {"CHUNKS_PER_PE": 8, "BLOCK": 1024},
    )
    _check_linked(b)


def _compile_all_reduce(fn, sig, aligned, constexprs, num_warps):
    """PTX of an all-reduce kernel specialised as AllReduce's launches are: the arguments named in
    ``aligned`` (every element of a tuple argument) 16-byte aligned or divisible by 16."""
    names = list(sig)
    attrs = {}
    for name in aligned:
        i = names.index(name)
        keys = [(i, j) for j in range(len(sig[name]))] if isinstance(sig[name], tuple) else [(i,)]
        attrs.update({k: [["tt.divisibility", 16]] for k in keys})
    consts = {(names.index(name),): value for name, value in constexprs.items()}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, attrs=attrs, constexprs=consts)
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps}).asm["ptx"]


def _compile_fast(world, one_shot, block, num_warps, dtype="bf16"):
    """PTX of the v2 all-reduce kernel, specialised as AllReduce's launches are (16-byte alignment, n % 16)."""
    sig = {
        "inp": f"*{dtype}",
        "out": f"*{dtype}",
        "mine": f"*{dtype}",
        "my_flags": "*u32",
        "epochs": "*u32",
        "deltas": ("i64",) * world,
        "flag_deltas": ("i64",) * world,
        "rank": "i32",
        "n": "i32",
        "chunk": "i32",
        "timeout_ns": "i64",
        "W": "constexpr",
        "WP": "constexpr",
        "MAXB": "constexpr",
        "BLOCK": "constexpr",
        "ONE_SHOT": "constexpr",
    }
    return _compile_all_reduce(
        all_reduce_fast_kernel,
        sig,
        ("inp", "out", "mine", "my_flags", "epochs", "deltas", "flag_deltas", "n", "chunk"),
        {"W": world, "WP": triton.next_power_of_2(world), "MAXB": 1024, "BLOCK": block, "ONE_SHOT": one_shot},
        num_warps,
    )


def _check_fast_ptx(ptx):
    ops = set(re.findall(r"(ld\.global[.\w]*|st\.global[.\w]*)", ptx))
    # data: 16-byte vectors only (the scalar b32 pair is the epoch load/store); flags: parallel
    # release stores and acquire polls with a deadline, no remote atomics.
    assert {o for o in ops if "v4" not in o} <= {"ld.global.b32", "st.global.b32"}, ops
    assert "st.global.v4.b32" in ops and "ld.global.v4.b32" in ops
    assert "st.release.sys.global.b32" in ptx and "ld.acquire.sys.global.b32" in ptx and "%globaltimer" in ptx
    assert "atom." not in ptx


_SHAPES = sorted(
    {
        (c.one_shot, c.block, c.num_warps)
        for c in (*SWEEP_SMALL, *SWEEP_LARGE, *(c for _, c in DEFAULT_TABLE))
        if c.kernel == "v2"
    }
)


def _compile_lamport(world, one_shot, block, num_warps, dtype="bf16"):
    """PTX of the v3 all-reduce kernel, specialised as AllReduce's launches are."""
    sig = {
        "inp": f"*{dtype}",
        "out": f"*{dtype}",
        "lam": f"*{dtype}",
        "sets": "*u32",
        "deltas": ("i64",) * world,
        "rank": "i32",
        "n": "i32",
        "chunk": "i32",
        "timeout_ns": "i64",
        "set_elems": "i32",
        "W": "constexpr",
        "WP": "constexpr",
        "BLOCK": "constexpr",
        "ONE_SHOT": "constexpr",
    }
    return _compile_all_reduce(
        all_reduce_lamport_kernel,
        sig,
        ("inp", "out", "lam", "sets", "deltas", "n", "chunk", "set_elems"),
        {"W": world, "WP": triton.next_power_of_2(world), "BLOCK": block, "ONE_SHOT": one_shot},
        num_warps,
    )


def _check_lamport_ptx(ptx):
    ops = set(re.findall(r"(ld\.[.\w]*global[.\w]*|st\.global[.\w]*)", ptx))
    # data: 16-byte vectors, polled with volatile loads; no flags, fences or atomics at all (the
    # scalar b32 pair is the set counter's load and store).
    assert {o for o in ops if "v4" not in o} <= {"ld.global.b32", "st.global.b32"}, ops
    assert "st.global.v4.b32" in ops and "ld.volatile.global.v4.b32" in ops and "%globaltimer" in ptx
    assert "atom." not in ptx and "fence" not in ptx and "membar" not in ptx and ".release" not in ptx


_LAMPORT_SHAPES = sorted(
    {(c.one_shot, c.block, c.num_warps) for c in (*SWEEP_SMALL, *(c for _, c in DEFAULT_TABLE)) if c.kernel == "v3"}
)


# kernel -> (compile, PTX check, block used for other worlds and dtypes)
_KERNELS = {"v2": (_compile_fast, _check_fast_ptx, 2048), "v3": (_compile_lamport, _check_lamport_ptx, 1024)}


@pytest.mark.parametrize(
    "kernel,one_shot,block,num_warps",
    [("v2", *shape) for shape in _SHAPES] + [("v3", *shape) for shape in _LAMPORT_SHAPES],
)
def test_every_swept_all_reduce_compiles_vectorised(kernel, one_shot, block, num_warps):
    compile_kernel, check, _ = _KERNELS[kernel]
    check(compile_kernel(4, one_shot, block, num_warps))


@pytest.mark.parametrize("kernel", sorted(_KERNELS))
@pytest.mark.parametrize("world,dtype", [(2, "fp16"), (3, "fp32"), (8, "bf16")])
@pytest.mark.parametrize("one_shot", [True, False])
def test_all_reduce_compiles_for_other_worlds_and_dtypes(kernel, world, dtype, one_shot):
    compile_kernel, check, block = _KERNELS[kernel]
    check(compile_kernel(world, one_shot, block, 4, dtype))


def test_llvm_ir_path_links_and_assembles():
    ptx, cubin = compile_ir(PUT_RING_IR)
    assert ".visible .entry mori_ir_put_ring" in ptx
    assert STATE_RE.search(ptx)
    assert cubin[:4] == b"\x7fELF"


def test_llvm_ir_path_rejects_unknown_symbols():
    bad = PUT_RING_IR.replace("@mori_shmem_quiet_thread()", "@mori_shmem_no_such_thing()")
    with pytest.raises(BitcodeError, match="mori_shmem_no_such_thing"):
        compile_ir(bad)


def test_llvm_ir_path_reports_bad_ir():
    with pytest.raises(BitcodeError, match="LLVM could not compile"):
        compile_ir("define ptx_kernel void @k() { call i32 @mori_shmem_my_pe( }")


class _Binding:
    """A stand-in for a compiled binding: only its docstring, as pybind11 or nanobind writes it."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc


# translate_to_asm's docstring in Triton 3.6 (pybind11) and in Triton 3.9 (nanobind).
_ASM_DOC_PYBIND11 = (
    "translate_to_asm(arg0: str, arg1: str, arg2: str, arg3: str, arg4: collections.abc.Sequence[str], "
    "arg5: bool, arg6: bool) -> object\n"
)
_ASM_DOC_NANOBIND = (
    "translate_to_asm(llvm_ir: str, triple: str, proc: str, features: str, "
    "flags: collections.abc.Sequence[str], enable_fp_fusion: bool, is_object: bool, "
    "canonicalize_gep: bool, sched4reg: bool = False) -> object"
)


def test_binding_parameters_are_read_from_either_bindings_docstring():
    assert _binding_parameters(_Binding(_ASM_DOC_PYBIND11)) == [(f"arg{i}", False) for i in range(7)]
    assert _binding_parameters(_Binding(_ASM_DOC_NANOBIND)) == [
        ("llvm_ir", False),
        ("triple", False),
        ("proc", False),
        ("features", False),
        ("flags", False),
        ("enable_fp_fusion", False),
        ("is_object", False),
        ("canonicalize_gep", False),
        ("sched4reg", True),
    ]
    assert _binding_parameters(_Binding("f(a: dict[str, tuple[int, int]], b: int = 3) -> None")) == [
        ("a", False),
        ("b", True),
    ]
    with pytest.raises(BitcodeError, match="cannot read the parameters"):
        _binding_parameters(_Binding("no signature here"))


@pytest.mark.parametrize("doc,extra", [(_ASM_DOC_PYBIND11, {}), (_ASM_DOC_NANOBIND, {"canonicalize_gep": False})])
def test_translate_to_asm_gets_the_parameters_its_triton_takes(doc, extra):
    calls = []

    class FakeLlvm:
        @staticmethod
        def translate_to_asm(*args, **kwargs):
            calls.append((args, kwargs))
            return ".version 8.6"

    FakeLlvm.translate_to_asm.__doc__ = doc
    assert _translate_to_asm(FakeLlvm, "ir", "sm_90", "+ptx86") == ".version 8.6"
    assert calls == [(("ir", "nvptx64-nvidia-cuda", "sm_90", "+ptx86", [], False, False), extra)]


def test_translate_to_asm_names_a_parameter_it_does_not_know():
    class FakeLlvm:
        @staticmethod
        def translate_to_asm(*args, **kwargs):
            raise AssertionError("must not be called")

    FakeLlvm.translate_to_asm.__doc__ = _ASM_DOC_NANOBIND.replace("canonicalize_gep", "new_flag")
    with pytest.raises(BitcodeError, match="new_flag"):
        _translate_to_asm(FakeLlvm, "ir", "sm_90", "+ptx86")


def test_declared_triton_minimum_is_the_release_ci_pins():
    """mori-triton declares only the Triton it is tested with: its minimum is the main CI job's pin
    (ci/newest.sh tests the newest release)."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    (declared,) = [req for req in map(Requirement, requires("mori-triton") or []) if req.name == "triton"]
    pins = (Path(__file__).resolve().parents[3] / "ci" / "requirements-dev.txt").read_text()
    pinned = re.search(r"^triton==(\d+\.\d+)\.", pins, re.MULTILINE)
    assert pinned, "ci/requirements-dev.txt pins no triton release"
    assert [s.version for s in declared.specifier if s.operator == ">="] == [pinned.group(1)]
