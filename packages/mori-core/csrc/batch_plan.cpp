// Python bindings of the batch planner (batch_plan.hpp): numpy in, numpy out, every argument
// checked (dtype, shape, value) before any memory is touched, each error a ValueError naming the
// argument. Large batches are planned without the GIL; small ones keep it (handing it back and
// forth would cost more than the work when other threads want it).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <optional>
#include <string>
#include <vector>

#include "batch_plan.hpp"
#include "registry.hpp"

namespace py = pybind11;

namespace mori::plan {
namespace {

using I64Array = py::array_t<int64_t, py::array::c_style>;
using U64Array = py::array_t<uint64_t, py::array::c_style>;

constexpr size_t kReleaseGilRows = 1 << 14;

// Runs f with the GIL released when the batch has n >= kReleaseGilRows rows.
template <class F>
auto maybe_without_gil(size_t n, F&& f) {
    std::optional<py::gil_scoped_release> release;
    if (n >= kReleaseGilRows) release.emplace();
    return f();
}

// Runs f, turning the planner's std::invalid_argument into a ValueError that starts with `fn`.
template <class F>
auto checked(const char* fn, F&& f) {
    try {
        return f();
    } catch (const std::invalid_argument& e) {
        throw py::value_error(std::string(fn) + ": " + e.what());
    }
}

// obj (an array, or a sequence numpy reads with its own dtype first) as an array of T, converted
// only where no value can change (int32 -> int64, not float -> int64); null when it cannot be.
template <class Array>
Array lossless(const py::object& obj) {
    py::array arr = py::array::ensure(obj);
    if (arr && arr.size() == 0 && !py::isinstance<Array>(arr))  // nothing to lose (an empty list is float64)
        return Array(std::vector<py::ssize_t>(arr.shape(), arr.shape() + arr.ndim()));
    Array a = arr ? Array::ensure(arr) : Array();
    if (!a) PyErr_Clear();
    return a;
}

// obj as a 1-d int64 array of n elements (n < 0: any length).
I64Array int64_arg(const char* fn, const py::object& obj, const char* name, py::ssize_t n = -1) {
    I64Array a = lossless<I64Array>(obj);
    if (!a || a.ndim() != 1 || (n >= 0 && a.shape(0) != n))
        throw py::value_error(std::string(fn) + ": " + name + " must be a 1-d int64 array" +
                              (n >= 0 ? " of " + std::to_string(n) + " elements" : std::string()));
    return a;
}

// obj as an (n, 3) uint64 array of rows (src, dst, bytes).
U64Array rows_arg(const char* fn, const py::object& obj) {
    U64Array a = lossless<U64Array>(obj);
    if (!a || a.ndim() != 2 || a.shape(1) != 3)
        throw py::value_error(std::string(fn) + ": rows must be an (n, 3) uint64 array of (src, dst, bytes)");
    return a;
}

uint64_t positive_arg(const char* fn, int64_t value, const char* name) {
    if (value <= 0) throw py::value_error(std::string(fn) + ": " + name + " must be > 0, got " + std::to_string(value));
    return static_cast<uint64_t>(value);
}

const Row* rows_of(const U64Array& a) { return reinterpret_cast<const Row*>(a.data()); }

// Writes the merged rows of a batch into out (a caller's pinned table, say); see merge_rows.
py::tuple gather_rows(uint64_t srcBase, uint64_t dstBase, const py::object& srcOffs, const py::object& dstOffs,
                      const py::object& sizes, const py::object& out) {
    const char* fn = "gather_rows";
    I64Array sz = int64_arg(fn, sizes, "sizes");
    const py::ssize_t n = sz.shape(0);
    I64Array so = int64_arg(fn, srcOffs, "src_offsets", n), dof = int64_arg(fn, dstOffs, "dst_offsets", n);
    // out is written in place: no conversion (a converted copy would take the rows).
    // out is written in place (the caller's pinned table): never converted, so checked as it is.
    const bool usable = py::isinstance<U64Array>(out) && (py::array(out).flags() & py::array::c_style) &&
                        py::array(out).writeable() && py::array(out).ndim() == 2 && py::array(out).shape(1) == 3 &&
                        py::array(out).shape(0) >= n;
    if (!usable)
        throw py::value_error("gather_rows: out must be a writable C-contiguous (capacity >= " + std::to_string(n) +
                              ", 3) uint64 array");
    U64Array table = py::reinterpret_borrow<U64Array>(out);
    Row* dst = reinterpret_cast<Row*>(table.mutable_data());
    const Merged m = checked(fn, [&] {
        return maybe_without_gil(n, [&] {
            return merge_rows(srcBase, dstBase, so.data(), dof.data(), sz.data(), static_cast<size_t>(n), dst);
        });
    });
    return py::make_tuple(m.rows, m.largest, m.smallest);
}

py::object stripe(const py::object& rowsObj, int64_t pieceArg) {
    const char* fn = "stripe_rows";
    U64Array rows = rows_arg(fn, rowsObj);
    const uint64_t piece = positive_arg(fn, pieceArg, "piece");
    const size_t n = static_cast<size_t>(rows.shape(0));
    const uint64_t count = checked(fn, [&] { return count_pieces(rows_of(rows), n, piece); });
    if (count == n) {  // no row cut and none empty: the rows themselves
        bool uncut = true;
        for (size_t i = 0; i < n && uncut; ++i) uncut = rows_of(rows)[i].bytes <= piece;
        if (uncut) return std::move(rows);
    }
    U64Array out({static_cast<py::ssize_t>(count), py::ssize_t{3}});
    Row* dst = reinterpret_cast<Row*>(out.mutable_data());
    maybe_without_gil(n, [&] {
        stripe_rows(rows_of(rows), n, piece, dst);
        return 0;
    });
    return std::move(out);
}

uint64_t count(const py::object& rowsObj, int64_t pieceArg) {
    const char* fn = "count_pieces";
    U64Array rows = rows_arg(fn, rowsObj);
    const uint64_t piece = positive_arg(fn, pieceArg, "piece");
    return checked(fn, [&] { return count_pieces(rows_of(rows), static_cast<size_t>(rows.shape(0)), piece); });
}

template <class T>
py::array_t<int64_t> int64_array_of(const std::vector<T>& v) {
    py::array_t<int64_t> a(static_cast<py::ssize_t>(v.size()));
    std::copy(v.begin(), v.end(), a.mutable_data());
    return a;
}

py::array_t<int64_t> deal(const py::object& rowsObj, int64_t runs, int64_t minRunBytes) {
    const char* fn = "deal_rows";
    U64Array rows = rows_arg(fn, rowsObj);
    const uint64_t r = positive_arg(fn, runs, "runs"), m = positive_arg(fn, minRunBytes, "min_run_bytes");
    const size_t n = static_cast<size_t>(rows.shape(0));
    return int64_array_of(checked(fn, [&] { return deal_rows(rows_of(rows), n, r, m); }));
}

py::tuple chunks(const py::object& local, const py::object& remote, const py::object& sizes, int64_t chunkBytes,
                 int64_t maxPieces) {
    const char* fn = "cut_chunks";
    I64Array sz = int64_arg(fn, sizes, "sizes");
    I64Array lo = int64_arg(fn, local, "local_offsets"), ro = int64_arg(fn, remote, "remote_offsets");
    if (lo.shape(0) != sz.shape(0) || ro.shape(0) != sz.shape(0))
        throw py::value_error("cut_chunks: batch lengths differ: " + std::to_string(lo.shape(0)) + ", " +
                              std::to_string(ro.shape(0)) + ", " + std::to_string(sz.shape(0)));
    const size_t n = static_cast<size_t>(sz.shape(0));
    Chunks c = checked(fn, [&] {
        return maybe_without_gil(n, [&] {
            return plan_chunks(lo.data(), ro.data(), sz.data(), n, chunkBytes, maxPieces);
        });
    });
    const py::ssize_t k = static_cast<py::ssize_t>(c.pieces.size());
    py::array_t<int64_t> pl(k), pr(k), ps(k), pp(k);
    int64_t *l = pl.mutable_data(), *r = pr.mutable_data(), *s = ps.mutable_data(), *p = pp.mutable_data();
    for (py::ssize_t i = 0; i < k; ++i) {
        const Piece& q = c.pieces[static_cast<size_t>(i)];
        l[i] = q.local, r[i] = q.remote, s[i] = q.size, p[i] = q.packed;
    }
    return py::make_tuple(pl, pr, ps, pp, int64_array_of(c.bounds));
}

mori::native::Registration reg([](py::module_& m) {
    m.def("gather_rows", &gather_rows, py::arg("src_base"), py::arg("dst_base"), py::arg("src_offsets"),
          py::arg("dst_offsets"), py::arg("sizes"), py::arg("out"),
          "Writes the rows (src_base + src_offsets[i], dst_base + dst_offsets[i], sizes[i]) of a batch into out, "
          "empty blocks dropped and runs contiguous on both sides merged; returns (rows, largest row, smallest "
          "row).");
    m.def("stripe_rows", &stripe, py::arg("rows"), py::arg("piece"),
          "Rows (n, 3) cut into pieces of at most `piece` bytes, empty rows dropped (the rows themselves when "
          "none is cut or empty).");
    m.def("count_pieces", &count, py::arg("rows"), py::arg("piece"),
          "How many pieces stripe_rows(rows, piece) gives.");
    m.def("deal_rows", &deal, py::arg("rows"), py::arg("runs"), py::arg("min_run_bytes") = 1,
          "Boundaries b (int64, b[0] = 0, b[-1] = len(rows)) of at most `runs` contiguous runs rows[b[i]:b[i+1]] "
          "of about equal bytes, no more runs than ceil(total bytes / min_run_bytes).");
    m.def("cut_chunks", &chunks, py::arg("local_offsets"), py::arg("remote_offsets"), py::arg("sizes"),
          py::arg("chunk_bytes"), py::arg("max_pieces"),
          "A batch cut at every multiple of chunk_bytes of its blocks laid end to end: (local, remote, sizes, "
          "packed, bounds) int64 arrays; chunk c is pieces bounds[c]:bounds[c+1], packed from 0.");
});

}  // namespace
}  // namespace mori::plan
