// A batch of copies as one value: rows (src, dst, bytes) built once from the caller's columns
// (checked and merged by merge_rows), with the planner's verbs (batch/plan.hpp) as methods that
// return Batch values. Every transport reads the same rows: the TCP data plane takes a Batch;
// batch/bindings.cpp gives it to Python as mori.core.batch.Batch (rows readable in place through
// the buffer protocol).
//
// What a Batch holds is immutable once built: no row is empty and no row runs past 2^64 on
// either side. No Python here.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "batch/plan.hpp"

namespace mori::plan {

class Batch {
public:
    Batch() = default;

    // The batch (srcBase + srcOffs[i], dstBase + dstOffs[i], sizes[i]), i < n (column c's element
    // i at c[i * stride]): empty blocks dropped, runs contiguous on both sides merged (merge_rows;
    // its errors propagate). The rows are written into `store` (room for n rows) when given, a
    // caller's table that the batch then reads (the caller leaves those rows alone while the
    // batch is in use); else into new memory.
    template <class Int>
    static Batch merge(uint64_t srcBase, uint64_t dstBase, const Int* srcOffs, const Int* dstOffs, const Int* sizes,
                       size_t n, std::shared_ptr<Row[]> store = nullptr, ptrdiff_t srcStride = 1,
                       ptrdiff_t dstStride = 1, ptrdiff_t sizeStride = 1) {
        if (!store && n) store.reset(new Row[n]);  // not zeroed: merge_rows writes what is read
        const Merged m =
            merge_rows(srcBase, dstBase, srcOffs, dstOffs, sizes, n, store.get(), srcStride, dstStride, sizeStride);
        return written(std::move(store), m);
    }

    // The batch whose m.rows rows a RowWriter wrote into store (merge, and readers that feed a
    // RowWriter themselves).
    static Batch written(std::shared_ptr<Row[]> store, const Merged& m) {
        Batch b(std::move(store), 0, m.rows, m);
        // Rows merged from blocks within 2^64 hold more than 2^64 - 1 bytes only when they repeat
        // bytes, many times over: counted only where rows times the largest could be that much.
        uint64_t bound;
        if (__builtin_mul_overflow(static_cast<uint64_t>(b.size_), b.largest_, &bound)) {
            unsigned __int128 total = 0;
            for (const Row& r : b) total += r.bytes;
            if (total >> 64) throw bad("the rows hold more than 2^64 - 1 bytes");
        }
        return b;
    }

    // One block: no row when bytes is 0. Throws when it runs past 2^64 on either side.
    static Batch one(uint64_t src, uint64_t dst, uint64_t bytes) {
        uint64_t end;
        if (__builtin_add_overflow(src, bytes, &end) || __builtin_add_overflow(dst, bytes, &end))
            throw bad("the block runs past the 64-bit address space");
        if (bytes == 0) return Batch();
        std::shared_ptr<Row[]> store(new Row[1]{Row{src, dst, bytes}});
        return Batch(std::move(store), 0, 1, Merged{1, bytes, bytes, src + bytes, dst + bytes});
    }

    const Row* begin() const { return store_.get() + first_; }
    const Row* end() const { return begin() + size_; }
    const Row& operator[](size_t i) const { return begin()[i]; }
    size_t size() const { return size_; }
    bool empty() const { return size_ == 0; }
    uint64_t largest() const { return largest_; }    // the largest row's bytes (0 for no row)
    uint64_t smallest() const { return smallest_; }  // the smallest row's bytes (0 for no row)
    // The bytes of all rows, counted at each call (a pass over the rows: building a batch counts
    // only what planning needs).
    uint64_t total_bytes() const {
        uint64_t total = 0;
        for (const Row& r : *this) total += r.bytes;  // below 2^64: checked when the rows were merged
        return total;
    }
    // The largest src + bytes and dst + bytes of a row (0 for no row), kept from the build.
    uint64_t src_end() const { return srcEnd_; }
    uint64_t dst_end() const { return dstEnd_; }
    bool operator==(const Batch& o) const {
        return size_ == o.size_ && std::equal(begin(), end(), o.begin(), [](const Row& a, const Row& b) {
                   return a.src == b.src && a.dst == b.dst && a.bytes == b.bytes;
               });
    }

    // Rows [begin, end) (clamped to the batch): a view of the same rows, no copy.
    Batch slice(size_t from, size_t to) const {
        to = std::min(to, size_);
        from = std::min(from, to);
        if (from == 0 && to == size_) return *this;
        return from == to ? Batch() : Batch(store_, first_ + from, to - from);
    }

    // The same copies with srcBy added to every src and dstBy to every dst, src and dst swapped
    // first when `reverse` (the copies then run the other way): a pass over the rows, which stay
    // merged (adding one value to a side keeps contiguous rows contiguous). Written into `store`
    // (room for size() rows) when given, else into new memory.
    // Throws when a row would run past 2^64 on either side.
    Batch rebased(uint64_t srcBy, uint64_t dstBy, bool reverse, std::shared_ptr<Row[]> store = nullptr) const {
        const uint64_t srcEnd = reverse ? dstEnd_ : srcEnd_, dstEnd = reverse ? srcEnd_ : dstEnd_;
        uint64_t end;
        if (__builtin_add_overflow(srcEnd, srcBy, &end) || __builtin_add_overflow(dstEnd, dstBy, &end))
            throw bad("the rows, rebased, run past the 64-bit address space");
        if (!store && size_) store.reset(new Row[size_]);
        Row* out = store.get();
        const Row* in = begin();
        if (reverse)
            for (size_t i = 0; i < size_; ++i) out[i] = Row{in[i].dst + srcBy, in[i].src + dstBy, in[i].bytes};
        else
            for (size_t i = 0; i < size_; ++i) out[i] = Row{in[i].src + srcBy, in[i].dst + dstBy, in[i].bytes};
        const Merged m{size_, largest_, smallest_, size_ ? srcEnd + srcBy : 0, size_ ? dstEnd + dstBy : 0};
        return Batch(std::move(store), 0, size_, m);
    }

    // How many pieces stripe(piece) has.
    uint64_t count_pieces(uint64_t piece) const { return plan::count_pieces(begin(), size_, piece); }

    // Each row cut into pieces of at most `piece` bytes, in order (stripe_rows); the same rows,
    // shared, when none is longer.
    Batch stripe(uint64_t piece) const {
        if (piece == 0) throw bad("piece must be > 0");
        if (largest_ <= piece) return *this;
        const uint64_t n = count_pieces(piece);
        std::shared_ptr<Row[]> store(new Row[n]);
        stripe_rows(begin(), size_, piece, store.get());
        return Batch(std::move(store), 0, n);
    }

    // The rows split into at most `runs` contiguous runs of about equal bytes, no more runs than
    // ceil(total_bytes / minRunBytes) (deal_rows): views of these rows; none for no rows.
    std::vector<Batch> deal(uint64_t runs, uint64_t minRunBytes = 1) const {
        const std::vector<size_t> bounds = deal_rows(begin(), size_, runs, minRunBytes);
        std::vector<Batch> out;
        out.reserve(bounds.size() - 1);
        for (size_t r = 0; r + 1 < bounds.size(); ++r) out.push_back(slice(bounds[r], bounds[r + 1]));
        return out;
    }

    // The rows cut into chunks of at most chunkBytes bytes and maxPieces pieces (cut_chunks):
    // one Batch of pieces a chunk (views of one new row store), packed from offset 0 of a
    // buffer in order.
    std::vector<Batch> cut_chunks(uint64_t chunkBytes, uint64_t maxPieces) const {
        Chunks c = plan::cut_chunks(begin(), size_, chunkBytes, maxPieces);
        const Batch pieces = adopt(std::move(c.pieces));
        std::vector<Batch> out;
        out.reserve(c.bounds.size() - 1);
        for (size_t k = 0; k + 1 < c.bounds.size(); ++k) out.push_back(pieces.slice(c.bounds[k], c.bounds[k + 1]));
        return out;
    }

private:
    // Rows [first, first + n) of store, what they hold given (m.rows unused).
    Batch(std::shared_ptr<Row[]> store, size_t first, size_t n, const Merged& m)
        : store_(std::move(store)),
          first_(first),
          size_(n),
          largest_(m.largest),
          smallest_(m.smallest),
          srcEnd_(m.srcEnd),
          dstEnd_(m.dstEnd) {}

    // Rows [first, first + n) of store, cut or taken from a Batch (so holding the invariants, and
    // fewer bytes than their batch): what they hold found here, in a pass.
    Batch(std::shared_ptr<Row[]> store, size_t first, size_t n) : store_(std::move(store)), first_(first), size_(n) {
        smallest_ = n ? std::numeric_limits<uint64_t>::max() : 0;
        for (const Row& r : *this) {
            largest_ = std::max(largest_, r.bytes), smallest_ = std::min(smallest_, r.bytes);
            srcEnd_ = std::max(srcEnd_, r.src + r.bytes), dstEnd_ = std::max(dstEnd_, r.dst + r.bytes);
        }
    }

    static Batch adopt(std::vector<Row> rows) {
        const size_t n = rows.size();
        auto owner = std::make_shared<std::vector<Row>>(std::move(rows));
        return Batch(std::shared_ptr<Row[]>(owner, owner->data()), 0, n);  // aliasing: shares the vector
    }

    std::shared_ptr<Row[]> store_;  // shared by slices: a Batch never writes its rows
    size_t first_ = 0, size_ = 0;
    uint64_t largest_ = 0, smallest_ = 0, srcEnd_ = 0, dstEnd_ = 0;
};

}  // namespace mori::plan
