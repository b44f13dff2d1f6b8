// mori.core._native.gpu: Stager and Staged (staging.hpp) for Python, and the host stand-in of
// the driver (host_standin.hpp) that tests run the staging on where there is no GPU. Every call
// that can wait for the GPU releases the GIL.
#include <pybind11/stl.h>

#include <map>

#include "base/registry.hpp"
#include "gpu/host_standin.hpp"
#include "gpu/staging.hpp"

namespace py = pybind11;
using namespace mori::gpu;

namespace {

py::dict stats_dict(const PoolStats& s) {
    py::dict d;
    d["lent"] = s.lent;
    d["cached_bytes"] = s.cachedBytes;
    d["pinned"] = s.pinned;
    d["reused"] = s.reused;
    d["freed"] = s.freed;
    d["unpinned"] = s.unpinned;
    d["abandoned"] = s.abandoned;
    d["to_host"] = s.toHost;
    d["to_host_bytes"] = s.toHostBytes;
    d["to_device"] = s.toDevice;
    d["to_device_bytes"] = s.toDeviceBytes;
    d["copy_ns"] = s.copyNs;
    d["wait_ns"] = s.waitNs;
    d["queue_ns"] = s.queueNs;
    return d;
}

std::shared_ptr<Staged> held(Staged&& s) { return std::make_shared<Staged>(std::move(s)); }

mori::native::Registration reg([](py::module_& root) {
    py::module_ m = mori::native::submodule(root, "gpu", "host side of GPU batch copies and of GPU staging");
    py::list names;
    for (const auto& [name, field] : kDriverEntryPoints) names.append(name);
    m.attr("STAGING_ENTRY_POINTS") = py::tuple(names);
    py::list optional;
    for (const auto& [name, field] : kOptionalDriverEntryPoints) optional.append(name);
    m.attr("STAGING_OPTIONAL_ENTRY_POINTS") = py::tuple(optional);
    m.attr("STAGING_CACHE_BYTES") = kDefaultCacheBytes;

    py::class_<Staged, std::shared_ptr<Staged>>(m, "Staged", "Host memory that staged bytes pass through.")
        .def_property_readonly("address", [](const Staged& s) { return reinterpret_cast<uintptr_t>(s.data()); })
        .def_property_readonly("size", &Staged::size)
        .def_property_readonly("pinned", &Staged::pinned, "Lent by the pool (else heap memory: pinning failed).")
        .def("copied", &Staged::copied, py::call_guard<py::gil_scoped_release>(),
             "Whether its copy has ended; raises when it failed or outlived the timeout.")
        .def("wait", &Staged::wait, py::call_guard<py::gil_scoped_release>(), "Until copied(); raises as it.")
        .def("release", &Staged::clear, "Gives the memory back to the pool (now, not when collected).");

    py::class_<Stager, std::shared_ptr<Stager>>(m, "Stager",
                                                "GPU memory staged through pinned host memory (mori.core.staging).")
        .def(py::init([](uintptr_t context, const std::vector<uintptr_t>& streams,
                         const std::map<std::string, uintptr_t>& entryPoints, double timeout,
                         const std::string& timeoutSetting, size_t cacheBytes, const std::string& owner) {
                 StagingConfig c;
                 c.context = context;
                 c.streams = streams;
                 for (const auto& [name, field] : kDriverEntryPoints) {
                     const auto it = entryPoints.find(name);
                     if (it == entryPoints.end())
                         throw py::value_error(std::string("entry_points has no ") + name + " (STAGING_ENTRY_POINTS)");
                     c.driver.*field = it->second;
                 }
                 for (const auto& [name, field] : kOptionalDriverEntryPoints) {
                     const auto it = entryPoints.find(name);
                     if (it != entryPoints.end()) c.driver.*field = it->second;
                 }
                 c.timeout = timeout;
                 c.timeoutSetting = timeoutSetting;
                 c.cacheBytes = cacheBytes;
                 c.owner = owner;
                 return std::make_shared<Stager>(std::move(c));
             }),
             py::arg("context"), py::arg("streams"), py::arg("entry_points"), py::arg("timeout"),
             py::arg("timeout_setting") = "timeout", py::arg("cache_bytes") = kDefaultCacheBytes,
             py::arg("owner") = "mori",
             "Stages through pinned memory of `context` on `streams` (its lanes: a thread's copies take one; "
             "handles as addresses; entry_points: the address of each driver function of STAGING_ENTRY_POINTS "
             "by name, and of those of STAGING_OPTIONAL_ENTRY_POINTS the driver has).")
        .def(
            "to_host",
            [](Stager& s, uint64_t src, size_t bytes, bool wait) {
                Staged out;
                {
                    py::gil_scoped_release nogil;
                    out = s.to_host(src, bytes, wait);
                }
                return held(std::move(out));
            },
            py::arg("src"), py::arg("nbytes"), py::arg("wait") = true,
            "Staged memory holding nbytes copied from device address src (waited for unless wait is False).")
        .def(
            "landing",
            [](Stager& s, size_t bytes) {
                Staged out;
                {
                    py::gil_scoped_release nogil;
                    out = s.landing(bytes);
                }
                return held(std::move(out));
            },
            py::arg("nbytes"), "Staged memory to receive nbytes into.")
        .def(
            "to_device",
            [](Stager& s, uint64_t dst, Staged& src, bool wait) {
                py::gil_scoped_release nogil;
                s.to_device(dst, src, wait);
            },
            py::arg("dst"), py::arg("staged"), py::arg("wait") = true,
            "Copies staged bytes to device address dst (waited for unless wait is False).")
        .def(
            "to_device_then_store",
            [](Stager& s, uint64_t dst, Staged& src, uint64_t word, uint64_t value, bool wait) {
                py::gil_scoped_release nogil;
                s.to_device_then_store(dst, src, word, value, wait);
            },
            py::arg("dst"), py::arg("staged"), py::arg("word"), py::arg("value"), py::arg("wait") = true,
            "to_device, then the 64-bit value stored at device address word (8-byte aligned) behind the copy on "
            "its stream, visible after the copied bytes (a signal after its data); the staged memory's wait and "
            "copied() tell the end of both.")
        .def(
            "gather_to_host",
            [](Stager& s, const std::vector<std::pair<uint64_t, uint64_t>>& ranges, bool wait) {
                std::vector<DeviceRange> rs;
                for (const auto& [addr, bytes] : ranges) rs.push_back(DeviceRange{addr, bytes});
                Staged out;
                {
                    py::gil_scoped_release nogil;
                    out = s.to_host(rs.data(), rs.size(), wait);
                }
                return held(std::move(out));
            },
            py::arg("ranges"), py::arg("wait") = true,
            "Staged memory holding the bytes of ranges [(device address, nbytes), ...] one after another, "
            "copied as one (one driver call where the driver has cuMemcpyBatchAsync).")
        .def(
            "scatter_to_device",
            [](Stager& s, const std::vector<std::pair<uint64_t, uint64_t>>& ranges, Staged& src, bool wait) {
                std::vector<DeviceRange> rs;
                for (const auto& [addr, bytes] : ranges) rs.push_back(DeviceRange{addr, bytes});
                py::gil_scoped_release nogil;
                s.to_device(rs.data(), rs.size(), src, wait);
            },
            py::arg("ranges"), py::arg("staged"), py::arg("wait") = true,
            "Copies staged bytes, one range after another, to ranges [(device address, nbytes), ...] as one "
            "copy; ValueError when the staged memory holds fewer bytes than the ranges.")
        .def(
            "stats", [](const Stager& s) { return stats_dict(s.stats()); },
            "What the pool has done: lent, cached_bytes, pinned, reused, freed, unpinned, abandoned; and its "
            "copies: to_host, to_host_bytes, to_device, to_device_bytes, copy_ns (queued to seen ended, "
            "summed), wait_ns (callers blocked on copies, summed), queue_ns (callers queueing copies, summed).")
        .def("check_device_memory", &Stager::check_device_memory, py::arg("addr"), py::arg("nbytes"),
             "ValueError unless [addr, addr + nbytes) is CUDA device memory.")
        .def_property_readonly("cache_bytes", [](const Stager& s) { return s.config().cacheBytes; })
        .def_property_readonly("lanes", [](const Stager& s) { return s.config().streams.size(); })
        .def_property_readonly("batched", &Stager::batched,
                               "Whether copies of several ranges go in one cuMemcpyBatchAsync (False where the "
                               "driver lacks it or refused it: one call per range).")
        .def("close", &Stager::close, py::call_guard<py::gil_scoped_release>(),
             "Waits (at most the timeout) for memory still lent, then frees the pool's.");

    m.def(
        "host_standin_stager",
        [](double timeout, size_t cacheBytes) {
            return std::make_shared<Stager>(standin::config(timeout, cacheBytes));
        },
        py::arg("timeout") = 30.0, py::arg("cache_bytes") = kDefaultCacheBytes,
        "A Stager whose driver is the host stand-in: device addresses are host addresses.");
    m.def(
        "host_standin_knobs",
        [](int64_t failCopyIn, bool failPinning, double delay, bool hang, bool failLater, bool refuseBatch) {
            standin::set_knobs(standin::Knobs{failCopyIn, failPinning, delay, hang, failLater, refuseBatch});
        },
        py::arg("fail_copy_in") = -1, py::arg("fail_pinning") = false, py::arg("delay") = 0.0, py::arg("hang") = false,
        py::arg("fail_later") = false, py::arg("refuse_batch") = false,
        "How the stand-in misbehaves from now on: the copy after fail_copy_in more fails (-1: none; a batch "
        "call counts as one), every pinning fails, copies end `delay` seconds after they are queued, or never "
        "(hang), or fail as they run (fail_later: the stream's query says so), or the batch call is refused "
        "(refuse_batch: CUDA_ERROR_NOT_SUPPORTED, as a driver without it would).");
    m.def(
        "host_standin_counters",
        [] {
            const standin::Counters c = standin::counters();
            py::dict d;
            d["copies"] = c.copies;
            d["batches"] = c.batches;
            d["largest_batch"] = c.largestBatch;
            d["copied_bytes"] = c.copiedBytes;
            d["allocations"] = c.allocations;
            d["frees"] = c.frees;
            d["pushes"] = c.pushes;
            return d;
        },
        "What the stand-in has done in this process: copies (driver calls; a batch counts once), batches "
        "(of them, cuMemcpyBatchAsync calls), largest_batch (the most copies one batch call took), copied_bytes, "
        "allocations, frees, pushes (contexts pushed by staging calls on threads that did not have it current).");
    m.def("host_standin_make_current", &standin::make_current,
          "Makes the stand-in's context current on the calling thread, as an application would.");
});

}  // namespace
