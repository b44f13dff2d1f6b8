// mori.core._native.batch: the Batch value (batch/batch.hpp) for Python, built from Python sequences of
// ints or anything with the buffer protocol (numpy arrays, array.array, memoryview; no numpy
// needed), every value checked before a row holds it: a TypeError for what is not integers,
// a ValueError naming the column and index for a negative value, one past 64 bits, a block past
// 2^64 or columns of different lengths. Lists and tuples of ints are read straight into the rows
// (no column copies); buffers of 64-bit integers are read in place, strided or not. Large
// batches from buffers are merged without the GIL; small ones keep it (handing it back and forth
// would cost more than the work when other threads want it).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "base/registry.hpp"
#include "batch/batch.hpp"

namespace py = pybind11;

namespace mori::plan {
namespace {

constexpr size_t kReleaseGilRows = 1 << 14;

// Runs f, turning the planner's std::invalid_argument into a ValueError that starts with `fn`.
template <class F>
auto checked(const char* fn, F&& f) {
    try {
        return f();
    } catch (const std::invalid_argument& e) {
        throw py::value_error(std::string(fn) + ": " + e.what());
    }
}

[[noreturn]] void fail(PyObject* type, const std::string& msg) {
    PyErr_SetString(type, ("Batch: " + msg).c_str());
    throw py::error_already_set();
}

// obj as a numpy array of native-order integers (the common case, read without the buffer
// protocol, which costs a format string a call); nullopt for anything else, numpy or not
// (those take the buffer protocol and its checks). numpy's API is touched only for an object
// that is a numpy array, so numpy is never imported here.
std::optional<py::array> numpy_ints(const py::handle& obj) {
    if (std::strcmp(Py_TYPE(obj.ptr())->tp_name, "numpy.ndarray") != 0) return std::nullopt;
    auto a = py::reinterpret_borrow<py::array>(obj);
    const py::dtype dt = a.dtype();
    const char order = dt.byteorder();
    const bool native = order == '=' || order == '|' || (order == '<') == (PY_LITTLE_ENDIAN != 0);
    if ((dt.kind() != 'i' && dt.kind() != 'u') || !native) return std::nullopt;
    return a;
}

// Python int `obj` (or anything operator.index takes, but not a bool), item i of column `name`,
// as a uint64; TypeError or ValueError (negative, past 64 bits) naming both otherwise.
[[gnu::noinline]] uint64_t int_item_slow(PyObject* obj, const char* name, size_t i) {
    const py::object held = py::reinterpret_borrow<py::object>(obj);  // __index__ may drop it from its list
    py::object owned;
    if (!PyLong_CheckExact(obj)) {
        if (PyBool_Check(obj))  // an int to Python, but never a meaningful offset or size
            fail(PyExc_TypeError, std::string(name) + " must be ints, got bool at index " + std::to_string(i));
        owned = py::reinterpret_steal<py::object>(PyNumber_Index(obj));
        if (!owned) {
            PyErr_Clear();
            fail(PyExc_TypeError, std::string(name) + " must be a sequence of ints, got " + Py_TYPE(obj)->tp_name +
                                      " at index " + std::to_string(i));
        }
        obj = owned.ptr();
    }
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow == 0 && v >= 0) return static_cast<uint64_t>(v);
    if (overflow <= 0)
        fail(PyExc_ValueError,
             std::string(name) + "[" + std::to_string(i) + "] is negative (" + py::str(obj).cast<std::string>() + ")");
    const unsigned long long u = PyLong_AsUnsignedLongLong(obj);  // overflow > 0: at least 2^63
    if (u == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
        PyErr_Clear();
        fail(PyExc_ValueError, std::string(name) + "[" + std::to_string(i) + "] = " + py::str(obj).cast<std::string>() +
                                   " does not fit in 64 bits");
    }
    return static_cast<uint64_t>(u);
}

// Columns of n items each, every one a list or tuple (exactly: read in place), their items read
// as uint64: an int of 0..2^63 - 1 (every offset and size of a real batch) inline, the per-item
// cost of a list batch; anything else through int_item_slow, after which every column's items
// are found afresh (an __index__ method may have changed a list): ValueError when a length
// changed.
class ItemColumns {
public:
    static constexpr int kMax = 3;

    ItemColumns(const py::handle* cols, const char* const* names, int count, size_t n) : count_(count), n_(n) {
        for (int c = 0; c < count; ++c) seqs_[c] = cols[c].ptr(), names_[c] = names[c];
        refresh();
    }

    uint64_t at(int c, size_t i) {
        PyObject* obj = items_[c][i];
        if (PyLong_CheckExact(obj)) {
#if PY_VERSION_HEX >= 0x030C0000
            if (PyUnstable_Long_IsCompact(reinterpret_cast<PyLongObject*>(obj))) {  // below 2^30: no call
                const Py_ssize_t v = PyUnstable_Long_CompactValue(reinterpret_cast<PyLongObject*>(obj));
                if (v >= 0) return static_cast<uint64_t>(v);
            }
#endif
            int overflow = 0;
            const long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
            if (overflow == 0 && v >= 0) return static_cast<uint64_t>(v);
        }
        const uint64_t v = int_item_slow(obj, names_[c], i);
        refresh();
        return v;
    }

private:
    void refresh() {
        for (int c = 0; c < count_; ++c) {
            if (static_cast<size_t>(PySequence_Fast_GET_SIZE(seqs_[c])) != n_)
                fail(PyExc_ValueError, std::string(names_[c]) + " changed length while it was read");
            items_[c] = PySequence_Fast_ITEMS(seqs_[c]);
        }
    }

    PyObject* seqs_[kMax] = {};
    PyObject** items_[kMax] = {};
    const char* names_[kMax] = {};
    int count_;
    size_t n_;
};

// One column of a batch: borrowed from a caller's buffer of 64-bit integers (int64 or uint64,
// read in place at its stride when that is a whole number of items) or converted into `owned`
// (uint64, contiguous, every value checked >= 0).
class Column {
public:
    Column(const py::handle& obj, const char* name) : name_(name) {
        if (auto a = numpy_ints(obj)) {
            if (a->ndim() != 1)
                fail(PyExc_ValueError,
                     std::string(name) + " must be 1-d, got " + std::to_string(a->ndim()) + " dimensions");
            read(a->data(), static_cast<size_t>(a->shape(0)), a->strides(0), a->itemsize(), a->dtype().kind() == 'i');
        } else if (PyObject_CheckBuffer(obj.ptr())) {
            from_buffer(obj);
        } else if (PyList_Check(obj.ptr()) || PyTuple_Check(obj.ptr())) {
            from_items(obj);
        } else if (PySequence_Check(obj.ptr()) && !PyUnicode_Check(obj.ptr())) {  // range, other sequences
            py::object fast = py::reinterpret_steal<py::object>(PySequence_Fast(obj.ptr(), name));
            if (!fast) throw py::error_already_set();
            from_items(fast);
        } else {
            fail(PyExc_TypeError, std::string(name) + " must be a sequence of ints or an integer array, got " +
                                      Py_TYPE(obj.ptr())->tp_name);
        }
    }
    ~Column() {
        if (view_.obj) PyBuffer_Release(&view_);
    }
    Column(const Column&) = delete;
    Column& operator=(const Column&) = delete;

    size_t size() const { return n_; }
    ptrdiff_t stride() const { return stride_; }  // in items
    bool is_int64() const { return signed_; }
    const int64_t* int64s() const { return static_cast<const int64_t*>(data_); }
    const uint64_t* uint64s() const { return static_cast<const uint64_t*>(data_); }

    // Makes the column uint64 (an int64 column copied, a negative value refused).
    void to_uint64() {
        if (!signed_) return;
        const int64_t* v = int64s();
        std::vector<uint64_t> out(n_);
        for (size_t i = 0; i < n_; ++i) {
            const int64_t x = v[static_cast<ptrdiff_t>(i) * stride_];
            if (x < 0) negative(i, std::to_string(x));
            out[i] = static_cast<uint64_t>(x);
        }
        owned_ = std::move(out);
        data_ = owned_.data();
        stride_ = 1;
        signed_ = false;
    }

private:
    [[noreturn]] void negative(size_t i, const std::string& value) const {
        fail(PyExc_ValueError, std::string(name_) + "[" + std::to_string(i) + "] is negative (" + value + ")");
    }

    void from_items(const py::handle& seq) {
        n_ = static_cast<size_t>(PySequence_Fast_GET_SIZE(seq.ptr()));
        ItemColumns items(&seq, &name_, 1, n_);
        owned_.resize(n_);
        for (size_t i = 0; i < n_; ++i) owned_[i] = items.at(0, i);
        data_ = owned_.data();
    }

    void from_buffer(const py::handle& obj) {
        if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_STRIDES | PyBUF_FORMAT) != 0) {
            view_.obj = nullptr;
            PyErr_Clear();
            fail(PyExc_TypeError, std::string(name_) + ": its buffer cannot be read as an array");
        }
        if (view_.ndim != 1)
            fail(PyExc_ValueError,
                 std::string(name_) + " must be 1-d, got " + std::to_string(view_.ndim) + " dimensions");
        std::string fmt = view_.format ? view_.format : "B";
        const char order = fmt.empty() ? '@' : fmt[0];
        if (order == '@' || order == '=' || order == '<' || order == '>' || order == '!') fmt.erase(0, 1);
        const bool little = order != '>' && order != '!';
        const bool ints = fmt.size() == 1 && std::strchr("bBhHiIlLqQnN", fmt[0]) != nullptr;
        const Py_ssize_t width = view_.itemsize;
        if (!ints || (width != 1 && width != 2 && width != 4 && width != 8))
            fail(PyExc_TypeError, std::string(name_) + " must hold integers, got buffer format '" +
                                      (view_.format ? view_.format : "") + "'");
        if (!little && width > 1)
            fail(PyExc_TypeError, std::string(name_) + " must be in this machine's byte order (little-endian)");
        read(view_.buf, static_cast<size_t>(view_.shape[0]), view_.strides[0], width,
             std::islower(static_cast<unsigned char>(fmt[0])) != 0);
    }

    // n integers of `width` bytes, `stride` bytes apart from buf: borrowed when they are 64-bit
    // and aligned to their stride, else copied into owned_ as uint64 (a negative value refused).
    void read(const void* buf, size_t n, Py_ssize_t stride, Py_ssize_t width, bool isSigned) {
        n_ = n;
        signed_ = isSigned;
        if (width == 8 && (n_ <= 1 || stride % 8 == 0) && reinterpret_cast<uintptr_t>(buf) % 8 == 0) {  // no copy
            data_ = buf;
            stride_ = n_ <= 1 ? 1 : stride / 8;
            return;
        }
        owned_.resize(n_);
        const char* base = static_cast<const char*>(buf);
        for (size_t i = 0; i < n_; ++i) {
            const char* p = base + static_cast<Py_ssize_t>(i) * stride;
            if (signed_) {
                const int64_t v = width == 1   ? load<int8_t>(p)
                                  : width == 2 ? load<int16_t>(p)
                                  : width == 4 ? load<int32_t>(p)
                                               : load<int64_t>(p);
                if (v < 0) negative(i, std::to_string(v));
                owned_[i] = static_cast<uint64_t>(v);
            } else {
                owned_[i] = width == 1   ? load<uint8_t>(p)
                            : width == 2 ? load<uint16_t>(p)
                            : width == 4 ? load<uint32_t>(p)
                                         : load<uint64_t>(p);
            }
        }
        data_ = owned_.data();
        signed_ = false;
    }

    // One element of a buffer (which need not be aligned).
    template <class T>
    static T load(const char* p) {
        T v;
        std::memcpy(&v, p, sizeof(T));
        return v;
    }

    const char* name_;
    Py_buffer view_{};
    std::vector<uint64_t> owned_;
    const void* data_ = nullptr;
    size_t n_ = 0;
    ptrdiff_t stride_ = 1;  // items between one value and the next
    bool signed_ = false;   // data_ holds int64 (else uint64)
};

// Runs f holding the GIL: a batch may be dropped by C++ code that released it (taking it is a
// thread-state lookup, skipped where this thread holds it already, the usual case).
template <class F>
void with_gil(F&& f) {
    if (PyGILState_Check()) {
        f();
    } else {
        py::gil_scoped_acquire gil;
        f();
    }
}

// A caller's table (out) as the store of a batch of up to n rows: a writable C-contiguous
// (>= n, 3) buffer of uint64. The store holds the buffer (so its object) until the last batch
// reading it is gone.
std::shared_ptr<Row[]> table_store(const py::handle& out, size_t n) {
    struct Held {
        Py_buffer view{};
        ~Held() {
            if (view.obj) with_gil([this] { PyBuffer_Release(&view); });
        }
    };
    const std::string bad =
        "out must be a writable C-contiguous uint64 array of (>= " + std::to_string(n) + ", 3) rows";
    if (auto a = numpy_ints(out)) {  // numpy's table: checked on the array, no buffer export
        struct Ref {                 // a reference to the array, dropped with the GIL
            PyObject* obj;
            explicit Ref(PyObject* o) : obj(o) {}
            Ref(const Ref&) = delete;
            Ref& operator=(const Ref&) = delete;
            ~Ref() {
                with_gil([this] { Py_DECREF(obj); });
            }
        };
        if (a->dtype().kind() != 'u' || a->itemsize() != 8 || a->ndim() != 2 || a->shape(1) != 3 ||
            static_cast<size_t>(a->shape(0)) < n || !a->writeable() || !(a->flags() & py::array::c_style))
            fail(PyExc_ValueError, bad);
        auto ref = std::make_shared<Ref>(a->inc_ref().ptr());
        return std::shared_ptr<Row[]>(ref, static_cast<Row*>(a->mutable_data()));
    }
    auto held = std::make_shared<Held>();
    if (PyObject_GetBuffer(out.ptr(), &held->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
        held->view.obj = nullptr;
        PyErr_Clear();
    }
    const Py_buffer& v = held->view;
    std::string fmt = v.obj && v.format ? v.format : "";
    if (!fmt.empty() && std::strchr("@=<", fmt[0])) fmt.erase(0, 1);
    if (!v.obj || v.itemsize != 8 || (fmt != "Q" && fmt != "L") || v.ndim != 2 || v.shape[1] != 3 ||
        static_cast<size_t>(v.shape[0]) < n)
        fail(PyExc_ValueError, bad);
    return std::shared_ptr<Row[]>(held, static_cast<Row*>(held->view.buf));
}

// Whether obj is a list or tuple (exactly: PySequence_Fast reads it in place).
bool is_items(const py::handle& obj) { return PyList_CheckExact(obj.ptr()) || PyTuple_CheckExact(obj.ptr()); }

[[noreturn]] void lengths_differ(size_t s, size_t d, size_t z) {
    fail(PyExc_ValueError, "lengths differ: " + std::to_string(s) + " src_offsets, " + std::to_string(d) +
                               " dst_offsets, " + std::to_string(z) + " sizes");
}

// Three lists or tuples of ints of n items (the batch Python code writes): each block read and
// written as a row at once, no column copied. Blocks are checked as they are read (a block past
// 2^64 named by its index, as merge_rows does).
Batch read_items(const py::handle& so, const py::handle& dof, const py::handle& sz, size_t n, uint64_t srcBase,
                 uint64_t dstBase, std::shared_ptr<Row[]> store) {
    if (!store && n) store.reset(new Row[n]);  // not zeroed: the writer writes what is read
    RowWriter rows(store.get());
    const py::handle cols[] = {so, dof, sz};
    const char* const names[] = {"src_offsets", "dst_offsets", "sizes"};
    ItemColumns items(cols, names, 3, n);
    const bool highBases = ((srcBase | dstBase) >> 63) != 0;
    for (size_t i = 0; i < n; ++i) {
        const uint64_t s = items.at(0, i), d = items.at(1, i), z = items.at(2, i);
        if (((s | d | z) >> 62) != 0 || highBases) {  // rare: only then can the block wrap
            const std::string why = block_error(srcBase, dstBase, s, d, z, i);
            if (!why.empty()) fail(PyExc_ValueError, why);
        }
        rows.add(srcBase + s, dstBase + d, z);
    }
    try {
        return Batch::written(std::move(store), rows.finish());
    } catch (const std::invalid_argument& e) {
        fail(PyExc_ValueError, e.what());
    }
}

Batch build(const py::object& so, const py::object& dof, const py::object& sz, uint64_t srcBase, uint64_t dstBase,
            const py::object& out) {
    if (is_items(so) && is_items(dof) && is_items(sz)) {
        const size_t ns = py::len(so), nd = py::len(dof), nz = py::len(sz);
        if (ns != nd || ns != nz) lengths_differ(ns, nd, nz);
        return read_items(so, dof, sz, nz, srcBase, dstBase, out.is_none() ? nullptr : table_store(out, nz));
    }
    Column s(so, "src_offsets"), d(dof, "dst_offsets"), z(sz, "sizes");
    if (s.size() != d.size() || s.size() != z.size()) lengths_differ(s.size(), d.size(), z.size());
    const size_t n = z.size();
    std::shared_ptr<Row[]> store = out.is_none() ? nullptr : table_store(out, n);
    const bool int64 = s.is_int64() && d.is_int64() && z.is_int64();
    if (!int64) {
        s.to_uint64();
        d.to_uint64();
        z.to_uint64();
    }
    std::optional<py::gil_scoped_release> release;
    if (n >= kReleaseGilRows) release.emplace();
    try {
        return int64 ? Batch::merge(srcBase, dstBase, s.int64s(), d.int64s(), z.int64s(), n, std::move(store),
                                    s.stride(), d.stride(), z.stride())
                     : Batch::merge(srcBase, dstBase, s.uint64s(), d.uint64s(), z.uint64s(), n, std::move(store),
                                    s.stride(), d.stride(), z.stride());
    } catch (const std::invalid_argument& e) {
        release.reset();
        fail(PyExc_ValueError, e.what());
    }
}

uint64_t positive(const char* fn, int64_t value, const char* name) {
    if (value <= 0) throw py::value_error(std::string(fn) + ": " + name + " must be > 0, got " + std::to_string(value));
    return static_cast<uint64_t>(value);
}

py::tuple row_tuple(const Row& r) { return py::make_tuple(r.src, r.dst, r.bytes); }

std::string repr(const Batch& b) {
    std::string s = "Batch(" + std::to_string(b.size()) + (b.size() == 1 ? " row" : " rows") + ", " +
                    std::to_string(b.total_bytes()) + " bytes";
    if (b.size() == 1) s += ": src " + std::to_string(b[0].src) + ", dst " + std::to_string(b[0].dst);
    return s + ")";
}

uint64_t kEmptyRow[3] = {0, 0, 0};  // where an empty batch's buffer points (never read)

mori::native::Registration reg([](py::module_& root) {
    py::module_ m = mori::native::submodule(root, "batch", "a batch of copies as one value, and its planner");
    py::class_<Batch>(m, "Batch", py::buffer_protocol(),
                      "A batch of copies as rows (src, dst, bytes), built once from the caller's columns: row i is "
                      "(src_base + src_offsets[i], dst_base + dst_offsets[i], sizes[i]), empty blocks dropped and "
                      "blocks that continue the previous row on both sides merged into it. Immutable; its rows read "
                      "in place through the buffer protocol (an (n, 3) uint64 array: numpy.asarray(batch)).")
        .def(py::init(&build), py::arg("src_offsets"), py::arg("dst_offsets"), py::arg("sizes"),
             py::arg("src_base") = 0, py::arg("dst_base") = 0, py::arg("out") = py::none(),
             "Columns are sequences of ints or 1-d integer buffers (numpy arrays, array.array...): TypeError for "
             "anything else, ValueError naming the column and index for a negative value or one past 64 bits, for "
             "a block that runs past 2^64, or for columns of different lengths. out: a writable C-contiguous "
             "(>= len(sizes), 3) uint64 array (a pinned table, say) to write the rows into; the batch then reads "
             "them there and keeps out alive, and the caller leaves those rows alone while the batch is in use.")
        .def_static(
            "one",
            [](uint64_t src, uint64_t dst, uint64_t bytes) {
                return checked("Batch.one", [&] { return Batch::one(src, dst, bytes); });
            },
            py::arg("src"), py::arg("dst"), py::arg("bytes"),
            "The batch of one block (no row when bytes is 0); ValueError when it runs past 2^64.")
        .def("__len__", &Batch::size)
        .def(
            "__getitem__",
            [](const Batch& b, py::ssize_t i) {
                const py::ssize_t n = static_cast<py::ssize_t>(b.size());
                if (i < 0) i += n;
                if (i < 0 || i >= n) throw py::index_error("Batch index out of range");
                return row_tuple(b[static_cast<size_t>(i)]);
            },
            py::arg("index"))
        .def(
            "__getitem__",
            [](const Batch& b, const py::slice& s) {
                size_t start, stop, step, len;
                if (!s.compute(b.size(), &start, &stop, &step, &len)) throw py::error_already_set();
                if (step != 1) throw py::value_error("Batch slices take every row (step 1)");
                return b.slice(start, start + len);
            },
            py::arg("index"))
        .def("__iter__",
             [](const Batch& b) {
                 py::list rows(b.size());
                 for (size_t i = 0; i < b.size(); ++i) rows[i] = row_tuple(b[i]);
                 return py::iter(rows);
             })
        .def("__eq__",
             [](const Batch& a, const py::object& o) -> py::object {
                 if (!py::isinstance<Batch>(o)) return py::reinterpret_borrow<py::object>(Py_NotImplemented);
                 return py::bool_(a == o.cast<const Batch&>());
             })
        .def("__repr__", &repr)
        .def_buffer([](const Batch& b) {
            const auto n = static_cast<py::ssize_t>(b.size());
            void* data = n ? const_cast<Row*>(b.begin()) : static_cast<void*>(kEmptyRow);
            return py::buffer_info(data, sizeof(uint64_t), py::format_descriptor<uint64_t>::format(), 2,
                                   {n, py::ssize_t{3}}, {py::ssize_t{sizeof(Row)}, py::ssize_t{sizeof(uint64_t)}},
                                   /*readonly=*/true);
        })
        .def_property_readonly("largest", &Batch::largest, "The largest row's bytes (0 for no row).")
        .def_property_readonly("smallest", &Batch::smallest, "The smallest row's bytes (0 for no row).")
        .def_property_readonly("total_bytes", &Batch::total_bytes,
                               "Bytes of every row together (counted when asked: a pass over the rows).")
        .def_property_readonly("src_end", &Batch::src_end,
                               "The largest src + bytes of a row, 0 for no row (counted when asked).")
        .def_property_readonly("dst_end", &Batch::dst_end,
                               "The largest dst + bytes of a row, 0 for no row (counted when asked).")
        .def(
            "stripe",
            [](const Batch& b, int64_t piece) -> py::object {
                const uint64_t p = positive("Batch.stripe", piece, "piece");
                if (b.largest() <= p)  // nothing to cut: this batch itself (its Python object)
                    return py::cast(&b, py::return_value_policy::reference);
                std::optional<py::gil_scoped_release> release;
                if (b.size() >= kReleaseGilRows) release.emplace();
                Batch out = checked("Batch.stripe", [&] { return b.stripe(p); });
                release.reset();
                return py::cast(std::move(out));
            },
            py::arg("piece"),
            "A Batch: each row cut into pieces of at most `piece` bytes, in order (the batch itself "
            "when no row is longer); ValueError past 2^27 pieces.")
        .def(
            "rebased",
            [](const Batch& b, uint64_t srcBy, uint64_t dstBy, bool reverse, const py::object& out) {
                std::shared_ptr<Row[]> store = out.is_none() ? nullptr : table_store(out, b.size());
                std::optional<py::gil_scoped_release> release;
                if (b.size() >= kReleaseGilRows) release.emplace();
                Batch moved =
                    checked("Batch.rebased", [&] { return b.rebased(srcBy, dstBy, reverse, std::move(store)); });
                release.reset();
                return moved;
            },
            py::arg("src_by") = 0, py::arg("dst_by") = 0, py::arg("reverse") = false, py::arg("out") = py::none(),
            "A Batch of the same copies with src_by added to every src and dst_by to every dst; with reverse, src and "
            "dst are swapped first (the copies run the other way). One pass over the rows, which stay merged. out: "
            "as for Batch(...), the table the rows are written into. ValueError when a row would run past 2^64.")
        .def(
            "count_pieces",
            [](const Batch& b, int64_t piece) {
                const uint64_t p = positive("Batch.count_pieces", piece, "piece");
                return checked("Batch.count_pieces", [&] { return b.count_pieces(p); });
            },
            py::arg("piece"), "How many rows stripe(piece) has.")
        .def(
            "deal",
            [](const Batch& b, int64_t runs, int64_t minRunBytes) {
                const uint64_t r = positive("Batch.deal", runs, "runs");
                const uint64_t m = positive("Batch.deal", minRunBytes, "min_run_bytes");
                return checked("Batch.deal", [&] { return b.deal(r, m); });
            },
            py::arg("runs"), py::arg("min_run_bytes") = 1,
            "The rows split into at most `runs` contiguous runs of about equal bytes (a list of Batch), no more "
            "runs than ceil(total_bytes / min_run_bytes); [] for no rows. Run r takes its first row, then each "
            "next row whose middle lies at or before (r + 1) / runs of the bytes; the last run takes the rest.")
        .def(
            "cut_chunks",
            [](const Batch& b, int64_t chunkBytes, int64_t maxPieces) {
                const uint64_t c = positive("Batch.cut_chunks", chunkBytes, "chunk_bytes");
                const uint64_t p = positive("Batch.cut_chunks", maxPieces, "max_pieces");
                std::optional<py::gil_scoped_release> release;
                if (b.size() >= kReleaseGilRows) release.emplace();
                std::vector<Batch> out = checked("Batch.cut_chunks", [&] { return b.cut_chunks(c, p); });
                release.reset();
                return out;
            },
            py::arg("chunk_bytes"), py::arg("max_pieces"),
            "The rows laid end to end and cut at every multiple of chunk_bytes (a list of Batch, one a chunk, "
            "each of at most max_pieces rows): a row that crosses a multiple becomes two pieces, pieces of one "
            "chunk contiguous on both sides are merged, a chunk of more pieces is split by count. A chunk's "
            "pieces are packed from offset 0 of a buffer, in order.");
});

}  // namespace
}  // namespace mori::plan
