// UcxWindow (mori.core.ucx): a host put into a symmetric window in one native call. A window is
// a region that every rank registered alike (chunk k of it under memory id firstId + k) with the
// live blocks that may be written (LiveRanges), and for each rank the UcxPeer that reaches its
// copy (none for a rank reached otherwise). put() takes the plain case only (a range in one live
// block and one chunk, the source inside the local window, a rank with a peer): it checks, posts
// and waits with no Python step between, which on a fast transport is a large share of a small
// put (mori.shmem's shmem_putmem). Anything else it leaves to the caller, unchanged, whose
// general path checks again and says what is wrong.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <vector>

#include "host/live_ranges.hpp"
#include "base/registry.hpp"
#include "ucx/engine.hpp"

namespace py = pybind11;

namespace mori::ucx {
namespace {

class Window {
public:
    Window(std::shared_ptr<memory::LiveRanges> live, uint64_t base, uint64_t size, uint64_t reserved, uint64_t chunk,
           uint64_t firstId, bool gpu, std::vector<std::shared_ptr<Peer>> peers, double timeout)
        : live_(std::move(live)), base_(base), size_(size), reserved_(reserved), chunk_(chunk), firstId_(firstId),
          gpu_(gpu), peers_(std::move(peers)), timeout_(timeout) {
        if (!live_) throw std::invalid_argument("UcxWindow: live ranges are required");
        if (chunk_ == 0 || size_ % chunk_) throw std::invalid_argument("UcxWindow: chunk must divide size");
        if (reserved_ > size_) throw std::invalid_argument("UcxWindow: reserved exceeds size");
    }

    // (code, message) once the put ran; None when it is not the plain case (nothing happened).
    py::object put(py::handle dest, uint64_t src, uint64_t nbytes, py::handle rank) {
        uint64_t to;
        long r;
        if (!as_u64(dest, to) || !PyLong_CheckExact(rank.ptr())) return py::none();
        r = PyLong_AsLong(rank.ptr());
        if (r == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return py::none();
        }
        if (r < 0 || static_cast<size_t>(r) >= peers_.size() || !peers_[r] || nbytes == 0) return py::none();
        if (!inside(to, nbytes) || !inside(src, nbytes)) return py::none();
        const uint64_t off = to - base_, local = src - base_;
        if (off < reserved_ || !live_->find(off, nbytes)) return py::none();
        const uint64_t rIn = off % chunk_, lIn = local % chunk_;
        if (rIn + nbytes > chunk_ || lIn + nbytes > chunk_) return py::none();
        std::shared_ptr<Transfer> t;
        {
            py::gil_scoped_release release;
            t = peers_[r]->run_one(kOpWrite, firstId_ + local / chunk_, src, rIn, nbytes, firstId_ + off / chunk_, gpu_,
                                   timeout_);
        }
        const int code = t->code();
        return py::make_tuple(code, code == kSuccess ? std::string() : t->message());
    }

private:
    bool inside(uint64_t addr, uint64_t n) const { return addr >= base_ && n <= size_ && addr - base_ <= size_ - n; }
    static bool as_u64(py::handle h, uint64_t& out) {
        if (!PyLong_CheckExact(h.ptr())) return false;
        out = PyLong_AsUnsignedLongLong(h.ptr());
        if (out == static_cast<uint64_t>(-1) && PyErr_Occurred()) {
            PyErr_Clear();  // negative or too large: no address of the window
            return false;
        }
        return true;
    }

    std::shared_ptr<memory::LiveRanges> live_;
    uint64_t base_, size_, reserved_, chunk_, firstId_;
    bool gpu_;
    std::vector<std::shared_ptr<Peer>> peers_;
    double timeout_;
};

mori::native::Registration reg([](py::module_& root) {
    py::module_ m = mori::native::submodule(root, "ucx", "mori-core's UCX engine");
    py::class_<Window, std::shared_ptr<Window>>(m, "UcxWindow",
                                                "A symmetric window: a host put in one native call (see mori.core.ucx).")
        .def(py::init<std::shared_ptr<memory::LiveRanges>, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, bool,
                      std::vector<std::shared_ptr<Peer>>, double>(),
             py::arg("live"), py::arg("base"), py::arg("size"), py::arg("reserved"), py::arg("chunk"),
             py::arg("first_id"), py::arg("gpu"), py::arg("peers"), py::arg("timeout"))
        .def("put", &Window::put, py::arg("dest"), py::arg("src"), py::arg("nbytes"), py::arg("rank"),
             "(code, message) after writing nbytes from local address src to address dest of rank's copy, "
             "waited for up to the window's timeout (code IN_PROGRESS when it did not finish); None, with "
             "nothing done, when the call is not the plain case.");
});

}  // namespace
}  // namespace mori::ucx
