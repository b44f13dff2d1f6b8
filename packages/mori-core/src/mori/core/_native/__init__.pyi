# Types of the compiled module mori.core._native (csrc/**/*.cpp, a folder per plane), for type
# checkers: one stub a submodule, each named after its C++ namespace and re-exported by the public
# module of that name (mori.core.atomics, .batch, .gpu, .inbound, .memory, .tcp, .ucx; .ucx_atomic
# too; .codes is checked against by mori.core.codes). tests/test_native_stub.py keeps
# these stubs and the module in step (every public name on both sides, the same parameter names).
from . import atomics as atomics
from . import batch as batch
from . import codes as codes
from . import gpu as gpu
from . import inbound as inbound
from . import memory as memory
from . import tcp as tcp
from . import ucx as ucx

ABI_VERSION: int
