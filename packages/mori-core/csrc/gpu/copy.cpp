// mori.core._native.gpu: the host side of mori-core's generic batch copies between GPU memory
// regions, the per-batch work that would otherwise be several numpy passes and half a dozen
// Python-level driver calls. A batch is a gather table, one row (src, dst, bytes) per
// contiguous run (rows from mori.core.batch.Batch), that a caller-compiled kernel with the
// parameters below copies; or a list of copy-engine copies.
//
// - GatherLauncher: uploads such a table, launches the gather kernel and records an event, on
//   one stream, in three driver calls;
// - memcpy_batch: many copy-engine copies in one call.
//
// No CUDA headers: the driver's entry points come in as addresses (cuGetProcAddress through
// cuda-bindings), so this builds with no toolkit.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "base/registry.hpp"
#include "gpu/memcpy_batch.hpp"

namespace py = pybind11;

namespace mori::gpu {
namespace {

using U64Array = py::array_t<uint64_t, py::array::c_style>;

// Queues dsts[i] <- srcs[i] (sizes[i] bytes) on stream with one cuMemcpyBatchAsync (entry point
// `entry`); sources are read in stream order. Returns the CUresult.
int memcpy_batch_of(uintptr_t entry, const U64Array& dsts, const U64Array& srcs, const U64Array& sizes,
                    uintptr_t stream) {
    const py::ssize_t n = sizes.ndim() == 1 ? sizes.shape(0) : -1;
    if (entry == 0) throw py::value_error("memcpy_batch: null entry point");
    if (n < 1 || dsts.ndim() != 1 || srcs.ndim() != 1 || dsts.shape(0) != n || srcs.shape(0) != n)
        throw py::value_error("memcpy_batch: expected three 1-d uint64 arrays of one non-zero length");
    py::gil_scoped_release release;  // the driver queues each copy: ~0.5 us a copy on H200 hosts
    return memcpy_batch(entry, const_cast<uint64_t*>(dsts.data()), const_cast<uint64_t*>(srcs.data()),
                        reinterpret_cast<size_t*>(const_cast<uint64_t*>(sizes.data())), static_cast<size_t>(n), stream);
}

using LaunchFn = int (*)(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                         unsigned shmem, void* stream, void** params, void** extra);
using HtoDFn = int (*)(uint64_t dst, const void* src, size_t bytes, void* stream);
using RecordFn = int (*)(void* event, void* stream);

constexpr int kParams = 7;  // rows, items, per_row, piece, src0, dst0, bytes0: the kernel's parameters

// Launches a gather-table kernel on a stream: the caller compiles it (with NVRTC, say), taking
// (rows, items, per_row, piece, src0, dst0, bytes0) as its parameters.
class GatherLauncher {
public:
    GatherLauncher(uintptr_t launch, uintptr_t htod, uintptr_t record, uintptr_t function, unsigned threads,
                   unsigned maxBlocks)
        : launch_(reinterpret_cast<LaunchFn>(launch)),
          htod_(reinterpret_cast<HtoDFn>(htod)),
          record_(reinterpret_cast<RecordFn>(record)),
          function_(reinterpret_cast<void*>(function)),
          threads_(threads),
          maxBlocks_(maxBlocks) {
        if (!launch || !htod || !record || !function || threads == 0 || threads % 32 != 0 || maxBlocks == 0)
            throw py::value_error("GatherLauncher: null driver entry point or kernel, or a bad block shape");
    }

    unsigned grid(uint64_t warps) const {
        const uint64_t perBlock = threads_ / 32;
        return static_cast<unsigned>(
            std::max<uint64_t>(1, std::min<uint64_t>((warps + perBlock - 1) / perBlock, maxBlocks_)));
    }

    // Queues on stream: the upload of rows table rows (host -> device; none when rows == 0 and
    // single bytes > 0: one block passed by value), the kernel, then event (if not null).
    // Returns (CUresult, which call failed: "" on success).
    py::tuple launch(uintptr_t stream, uintptr_t tableHost, uint64_t tableDev, uint64_t rows, uint64_t perRow,
                     uint64_t piece, uint64_t src0, uint64_t dst0, uint64_t bytes0, uint64_t singlePiece,
                     uintptr_t event) {
        void* s = reinterpret_cast<void*>(stream);
        uint64_t args[kParams] = {};
        uint64_t warps = 0;
        if (rows > 0) {
            int rc = htod_(tableDev, reinterpret_cast<const void*>(tableHost), rows * 3 * sizeof(uint64_t), s);
            if (rc != 0) return py::make_tuple(rc, "cuMemcpyHtoDAsync");
            warps = rows * perRow;
            const uint64_t init[kParams] = {tableDev, warps, perRow, perRow > 1 ? piece : (1ull << 62), 0, 0, 0};
            std::copy(init, init + kParams, args);
        } else if (bytes0 > 0 && singlePiece > 0) {
            warps = (bytes0 + singlePiece - 1) / singlePiece;
            const uint64_t init[kParams] = {0, warps, warps, singlePiece, src0, dst0, bytes0};
            std::copy(init, init + kParams, args);
        }
        if (warps > 0) {  // nothing to copy: only the event
            void* params[kParams];
            for (int i = 0; i < kParams; ++i) params[i] = &args[i];
            int rc = launch_(function_, grid(warps), 1, 1, threads_, 1, 1, 0, s, params, nullptr);
            if (rc != 0) return py::make_tuple(rc, "cuLaunchKernel");
        }
        if (event != 0) {
            int rc = record_(reinterpret_cast<void*>(event), s);
            if (rc != 0) return py::make_tuple(rc, "cuEventRecord");
        }
        return py::make_tuple(0, "");
    }

private:
    LaunchFn launch_;
    HtoDFn htod_;
    RecordFn record_;
    void* function_;
    unsigned threads_, maxBlocks_;
};

mori::native::Registration reg([](py::module_& root) {
    py::module_ m = mori::native::submodule(root, "gpu", "host side of GPU batch copies and of GPU staging");
    py::list refusals;
    for (const int refusal : kBatchRefusals) refusals.append(refusal);
    m.attr("BATCH_REFUSALS") = py::tuple(refusals);
    m.def("memcpy_batch", &memcpy_batch_of, py::arg("entry"), py::arg("dsts"), py::arg("srcs"), py::arg("sizes"),
          py::arg("stream"),
          "Queues the copies with one cuMemcpyBatchAsync (CUDA 13 form, entry point from cuGetProcAddress), "
          "sources read in stream order; returns the CUresult.");
    py::class_<GatherLauncher>(
        m, "GatherLauncher",
        "Upload of a gather table + launch of the caller's gather kernel + event record, in one call.")
        .def(py::init<uintptr_t, uintptr_t, uintptr_t, uintptr_t, unsigned, unsigned>(), py::arg("cu_launch_kernel"),
             py::arg("cu_memcpy_htod_async"), py::arg("cu_event_record"), py::arg("function"), py::arg("threads"),
             py::arg("max_blocks"))
        .def("grid", &GatherLauncher::grid, py::arg("warps"), "Thread blocks for that many busy warps.")
        .def("launch", &GatherLauncher::launch, py::arg("stream"), py::arg("table_host"), py::arg("table_dev"),
             py::arg("rows"), py::arg("per_row"), py::arg("piece"), py::arg("src0"), py::arg("dst0"), py::arg("bytes0"),
             py::arg("single_piece"), py::arg("event"),
             "Queues the table upload, the kernel and the event record; returns (CUresult, failed call).");
});

}  // namespace
}  // namespace mori::gpu
