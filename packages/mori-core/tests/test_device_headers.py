"""mori's CUDA device API (``include/mori/device``) compiled three ways, with no GPU.

A generated translation unit calls every public device function (every scope, element type and
comparison) from ``__global__`` kernels, and is compiled with nvcc (PTX, assembled by ptxas for
sm_90), NVRTC (through ``mori.core.nvrtc``) and clang-19 ``-x cuda -nocudainc -nocudalib`` (LLVM
bitcode and PTX), the three ways mori's users and mori-triton build device code. The output is
then checked for the state global and for the system-scope instructions the memory-ordering
design depends on. Runtime behaviour on GPUs is tested by mori-shmem's device scripts.

A missing compiler fails these tests (it does not skip them): ``ci/setup.sh`` installs nvcc and
ptxas (PyPI ``nvidia-cuda-nvcc``) and clang-19 (apt).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mori.core.codes import Cmp, SignalOp

# Whole-unit compiles take ~35 s of CPU each; on the 2-core CI machine beside the other test lanes
# one may take several minutes, so this module's hang guard is longer than the suite's 300 s.
pytestmark = pytest.mark.timeout(900)

INCLUDE = Path(__file__).resolve().parents[1] / "include"
HEADERS = sorted((INCLUDE / "mori" / "device").glob("*.cuh"))
ARCH = "sm_90"

SCOPES = ("Thread", "Warp", "Block")
# (name in function names, C++ element type) of the typed RMA API, in rma.cuh's order.
RMA_TYPES = (
    ("Uint8", "uint8_t"),
    ("Int8", "int8_t"),
    ("Schar", "signed char"),
    ("Uint16", "uint16_t"),
    ("Int16", "int16_t"),
    ("Uint32", "uint32_t"),
    ("Int32", "int32_t"),
    ("Uint64", "uint64_t"),
    ("Int64", "int64_t"),
    ("Float", "float"),
    ("Double", "double"),
    ("Half", "uint16_t"),
    ("Bfloat16", "uint16_t"),
)
WAIT_TYPES = RMA_TYPES[:9]  # the integer types
AMO_TYPES = ("int32_t", "uint32_t", "int64_t", "uint64_t", "long long", "unsigned long long")
CMPS = ("kCmpEq", "kCmpNe", "kCmpGt", "kCmpGe", "kCmpLt", "kCmpLe")
AMO_OPS = ("Add", "And", "Or", "Xor")

# Instructions the ordering design rests on (see sync.cuh / rma.cuh); every compiler must emit them.
REQUIRED_PTX = {
    "quiet": r"\bfence\.sc\.sys;",
    "fence / group signal": r"\bfence\.acq_rel\.sys;",
    "signal SET, barrier arrival": r"\bst\.release\.sys\.b64\b",
    "signal ADD": r"\bred\.release\.sys\.add\.u64\b",
    "wait_until / barrier wait": r"\bld\.acquire\.sys\.b(8|16|32|64)\b|\bld\.acquire\.sys\.u8\b",
    "g / atomic fetch": r"\bld\.relaxed\.sys\.b(32|64)\b",
    "atomic set": r"\bst\.relaxed\.sys\.b(32|64)\b",
    "fetch-add": r"\batom\.relaxed\.sys\.add\.u(32|64)\b",
    "compare-swap": r"\batom\.relaxed\.sys\.cas\.b(32|64)\b",
    "swap": r"\batom\.relaxed\.sys\.exch\.b(32|64)\b",
    "fetch-and/or/xor": r"\batom\.relaxed\.sys\.(and|or|xor)\.b(32|64)\b",
    "non-fetch add/and/or/xor": r"\bred\.relaxed\.sys\.(add|and|or|xor)\.[ub](32|64)\b",
    "wait back-off": r"\bnanosleep\.u32\b",
    "wait timeout clock": r"%globaltimer",
    "device error abort": r"\btrap;",
    "16-byte vector copy": r"\b(ld|st)(\.global)?\.v(2\.u64|4\.u32|2\.b64|4\.b32)\b",
}


# ---------------------------------------------------------------------------------------------
# Compilers
# ---------------------------------------------------------------------------------------------
def _nvcc_candidates() -> list[Path]:
    """nvcc from PyPI's nvidia-cuda-nvcc first (what ci/setup.sh installs), then CUDA_HOME/PATH/
    /usr/local/cuda*."""
    found: list[Path] = []
    try:
        import nvidia.cu13 as cu13  # type: ignore[import-not-found]

        found += [Path(p) / "bin" / "nvcc" for p in cu13.__path__]
    except ImportError:
        pass
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            found.append(Path(os.environ[var]) / "bin" / "nvcc")
    if shutil.which("nvcc"):
        found.append(Path(shutil.which("nvcc") or ""))
    found += sorted(Path("/usr/local").glob("cuda*/bin/nvcc"), reverse=True)
    return found


@pytest.fixture(scope="module")
def nvcc() -> Path:
    for path in _nvcc_candidates():
        if path.is_file() and os.access(path, os.X_OK) and (path.parent / "ptxas").is_file():
            return path
    pytest.fail(
        "nvcc (with ptxas beside it) not found: looked in the nvidia-cuda-nvcc wheel, $CUDA_HOME, "
        "$CUDA_PATH, PATH and /usr/local/cuda*/bin. Install it with `pip install nvidia-cuda-nvcc` "
        "(ci/setup.sh does, from ci/requirements-dev.txt)."
    )


@pytest.fixture(scope="module")
def clang() -> str:
    path = shutil.which("clang-19")
    if path is None:
        pytest.fail("clang-19 not found on PATH: install it with `apt-get install clang-19 llvm-19` (ci/setup.sh does)")
    return path


def _run(cmd: list[str | Path], what: str) -> subprocess.CompletedProcess[str]:
    # The bound only catches a hung compiler: the whole translation unit takes ~35 s of CPU, and
    # several times that on a 2-core machine that runs other test lanes beside it.
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"{what} failed ({proc.returncode}):\n$ {' '.join(map(str, cmd))}\n{proc.stderr}{proc.stdout}")
    return proc


def _clang_cmd(clang: str, src: Path, *extra: str) -> list[str | Path]:
    return [
        clang,
        "-x",
        "cuda",
        "-nocudainc",
        "-nocudalib",
        f"--cuda-gpu-arch={ARCH}",
        "-std=c++17",
        "--cuda-device-only",
        "-O2",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-Wno-unknown-cuda-version",
        f"-I{INCLUDE}",
        *extra,
        src,
    ]


def _nvcc_ptx(nvcc: Path, src: Path, out: Path, *extra: str) -> str:
    _run(
        [
            nvcc,
            f"-arch={ARCH}",
            "-std=c++17",
            f"-I{INCLUDE}",
            "-Werror",
            "all-warnings",
            *extra,
            "-ptx",
            "-o",
            out,
            src,
        ],
        "nvcc",
    )
    return out.read_text()


def _nvrtc_ptx(source: str, *options: str) -> str:
    from mori.core import nvrtc

    return nvrtc.compile(source, name="mori_device_all.cu", arch=ARCH, options=options, output="ptx").decode()


# ---------------------------------------------------------------------------------------------
# The translation unit that calls everything
# ---------------------------------------------------------------------------------------------
def _kernel(name: str, body: list[str]) -> str:
    params = "char* sym, const char* local, size_t n, int pe, int cmp, uint64_t* out"
    # Each kernel uses a subset of the parameters; the rest are voided for -Wunused-parameter.
    body = ["(void)sym; (void)local; (void)n; (void)pe; (void)cmp; (void)out;", *body]
    return f'extern "C" __global__ void {name}({params}) {{\n  ' + "\n  ".join(body) + "\n}\n"


def _rma_kernel(scope: str) -> str:
    sig = "reinterpret_cast<uint64_t*>(sym + 8)"
    body = [
        f"ShmemPutMemNbi{scope}(sym, local, n, pe);",
        f"ShmemPutMem{scope}(sym, local, n, pe);",
        f"ShmemGetMemNbi{scope}(const_cast<char*>(local), sym, n, pe);",
        f"ShmemGetMem{scope}(const_cast<char*>(local), sym, n, pe);",
        f"ShmemPutMemNbiSignal{scope}(sym, local, n, {sig}, 1, kSignalSet, pe);",
        f"ShmemPutMemNbiSignal{scope}(sym, local, n, {sig}, 1, kSignalAdd, pe);",
        f"ShmemPutTypeNbi{scope}<float>(reinterpret_cast<float*>(sym), reinterpret_cast<const float*>(local), n, pe);",
        f"ShmemPutType{scope}<float>(reinterpret_cast<float*>(sym), reinterpret_cast<const float*>(local), n, pe);",
        f"ShmemGetTypeNbi{scope}<float>(reinterpret_cast<float*>(sym), reinterpret_cast<const float*>(local), n, pe);",
        f"ShmemGetType{scope}<float>(reinterpret_cast<float*>(sym), reinterpret_cast<const float*>(local), n, pe);",
        f"ShmemPutTypeNbiSignal{scope}<float>(reinterpret_cast<float*>(sym), reinterpret_cast<const float*>(local), n, {sig}, 2, kSignalSet + (cmp & 1), pe);",
    ]
    for name, ctype in RMA_TYPES:
        d, s = f"reinterpret_cast<{ctype}*>(sym)", f"reinterpret_cast<const {ctype}*>(local)"
        body += [
            f"ShmemPut{name}Nbi{scope}({d}, {s}, n, pe);",
            f"ShmemPut{name}{scope}({d}, {s}, n, pe);",
            f"ShmemGet{name}Nbi{scope}({d}, {s}, n, pe);",
            f"ShmemGet{name}{scope}({d}, {s}, n, pe);",
            f"ShmemPut{name}NbiSignal{scope}({d}, {s}, n, {sig}, 3, kSignalAdd, pe);",
        ]
    return _kernel(f"rma_{scope.lower()}", body)


def _pg_kernel() -> str:
    body = []
    for name, ctype in RMA_TYPES:
        p = f"reinterpret_cast<{ctype}*>(sym + 64)"
        body += [
            f"ShmemP<{ctype}>({p}, static_cast<{ctype}>(n), pe);",
            f"out[0] += (uint64_t)ShmemG<{ctype}>({p}, pe);",
            f"Shmem{name}P({p}, static_cast<{ctype}>(n), pe);",
            f"out[1] += (uint64_t)Shmem{name}G({p}, pe);",
            f"ShmemPut{name}ImmNbiThread({p}, static_cast<{ctype}>(n), pe);",
        ]
    body.append("ShmemPutSizeImmNbiThread(sym + 64, local, n, pe);")
    return _kernel("pg", body)


def _amo_kernel() -> str:
    body = []
    for i, ctype in enumerate(AMO_TYPES):
        p = f"reinterpret_cast<{ctype}*>(sym + {128 + 8 * i})"
        body += [
            f"out[{i}] += (uint64_t)ShmemAtomicFetch<{ctype}>({p}, pe);",
            f"ShmemAtomicSet<{ctype}>({p}, 7, pe);",
            f"out[{i}] += (uint64_t)ShmemAtomicSwap<{ctype}>({p}, 9, pe);",
            f"out[{i}] += (uint64_t)ShmemAtomicCompareSwap<{ctype}>({p}, 9, 11, pe);",
            f"out[{i}] += (uint64_t)ShmemAtomicFetchInc<{ctype}>({p}, pe);",
            f"ShmemAtomicInc<{ctype}>({p}, pe);",
        ]
        for op in AMO_OPS:
            body += [
                f"out[{i}] += (uint64_t)ShmemAtomicFetch{op}<{ctype}>({p}, 5, pe);",
                f"ShmemAtomic{op}<{ctype}>({p}, 5, pe);",
            ]
        body += [
            f"ShmemAtomicNonFetchThread<{ctype}>({p}, 5, kAmoAdd, pe);",
            f"out[{i}] += (uint64_t)ShmemAtomicFetchThread<{ctype}>({p}, 5, 7, cmp + kAmoFetch, pe);",
        ]
    for name, ctype in (("Uint32", "uint32_t"), ("Int32", "int32_t"), ("Uint64", "uint64_t"), ("Int64", "int64_t")):
        p = f"reinterpret_cast<{ctype}*>(sym + 192)"
        body += [
            f"Shmem{name}AtomicAddThread({p}, 1, pe);",
            f"out[6] += (uint64_t)Shmem{name}AtomicFetchAddThread({p}, 1, pe);",
        ]
    body.append("ShmemAtomicSizeNonFetchThread(sym + 192, local, 4 + (cmp & 4), cmp, pe);")
    return _kernel("amo", body)


def _sync_kernel() -> str:
    body = []
    for ctype in AMO_TYPES + ("uint8_t", "int16_t"):
        p = f"reinterpret_cast<{ctype}*>(sym + 256)"
        for c in CMPS:
            body += [f"out[0] += (uint64_t)ShmemWaitUntil({p}, {c}, 1);", f"out[1] += ShmemTest({p}, {c}, 1);"]
        body += [
            f"out[2] += (uint64_t)ShmemWaitUntil<{ctype}>({p}, cmp, 2);",
            f"out[3] += ShmemTest<{ctype}>({p}, cmp, 2);",
        ]
    for name, ctype in WAIT_TYPES:
        p = f"reinterpret_cast<{ctype}*>(sym + 320)"
        body += [
            f"Shmem{name}WaitUntilEquals({p}, ({ctype})n);",
            f"out[4] += (uint64_t)Shmem{name}WaitUntilGreaterThan({p}, ({ctype})n);",
        ]
    body += [
        "ShmemFence();",
        "ShmemFenceThread();",
        "ShmemFenceThread(pe);",
        "ShmemQuiet();",
        "ShmemQuietThread();",
        "ShmemQuietThread(pe);",
        "ShmemQuietWarp();",
        "ShmemQuietBlock();",
        "ShmemBarrierAllThread();",
        "ShmemBarrierAllBlock();",
        "out[5] = ShmemMyPe() + ShmemNPes();",
        "out[6] = ShmemPtrP2p(reinterpret_cast<uint64_t>(sym), ShmemMyPe(), pe);",
        "out[7] = reinterpret_cast<uint64_t>(ShmemPtr(sym, pe));",
    ]
    return _kernel("sync", body)


ALL_SOURCE = (
    "// Generated by test_device_headers.py: calls every public mori device function.\n"
    "#define MORI_DEVICE_DEFINE_STATE\n#include <mori/device/shmem.cuh>\n"
    "using namespace mori::device;\n\n"
    + "".join(_rma_kernel(s) for s in SCOPES)
    + _pg_kernel()
    + _amo_kernel()
    + _sync_kernel()
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("device")
    (d / "all.cu").write_text(ALL_SOURCE)
    return d


def _check_ptx(ptx: str, compiler: str) -> None:
    missing = [what for what, pattern in REQUIRED_PTX.items() if not re.search(pattern, ptx)]
    assert not missing, f"{compiler}: PTX lacks the instructions for: {', '.join(missing)}"
    assert re.search(r"^\.(visible )?\.?global \.align 8 \.b8 globalGpuStates\[64\];", ptx, re.M), (
        f"{compiler}: PTX defines no 64-byte globalGpuStates"
    )
    # the hot paths' mirror: in constant memory, 32 bytes of state and 64 peer bases
    assert re.search(r"^\.(visible )?\.?const \.align 8 \.b8 globalGpuStatesFast\[544\];", ptx, re.M), (
        f"{compiler}: PTX defines no 544-byte constant globalGpuStatesFast"
    )


# ---------------------------------------------------------------------------------------------
# Coverage of the generated translation unit
# ---------------------------------------------------------------------------------------------
def test_translation_unit_calls_every_public_function(clang: str, workdir: Path) -> None:
    # Expand the headers' macros, then collect every Shmem* function they define.
    src = workdir / "only_headers.cu"
    src.write_text("#include <mori/device/shmem.cuh>\n")
    expanded = _run(_clang_cmd(clang, src, "-E", "-P"), "clang -E").stdout
    defined = set(re.findall(r"\b(Shmem[A-Z]\w*)\s*(?:<[^;(){}]*>)?\s*\(", expanded))
    assert len(defined) > 300, f"too few device functions found ({len(defined)}): the scan is broken"
    called = set(re.findall(r"\b(Shmem[A-Z]\w*)\s*[<(]", ALL_SOURCE))
    assert defined - called == set(), f"device functions never compiled by the tests: {sorted(defined - called)}"
    assert called - defined == set(), f"the test calls functions the headers lack: {sorted(called - defined)}"


def test_headers_include_no_outside_header() -> None:
    ours = {h.name for h in HEADERS}
    for header in HEADERS:
        for line in header.read_text().splitlines():
            m = re.match(r"\s*#\s*include\s*(.+)", line)
            if m:
                target = m.group(1).strip()
                assert target.strip('"') in ours and target.startswith('"'), f"{header.name} includes {target}"


# ---------------------------------------------------------------------------------------------
# The three compilers
# ---------------------------------------------------------------------------------------------
def test_nvcc_ptx_and_ptxas(nvcc: Path, workdir: Path) -> None:
    # Relocatable device code: the state global is external, as a multi-file build sees it.
    ptx = _nvcc_ptx(nvcc, workdir / "all.cu", workdir / "all_rdc.ptx", "-rdc=true")
    _check_ptx(ptx, "nvcc")
    assert ".visible .global .align 8 .b8 globalGpuStates[64];" in ptx
    _run([nvcc.parent / "ptxas", f"-arch={ARCH}", "-c", workdir / "all_rdc.ptx", "-o", workdir / "all_rdc.o"], "ptxas")
    assert (workdir / "all_rdc.o").stat().st_size > 0


def test_nvcc_whole_program_cubin_keeps_state_symbol(nvcc: Path, workdir: Path) -> None:
    # Whole-program mode (the default) makes the globals module-local, but it keeps their names in
    # the cubin's symbol table, which is what cuModuleGetGlobal looks up. Kernels that read both
    # states are enough (the whole unit is compiled by the PTX test).
    src = workdir / "states.cu"
    src.write_text(ALL_SOURCE.split("\n\n", 1)[0] + "\n\n" + _pg_kernel() + _sync_kernel())
    cubin = workdir / "states.cubin"
    _run([nvcc, f"-arch={ARCH}", "-std=c++17", f"-I{INCLUDE}", "-cubin", "-o", cubin, src], "nvcc -cubin")
    assert b"globalGpuStates\0" in cubin.read_bytes() and b"globalGpuStatesFast\0" in cubin.read_bytes()


# NVRTC's two modes are two tests (half a minute of CPU each), which parallel runs spread.
def test_nvrtc_ptx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MORI_CACHE_DIR", str(tmp_path))  # a fresh cache: really compile
    ptx = _nvrtc_ptx(ALL_SOURCE, "-rdc=true")
    _check_ptx(ptx, "NVRTC")
    assert ".visible .global .align 8 .b8 globalGpuStates[64];" in ptx


def test_nvrtc_whole_program_ptx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MORI_CACHE_DIR", str(tmp_path))  # a fresh cache: really compile
    whole = _nvrtc_ptx(ALL_SOURCE)  # the single-file kernel mori-shmem's users compile
    _check_ptx(whole, "NVRTC (whole program)")


def test_clang_bitcode_has_no_unintended_externals(clang: str, workdir: Path) -> None:
    bc = workdir / "all.bc"
    _run(_clang_cmd(clang, workdir / "all.cu", "-emit-llvm", "-c", "-o", str(bc)), "clang -emit-llvm")
    llvm_dis = shutil.which("llvm-dis-19")
    if llvm_dis is None:
        pytest.fail("llvm-dis-19 not found: install llvm-19 (ci/setup.sh does)")
    ir = _run([llvm_dis, bc, "-o", "-"], "llvm-dis").stdout
    declared = set(re.findall(r"^declare [^@]*@([\w.$]+)\(", ir, re.M))
    # vprintf is the driver's printf, resolved by the CUDA driver; llvm.* are intrinsics.
    assert {d for d in declared if not d.startswith("llvm.")} == {"vprintf"}, declared
    assert re.search(r"^@globalGpuStates = (dso_local )?addrspace\(1\) externally_initialized global", ir, re.M), (
        "the bitcode does not define an externally visible globalGpuStates"
    )
    assert re.search(
        r"^@globalGpuStatesFast = (dso_local )?addrspace\(4\) externally_initialized (global|constant)", ir, re.M
    ), "the bitcode does not define an externally visible constant globalGpuStatesFast"


def test_clang_ptx_assembles(clang: str, nvcc: Path, workdir: Path) -> None:
    ptx_path = workdir / "all_clang.ptx"
    _run(_clang_cmd(clang, workdir / "all.cu", "-S", "-o", str(ptx_path)), "clang -S")
    ptx = ptx_path.read_text()
    _check_ptx(ptx, "clang")
    assert ".visible .global .align 8 .b8 globalGpuStates[64];" in ptx
    assert re.findall(r"^\.extern \.func .*?(\w+)$", ptx, re.M) == ["vprintf"]
    _run([nvcc.parent / "ptxas", f"-arch={ARCH}", ptx_path, "-o", workdir / "all_clang.cubin"], "ptxas (clang PTX)")


# ---------------------------------------------------------------------------------------------
# Layout, ordering and misuse, each with all three compilers
# ---------------------------------------------------------------------------------------------
COMPILERS = ("nvcc", "nvrtc", "clang")


def _try_ptx(compiler: str, source: str, tmp: Path, nvcc: Path, clang: str) -> tuple[bool, str]:
    """Compiles ``source`` to PTX; returns (succeeded, PTX or the compiler's messages)."""
    src = tmp / "t.cu"
    src.write_text(source)
    out = tmp / "t.ptx"
    if compiler == "nvrtc":
        from mori.core import nvrtc

        try:
            return True, _nvrtc_ptx(source)
        except nvrtc.NvrtcError as e:
            return False, e.log
    if compiler == "nvcc":
        cmd: list[str | Path] = [nvcc, f"-arch={ARCH}", "-std=c++17", f"-I{INCLUDE}", "-ptx", "-o", out, src]
    else:
        cmd = _clang_cmd(clang, src, "-S", "-o", str(out))
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=240)
    return proc.returncode == 0, out.read_text() if proc.returncode == 0 else proc.stderr + proc.stdout


# The GpuStates layout and internal-area constants of the cross-team contract.
CONTRACT_LAYOUT = {
    "sizeof(GpuStates)": 64,
    "alignof(GpuStates)": 8,
    "__builtin_offsetof(GpuStates, rank)": 0,
    "sizeof(GpuStates::rank)": 4,
    "__builtin_offsetof(GpuStates, worldSize)": 4,
    "sizeof(GpuStates::worldSize)": 4,
    "__builtin_offsetof(GpuStates, heapBase)": 8,
    "sizeof(GpuStates::heapBase)": 8,
    "__builtin_offsetof(GpuStates, heapSize)": 16,
    "sizeof(GpuStates::heapSize)": 8,
    "__builtin_offsetof(GpuStates, peerHeapBases)": 24,
    "sizeof(GpuStates::peerHeapBases)": 8,
    "__builtin_offsetof(GpuStates, flags)": 32,
    "sizeof(GpuStates::flags)": 4,
    "__builtin_offsetof(GpuStates, reserved0)": 36,
    "__builtin_offsetof(GpuStates, proxyRing)": 40,
    "sizeof(GpuStates::proxyRing)": 8,
    "__builtin_offsetof(GpuStates, proxyTickets)": 48,
    "sizeof(GpuStates::proxyTickets)": 8,
    "__builtin_offsetof(GpuStates, reserved)": 56,
    "sizeof(GpuStates::reserved)": 8,
    "kMaxPes": 64,
    "kInternalBytes": 64 * 1024,
    "kBarrierEpochOffset": 0,
    "kBarrierSlotsOffset": 64,
    "kScratchOffset": 4096,
    "kFlagP2pDisabled": 1,
    "kFlagProxy": 2,
    # The proxy ring's layout, shared with mori-core's native proxy.
    "sizeof(ProxySlot)": 64,
    "sizeof(ProxyHeader)": 64,
    "kProxySlots": 1024,
    # The codes' one definition is mori.core.codes: the headers must agree with it.
    **{f"kCmp{c.name.capitalize()}": c.value for c in Cmp},
    **{f"kSignal{op.name.capitalize()}": op.value for op in SignalOp},
}


def _layout_source(layout: dict[str, int]) -> str:
    checks = "".join(f'static_assert({expr} == {value}, "{expr} == {value}");\n' for expr, value in layout.items())
    return (
        "#define MORI_DEVICE_DEFINE_STATE\n#include <mori/device/shmem.cuh>\nusing namespace mori::device;\n"
        + checks
        + 'extern "C" __global__ void copy_state(GpuStates* out) { *out = globalGpuStates; }\n'
    )


@pytest.mark.parametrize("compiler", COMPILERS)
def test_gpu_states_layout_matches_contract(compiler: str, tmp_path: Path, nvcc: Path, clang: str) -> None:
    ok, log = _try_ptx(compiler, _layout_source(CONTRACT_LAYOUT), tmp_path, nvcc, clang)
    assert ok, f"{compiler}: the contract layout does not hold:\n{log}"
    # The check has teeth: a wrong expectation is a compile error that names it.
    ok, log = _try_ptx(compiler, _layout_source({**CONTRACT_LAYOUT, "sizeof(GpuStates)": 72}), tmp_path, nvcc, clang)
    assert not ok and "sizeof(GpuStates) == 72" in log, log


ORDERING_SOURCE = """
#define MORI_DEVICE_DEFINE_STATE
#include <mori/device/shmem.cuh>
using namespace mori::device;
extern "C" __global__ void signal_block(char* sym, const char* local, size_t n, int pe) {
  ShmemPutMemNbiSignalBlock(sym, local, n, reinterpret_cast<uint64_t*>(sym + 8), 1, kSignalSet, pe);
}
extern "C" __global__ void signal_add_thread(char* sym, const char* local, size_t n, int pe) {
  ShmemPutMemNbiSignalThread(sym, local, n, reinterpret_cast<uint64_t*>(sym + 8), 1, kSignalAdd, pe);
}
extern "C" __global__ void barrier_thread() { ShmemBarrierAllThread(); }
extern "C" __global__ void quiet_block() { ShmemQuietBlock(); }
"""


def _kernel_body(ptx: str, name: str) -> str:
    start = ptx.index(f".entry {name}(")
    return ptx[start : ptx.index("\n}\n", start)]


def _in_order(body: str, *patterns: str) -> bool:
    pos = 0
    for pattern in patterns:
        m = re.compile(pattern).search(body, pos)
        if m is None:
            return False
        pos = m.end()
    return True


@pytest.mark.parametrize("compiler", COMPILERS)
def test_ordering_instructions_come_in_order(compiler: str, tmp_path: Path, nvcc: Path, clang: str) -> None:
    ok, ptx = _try_ptx(compiler, ORDERING_SOURCE, tmp_path, nvcc, clang)
    assert ok, ptx
    copy = r"call(\.uni)?\s*(\(\w+\),\s*)?\s*_ZN4mori6device9GroupCopy"
    # Block signal: copy, every thread fences, the block syncs, then one release store.
    assert _in_order(
        _kernel_body(ptx, "signal_block"), copy, r"fence\.acq_rel\.sys;", r"bar\.sync", r"st\.release\.sys\.b64"
    )
    # Thread signal ADD: copy, then the release reduction (the release orders the copy before it).
    assert _in_order(_kernel_body(ptx, "signal_add_thread"), copy, r"red\.release\.sys\.add\.u64")
    # Barrier: arrive with release stores, then wait with acquire loads.
    assert _in_order(_kernel_body(ptx, "barrier_thread"), r"st\.release\.sys\.b64", r"ld\.acquire\.sys\.b64")
    # Quiet (block): each thread's sc fence before the block barrier.
    assert _in_order(_kernel_body(ptx, "quiet_block"), r"fence\.sc\.sys;", r"bar\.sync")


MISUSE = {
    "atomic on float": ("float* p = nullptr; ShmemAtomicAdd(p, 1.0f, 0);", "mori atomics take 32- or 64-bit integers"),
    "g of a 16-byte type": (
        "struct B { long a, b; }; B* p = nullptr; (void)ShmemG(p, 0);",
        "supports 1-, 2-, 4- and 8-byte types",
    ),
}


@pytest.mark.parametrize("case", sorted(MISUSE))
@pytest.mark.parametrize("compiler", COMPILERS)
def test_misuse_is_a_compile_error_that_says_why(
    compiler: str, case: str, tmp_path: Path, nvcc: Path, clang: str
) -> None:
    body, message = MISUSE[case]
    source = (
        "#define MORI_DEVICE_DEFINE_STATE\n#include <mori/device/shmem.cuh>\nusing namespace mori::device;\n"
        f'extern "C" __global__ void misuse() {{ {body} }}\n'
    )
    ok, log = _try_ptx(compiler, source, tmp_path, nvcc, clang)
    assert not ok and message in log, log


# ---------------------------------------------------------------------------------------------
# The copy engine itself, run on the CPU (copy.cuh is plain C++ under MORI_DEVICE_HOST_TEST)
# ---------------------------------------------------------------------------------------------
COPY_HARNESS = r"""
#define MORI_DEVICE_HOST_TEST
#include <mori/device/copy.cuh>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
// stdin: dst_off src_off bytes group buflen (5 x uint64), then src and dst (buflen bytes each).
// Runs GroupCopy for ranks 0..group-1 in turn (exact for a copy: ranks never synchronize) on
// 64-byte aligned buffers and writes the resulting dst buffer to stdout.
int main() {
  std::uint64_t h[5];
  if (std::fread(h, sizeof h, 1, stdin) != 1) return 2;
  const std::size_t len = (h[4] + 63) / 64 * 64 + 64;
  char* src = static_cast<char*>(std::aligned_alloc(64, len));
  char* dst = static_cast<char*>(std::aligned_alloc(64, len));
  if (std::fread(src, 1, h[4], stdin) != h[4] || std::fread(dst, 1, h[4], stdin) != h[4]) return 3;
  for (std::uint32_t rank = 0; rank < h[3]; ++rank) {
    mori::device::GroupCopy(dst + h[0], src + h[1], h[2], rank, static_cast<std::uint32_t>(h[3]));
  }
  std::fwrite(dst, 1, h[4], stdout);
  return 0;
}
"""


@pytest.fixture(scope="module")
def copy_harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++-19")
    if cxx is None:
        pytest.fail("no C++ compiler (c++, g++) on PATH: install g++ (ci/setup.sh does)")
    d = tmp_path_factory.mktemp("copy")
    (d / "harness.cpp").write_text(COPY_HARNESS)
    _run(
        [
            cxx,
            "-std=c++17",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-Wno-unknown-pragmas",
            f"-I{INCLUDE}",
            d / "harness.cpp",
            "-o",
            d / "harness",
        ],
        "c++ (copy harness)",
    )
    return d / "harness"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dst_off=st.integers(0, 63),
    src_off=st.integers(0, 63),
    nbytes=st.one_of(st.integers(0, 64), st.integers(0, 4096), st.integers(0, 300_000)),
    group=st.sampled_from([1, 2, 3, 31, 32, 33, 128, 1000, 1024]),
    seed=st.integers(0, 2**32 - 1),
)
def test_group_copy_moves_exactly_the_bytes(
    copy_harness: Path, dst_off: int, src_off: int, nbytes: int, group: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    buflen = max(dst_off, src_off) + nbytes + 64  # room for guard bytes past the copy
    src = rng.integers(0, 256, buflen, dtype=np.uint8).tobytes()
    dst = rng.integers(0, 256, buflen, dtype=np.uint8).tobytes()
    header = np.array([dst_off, src_off, nbytes, group, buflen], dtype=np.uint64).tobytes()
    proc = subprocess.run([copy_harness], input=header + src + dst, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    expected = dst[:dst_off] + src[src_off : src_off + nbytes] + dst[dst_off + nbytes :]
    assert proc.stdout == expected
