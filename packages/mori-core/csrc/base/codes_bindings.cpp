// mori.core._native.codes: the native planes' one table of codes, for mori.core.codes (a test
// checks its enums against these): transfer outcomes (base/transfer.hpp), request operations and
// atomics (base/ops.hpp), and refusal reasons (base/reasons.hpp).
#include "base/ops.hpp"
#include "base/reasons.hpp"
#include "base/registry.hpp"
#include "base/transfer.hpp"

namespace py = pybind11;

namespace {

template <class Table>
py::dict named(const Table& table) {
    py::dict d;
    for (const auto& entry : table) d[entry.name] = static_cast<int>(entry.code);
    return d;
}

mori::native::Registration reg([](py::module_& root) {
    using namespace mori;
    py::module_ m = native::submodule(root, "codes", "the codes every native plane carries");
    py::dict transfer;  // by mori.core.codes.TransferCode's names
    transfer["SUCCESS"] = static_cast<int>(kSuccess);
    transfer["NOT_STARTED"] = static_cast<int>(kNotStarted);
    transfer["IN_PROGRESS"] = static_cast<int>(kInProgress);
    transfer["ERR_INVALID_ARGS"] = static_cast<int>(kErrInvalidArgs);
    transfer["ERR_NOT_FOUND"] = static_cast<int>(kErrNotFound);
    transfer["ERR_TRANSPORT"] = static_cast<int>(kErrTransport);
    transfer["ERR_BAD_STATE"] = static_cast<int>(kErrBadState);
    transfer["ERR_DEVICE"] = static_cast<int>(kErrDevice);
    m.attr("TRANSFER_CODES") = transfer;
    m.attr("OPS") = named(kOpNames);
    m.attr("ATOMIC_OPS") = named(kAtomicNames);
    py::dict reasons;
    for (uint32_t r = kReasonNone; r <= kReasonLast; ++r) reasons[py::int_(r)] = reason_text(r);
    m.attr("REASONS") = reasons;
});

}  // namespace
