// mori-core's batch planner: how a batch of copies is cut into pieces and shared out, as plain
// functions over rows (src, dst, bytes), for every transport, and the Batch value built on them
// (batch/bindings.cpp gives it to Python as mori.core.batch.Batch; the TCP data plane takes one):
//
// - merge_rows: a batch (base + offset, base + offset, size) as rows, empty blocks dropped and
//   runs contiguous on both sides merged into one row;
// - stripe_rows: rows cut into pieces of at most `piece` bytes;
// - deal_rows: a row sequence split into at most `runs` contiguous runs of about equal bytes;
// - cut_chunks: rows laid end to end and cut at every multiple of a chunk size, at most
//   max_pieces pieces a chunk (a chunk's pieces are packed from offset 0 of a buffer).
//
// No Python here. Bad input throws std::invalid_argument before anything is allocated (what an
// output buffer holds after a throw is unspecified); no function reads or writes the memory the
// rows describe.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace mori::plan {

// One copy: `bytes` bytes from address (or offset) src to dst. The layout of a row of an (n, 3)
// uint64 numpy array.
struct Row {
    uint64_t src, dst, bytes;
};
static_assert(sizeof(Row) == 3 * sizeof(uint64_t), "Row is three packed uint64");

// The most pieces one call may produce (3 GiB of rows): a larger count comes from a piece size
// far too small for the batch, and would exhaust memory instead of failing.
constexpr uint64_t kMaxPieces = 1ull << 27;

inline std::invalid_argument bad(const std::string& msg) { return std::invalid_argument(msg); }

struct Merged {
    size_t rows;
    uint64_t largest, smallest;  // row sizes (0, 0 when no row)
    uint64_t srcEnd, dstEnd;     // the largest src + bytes and dst + bytes of a row (0 when no row)
};

// Why block i of a batch cannot be planned ("" when it can); see merge_rows. Names the block's
// values as the Python arguments name them (src_offsets[i], dst_offsets[i], sizes[i]).
template <class Int>
inline std::string block_error(uint64_t srcBase, uint64_t dstBase, Int so, Int dof, Int size, size_t i) {
    static_assert(std::is_same_v<Int, int64_t> || std::is_same_v<Int, uint64_t>, "int64 or uint64 offsets");
    const std::string at = "[" + std::to_string(i) + "]";
    if constexpr (std::is_signed_v<Int>) {
        if (so < 0) return "src_offsets" + at + " is negative (" + std::to_string(so) + ")";
        if (dof < 0) return "dst_offsets" + at + " is negative (" + std::to_string(dof) + ")";
        if (size < 0) return "sizes" + at + " is negative (" + std::to_string(size) + ")";
    }
    uint64_t end;
    const uint64_t n = static_cast<uint64_t>(size);
    if (__builtin_add_overflow(srcBase, static_cast<uint64_t>(so), &end) || __builtin_add_overflow(end, n, &end))
        return "block " + std::to_string(i) + " (src_base + src_offsets" + at + " + sizes" + at +
               ") runs past the 64-bit address space";
    if (__builtin_add_overflow(dstBase, static_cast<uint64_t>(dof), &end) || __builtin_add_overflow(end, n, &end))
        return "block " + std::to_string(i) + " (dst_base + dst_offsets" + at + " + sizes" + at +
               ") runs past the 64-bit address space";
    return "";
}

// Rows written one block at a time into out (room for as many rows as blocks): an empty block
// is dropped, a block that continues the row being extended on both sides is merged into it.
// The one merge of the planner: merge_rows feeds it columns, Batch's list reader Python ints.
// Blocks must lie within 2^64 on both sides (what the rows hold is of no meaning otherwise).
class RowWriter {
public:
    explicit RowWriter(Row* out) : out_(out), next_(out) {}

    [[gnu::always_inline]] void add(uint64_t src, uint64_t dst, uint64_t bytes) {
        if (bytes == 0) return;
        if (rowBytes_ > 0 && rowSrc_ + rowBytes_ == src && rowDst_ + rowBytes_ == dst) {
            rowBytes_ += bytes;  // the row being extended stays in registers until the next starts
            return;
        }
        flush();
        rowSrc_ = src, rowDst_ = dst, rowBytes_ = bytes;
    }

    // The rows written and what they hold.
    [[gnu::always_inline]] Merged finish() {
        flush();
        rowBytes_ = 0;
        const size_t rows = static_cast<size_t>(next_ - out_);
        return Merged{rows, largest_, rows ? smallest_ : 0, srcEnd_, dstEnd_};
    }

private:
    [[gnu::always_inline]] void flush() {
        if (rowBytes_ == 0) return;
        *next_++ = Row{rowSrc_, rowDst_, rowBytes_};
        largest_ = std::max(largest_, rowBytes_);
        smallest_ = std::min(smallest_, rowBytes_);
        srcEnd_ = std::max(srcEnd_, rowSrc_ + rowBytes_);
        dstEnd_ = std::max(dstEnd_, rowDst_ + rowBytes_);
    }

    Row* out_;
    Row* next_;  // where the next row goes
    uint64_t rowSrc_ = 0, rowDst_ = 0, rowBytes_ = 0;
    uint64_t largest_ = 0, smallest_ = std::numeric_limits<uint64_t>::max(), srcEnd_ = 0, dstEnd_ = 0;
};

namespace detail {
// merge_rows' loop; Strided false: every stride is 1 (fewer registers live: the common case).
template <bool Strided, class Int>
inline Merged merge_loop(uint64_t srcBase, uint64_t dstBase, const Int* srcOffs, const Int* dstOffs, const Int* sizes,
                         size_t n, Row* out, ptrdiff_t srcStride, ptrdiff_t dstStride, ptrdiff_t sizeStride) {
    RowWriter rows(out);
    uint64_t bits = 0;  // every offset and size ORed: see the check below
    for (size_t i = 0; i < n; ++i) {
        const ptrdiff_t at = static_cast<ptrdiff_t>(i);
        const Int so = srcOffs[Strided ? at * srcStride : at], dof = dstOffs[Strided ? at * dstStride : at],
                  size = sizes[Strided ? at * sizeStride : at];
        bits |= static_cast<uint64_t>(so) | static_cast<uint64_t>(dof) | static_cast<uint64_t>(size);
        if (!(size > 0)) continue;
        rows.add(srcBase + static_cast<uint64_t>(so), dstBase + static_cast<uint64_t>(dof),
                 static_cast<uint64_t>(size));
    }
    // When every offset and size is below 2^62 and both bases below 2^63 (any user-space
    // address), no block was negative or wrapped; only otherwise is each block checked (one OR
    // a block instead of branches: the planner is on the latency path of every transfer).
    if ((bits >> 62) != 0 || ((srcBase | dstBase) >> 63) != 0)
        for (size_t i = 0; i < n; ++i) {
            const ptrdiff_t at = static_cast<ptrdiff_t>(i);
            const std::string why = block_error(srcBase, dstBase, srcOffs[at * srcStride], dstOffs[at * dstStride],
                                                sizes[at * sizeStride], i);
            if (!why.empty()) throw bad(why);
        }
    return rows.finish();
}
}  // namespace detail

// Writes rows (srcBase + srcOffs[i], dstBase + dstOffs[i], sizes[i]) into out (capacity >= n),
// dropping empty blocks and merging a block into the previous row when it continues that row on
// both sides. Offsets and sizes are int64 or uint64, column c's element i at c[i * stride] (a
// column of an (n, k) array reads in place). Throws when an offset or size is negative or a
// block runs past 2^64 (out then holds rows of no meaning).
template <class Int>
inline Merged merge_rows(uint64_t srcBase, uint64_t dstBase, const Int* srcOffs, const Int* dstOffs, const Int* sizes,
                         size_t n, Row* out, ptrdiff_t srcStride = 1, ptrdiff_t dstStride = 1,
                         ptrdiff_t sizeStride = 1) {
    if (srcStride == 1 && dstStride == 1 && sizeStride == 1)
        return detail::merge_loop<false>(srcBase, dstBase, srcOffs, dstOffs, sizes, n, out, 1, 1, 1);
    return detail::merge_loop<true>(srcBase, dstBase, srcOffs, dstOffs, sizes, n, out, srcStride, dstStride,
                                    sizeStride);
}

// Pieces of at most `piece` bytes that rows cut into (empty rows give none). Throws when a row
// runs past 2^64 on either side or the count passes kMaxPieces.
inline uint64_t count_pieces(const Row* rows, size_t n, uint64_t piece) {
    if (piece == 0) throw bad("piece must be > 0");
    uint64_t count = 0, end;
    for (size_t i = 0; i < n; ++i) {
        if (__builtin_add_overflow(rows[i].src, rows[i].bytes, &end) ||
            __builtin_add_overflow(rows[i].dst, rows[i].bytes, &end))
            throw bad("row " + std::to_string(i) + " runs past the 64-bit address space");
        count += rows[i].bytes / piece + (rows[i].bytes % piece != 0);
        if (count > kMaxPieces)
            throw bad("cutting the rows into pieces of " + std::to_string(piece) + " bytes gives more than " +
                      std::to_string(kMaxPieces) + " pieces");
    }
    return count;
}

// Writes the pieces of rows (count_pieces(rows, n, piece) of them) into out, in order; a row of
// b bytes becomes ceil(b / piece) pieces, all but the last of `piece` bytes.
inline void stripe_rows(const Row* rows, size_t n, uint64_t piece, Row* out) {
    for (size_t i = 0; i < n; ++i) {
        const Row& r = rows[i];
        for (uint64_t done = 0; done < r.bytes; done += std::min(piece, r.bytes - done))
            *out++ = Row{r.src + done, r.dst + done, std::min(piece, r.bytes - done)};
    }
}

// Splits rows into at most `runs` contiguous runs of about total/runs bytes each, and no more
// runs than total/minRunBytes rounded up (at least one). Run r takes its first row, then every
// next row whose middle lies at or before (r + 1) * total / runs bytes of the whole sequence; the
// last run takes the rest. Returns the run boundaries: b[0] = 0 < b[1] < ... < b[k] = n (just
// {0} for no rows).
inline std::vector<size_t> deal_rows(const Row* rows, size_t n, uint64_t runs, uint64_t minRunBytes) {
    if (runs == 0) throw bad("runs must be > 0");
    if (minRunBytes == 0) throw bad("min_run_bytes must be > 0");
    uint64_t total = 0;
    for (size_t i = 0; i < n; ++i)
        if (__builtin_add_overflow(total, rows[i].bytes, &total)) throw bad("the rows hold more than 2^64 bytes");
    runs = std::max<uint64_t>(1, std::min(runs, total / minRunBytes + (total % minRunBytes != 0)));
    std::vector<size_t> bounds{0};
    // 128-bit: 2 * (bytes so far) + row < 2^66, times runs < 2^64.
    using U128 = unsigned __int128;
    U128 before = 0;  // bytes of the rows placed so far
    size_t i = 0;
    for (uint64_t r = 0; i < n; ++r) {
        if (r + 1 == runs) {
            i = n;
        } else {
            const U128 target = 2 * static_cast<U128>(total) * (r + 1);  // 2 * runs * (r + 1) * total / runs
            before += rows[i++].bytes;
            while (i < n && (2 * before + rows[i].bytes) * runs <= target) before += rows[i++].bytes;
        }
        bounds.push_back(i);
    }
    return bounds;
}

// Pieces of rows laid end to end and cut into chunks: chunk c is pieces[bounds[c], bounds[c + 1]).
struct Chunks {
    std::vector<Row> pieces;
    std::vector<size_t> bounds;
};

// Cuts rows into chunks of at most chunkBytes bytes and maxPieces pieces. The rows are laid end
// to end and cut at every multiple of chunkBytes (a row that crosses one becomes two pieces);
// empty rows are dropped and pieces of one chunk contiguous on both sides are merged; a chunk
// of more pieces is split by count. A chunk's pieces are packed in a buffer in order from
// offset 0 (piece j at the sum of the sizes before it). Throws when the rows hold more than
// 2^64 bytes or the pieces would be more than kMaxPieces.
inline Chunks cut_chunks(const Row* rows, size_t n, uint64_t chunkBytes, uint64_t maxPieces) {
    if (chunkBytes == 0) throw bad("chunk_bytes must be > 0");
    if (maxPieces == 0) throw bad("max_pieces must be > 0");
    const uint64_t cb = chunkBytes;
    uint64_t total = 0, count = 0;
    for (size_t i = 0; i < n; ++i) {
        if (rows[i].bytes == 0) continue;
        uint64_t end;
        if (__builtin_add_overflow(total, rows[i].bytes, &end)) throw bad("the rows hold more than 2^64 bytes");
        count += (end - 1) / cb - total / cb + 1;
        total = end;
        if (count > kMaxPieces)
            throw bad("cutting the rows at every " + std::to_string(cb) + " bytes gives more than " +
                      std::to_string(kMaxPieces) + " pieces");
    }
    Chunks out;
    out.pieces.reserve(count);
    uint64_t pos = 0, chunk = 0;  // bytes laid so far; the chunk the last piece is in
    size_t inGroup = 0;           // pieces of the current output chunk
    for (size_t i = 0; i < n; ++i) {
        for (uint64_t done = 0, size = rows[i].bytes; done < size;) {
            const uint64_t c = pos / cb;
            const uint64_t len = std::min(size - done, cb - pos % cb);
            const uint64_t src = rows[i].src + done, dst = rows[i].dst + done;
            Row* prev = out.pieces.empty() ? nullptr : &out.pieces.back();
            if (prev && c == chunk && prev->src + prev->bytes == src && prev->dst + prev->bytes == dst) {
                prev->bytes += len;
            } else {
                if (!prev || c != chunk || inGroup == maxPieces) {
                    out.bounds.push_back(out.pieces.size());
                    inGroup = 0;
                }
                out.pieces.push_back(Row{src, dst, len});
                ++inGroup;
                chunk = c;
            }
            pos += len;
            done += len;
        }
    }
    out.bounds.push_back(out.pieces.size());
    return out;
}

}  // namespace mori::plan
