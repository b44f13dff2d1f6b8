// Python binding of the UCX engine's remote atomics (ucx/atomic.hpp): ucx_atomic in the ucx
// submodule, typed in _native/ucx.pyi and presented by mori.core.ucx_atomic.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <string>

#include "base/registry.hpp"
#include "gpu/staging.hpp"
#include "ucx/atomic.hpp"

namespace py = pybind11;

namespace {

mori::native::Registration reg([](py::module_& root) {
    py::module_ m = mori::native::submodule(root, "ucx", "mori-core's UCX engine");
    m.def(
        "ucx_atomic",
        [](mori::ucx::Engine& engine, mori::ucx::Peer& peer, int op, uint64_t memId, uint64_t offset, uint64_t value,
           uint64_t compare, int width, double timeout) {
            if (op < mori::kAtomicFetchAdd || op > mori::kAtomicLast)
                throw std::invalid_argument(
                    "op must be 1 (fetch_add), 2 (compare_swap), 3 (swap), 4 (store), "
                    "5 (fetch_and), 6 (fetch_or) or 7 (fetch_xor), got " +
                    std::to_string(op));
            py::gil_scoped_release release;
            return mori::ucx::remote_atomic(engine, peer, static_cast<mori::AtomicOp>(op), memId, offset, value,
                                            compare, width, timeout);
        },
        py::arg("engine"), py::arg("peer"), py::arg("op"), py::arg("mem_id"), py::arg("offset"), py::arg("value"),
        py::arg("compare"), py::arg("width"), py::arg("timeout"),
        "Applies op (1 fetch_add, 2 compare_swap, 3 swap, 4 store, 5 fetch_and, 6 fetch_or, 7 fetch_xor) to the "
        "width-bit word at offset of the peer's "
        "memory mem_id; returns its old value. ValueError when the target refused, RuntimeError when the peer "
        "failed or did not answer within timeout seconds.");
    m.attr("UCX_MAX_SIGNAL_PUT_BYTES") = mori::ucx::kMaxSignalPutBytes;
    m.def(
        "ucx_signal_put",
        [](mori::ucx::Engine& engine, mori::ucx::Peer& peer, uint64_t memId, uint64_t offset, uintptr_t src,
           size_t size, uint64_t sigMemId, uint64_t sigOffset, int op, uint64_t value, double timeout) {
            py::gil_scoped_release release;
            const mori::ucx::SignalPut put{memId,    offset,    reinterpret_cast<const void*>(src), size,
                                           sigMemId, sigOffset, static_cast<mori::AtomicOp>(op),    value};
            mori::ucx::remote_signal_put(engine, peer, put, timeout);
        },
        py::arg("engine"), py::arg("peer"), py::arg("mem_id"), py::arg("offset"), py::arg("src"), py::arg("size"),
        py::arg("sig_mem_id"), py::arg("sig_offset"), py::arg("op"), py::arg("value"), py::arg("timeout"),
        "Writes size bytes from host address src at offset of the peer's memory mem_id, then applies op (1 "
        "fetch_add, 4 store) with value to the 64-bit word at sig_offset of its memory sig_mem_id, in one message; "
        "errors as ucx_atomic's. size is at most UCX_MAX_SIGNAL_PUT_BYTES.");
    py::list entryPoints;
    for (const auto& [name, field] : mori::gpu::kDriverEntryPoints) entryPoints.append(name);
    for (const auto& [name, field] : mori::ucx::kGpuWordsEntryPoints) entryPoints.append(name);
    m.attr("UCX_GPU_ENTRY_POINTS") = py::tuple(entryPoints);
    m.def(
        "ucx_serve_gpu",
        [](mori::ucx::Engine& engine, uintptr_t context, uintptr_t function, uintptr_t stream, uintptr_t result,
           uintptr_t resultDev, const std::map<std::string, uintptr_t>& entryPoints, uintptr_t bounce,
           size_t bounceBytes, bool stage) {
            mori::ucx::GpuWordsConfig c;
            c.context = context;
            c.function = function;
            c.stream = stream;
            c.result = result;
            c.resultDev = resultDev;
            const auto entry = [&entryPoints](const char* name) {
                const auto it = entryPoints.find(name);
                if (it == entryPoints.end())
                    throw std::invalid_argument(std::string("entry_points has no ") + name + " (UCX_GPU_ENTRY_POINTS)");
                return it->second;
            };
            for (const auto& [name, field] : mori::gpu::kDriverEntryPoints) c.driver.*field = entry(name);
            for (const auto& [name, field] : mori::ucx::kGpuWordsEntryPoints) c.*field = entry(name);
            c.bounce = bounce;
            c.bounceBytes = bounceBytes;
            c.stage = stage;
            c.timeout = engine.options().timeout;  // the engine's: every wait of its handlers is bounded alike
            c.timeoutSetting = engine.options().timeoutSetting;
            engine.set_gpu_words(std::make_shared<mori::ucx::GpuWords>(c));
        },
        py::arg("engine"), py::arg("context"), py::arg("function"), py::arg("stream"), py::arg("result"),
        py::arg("result_dev"), py::arg("entry_points"), py::arg("bounce"), py::arg("bounce_bytes"), py::arg("stage"),
        "Serves remote atomics and signal puts on the engine's GPU regions with this kernel, stream and result "
        "word, copying small blocks through the pinned bounce buffer; with stage, every transfer of GPU memory is "
        "staged through pinned host memory of the context, kept for reuse (handles as addresses, entry_points "
        "the address of each driver function of UCX_GPU_ENTRY_POINTS by name; see "
        "mori.core.ucx_atomic.serve_gpu).");
    m.def(
        "ucx_stage_gpu",
        [](mori::ucx::Engine& engine, std::shared_ptr<mori::gpu::Stager> stager) {
            engine.set_gpu_words(std::make_shared<mori::ucx::GpuWords>(std::move(stager)));
        },
        py::arg("engine"), py::arg("stager"),
        "Stages every transfer of the engine's GPU memory through `stager` (a mori.core.staging Stager, shared "
        "with the caller's other data planes); atomics and signal puts on GPU memory stay refused. Undone by "
        "ucx_stop_serving_gpu (which leaves the stager open).");
    m.def(
        "ucx_stop_serving_gpu",
        [](mori::ucx::Engine& engine) {
            const std::shared_ptr<mori::ucx::GpuWords> g = engine.gpu_words();
            engine.set_gpu_words(nullptr);
            if (g) {
                py::gil_scoped_release nogil;
                g->close_staging();
            }
        },
        py::arg("engine"),
        "Refuses remote atomics and signal puts on GPU regions again and frees the staging memory (waiting, at "
        "most the engine's timeout, for transfers still using it), before the context goes.");
});

}  // namespace
