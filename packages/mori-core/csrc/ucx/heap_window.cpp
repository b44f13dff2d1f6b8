// The remote side of one symmetric heap on the UCX engine (see heap_window.hpp).
#include "ucx/heap_window.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <stdexcept>

namespace mori::ucx {

namespace {

constexpr uint64_t kFirstBufferId = uint64_t{1} << 32;  // ids of buffers, leases and the staging area

uint64_t address_of(const void* p) { return reinterpret_cast<uint64_t>(p); }

Outcome outcome_of(const Transfer& t) {
    const int code = t.code();
    return Outcome{code, code == kSuccess ? std::string() : t.message()};
}

}  // namespace

Lease::~Lease() {
    try {
        engine->deregister_region(id);
    } catch (const std::exception& e) {
        // Only a transfer still using it at the timeout leaves it registered; that transfer failed.
        std::fprintf(stderr, "mori: releasing memory registered for a transfer: %s\n", e.what());
    }
}

HeapWindow::HeapWindow(std::shared_ptr<Engine> engine, std::shared_ptr<memory::LiveRanges> live, const HeapLayout& heap,
                       std::vector<std::shared_ptr<Peer>> peers, double timeout)
    : engine_(std::move(engine)),
      live_(std::move(live)),
      heap_(heap),
      peers_(std::move(peers)),
      timeout_(timeout),
      waitFor_(timeout + 5.0),
      nextId_(kFirstBufferId) {
    if (!engine_) throw std::invalid_argument("UcxHeapWindow: an engine is required");
    if (!live_) throw std::invalid_argument("UcxHeapWindow: live ranges are required");
    if (heap_.chunk == 0 || heap_.size % heap_.chunk)
        throw std::invalid_argument("UcxHeapWindow: chunk must divide size");
    if (heap_.reserved > heap_.size) throw std::invalid_argument("UcxHeapWindow: reserved exceeds size");
    if (!(timeout > 0)) throw std::invalid_argument("UcxHeapWindow: timeout must be > 0 seconds");
    staging_.resize(kStagingBytes);
    stagingId_ = nextId_++;
    engine_->register_region(stagingId_, address_of(staging_.data()), kStagingBytes, false);
}

HeapWindow::~HeapWindow() { close(); }

void HeapWindow::close() {
    std::map<uint64_t, Buffer> buffers;
    {
        std::lock_guard lk(mu_);
        buffers.swap(buffers_);
    }
    for (const auto& [addr, buffer] : buffers) {
        try {
            engine_->deregister_region(buffer.id);
        } catch (const std::exception&) {
            // the engine was closed first: its registrations went with it
        }
    }
    if (stagingId_ != 0) {
        try {
            engine_->deregister_region(stagingId_);
        } catch (const std::exception&) {
        }
        stagingId_ = 0;
    }
    peers_.clear();
}

void HeapWindow::grow(uint64_t end) {
    if (end > heap_.size) throw std::invalid_argument("the heap grows to at most its size");
    for (uint64_t off = registered_.load(); off < end; off += heap_.chunk) {
        engine_->register_region(heap_.firstId + off / heap_.chunk, heap_.base + off, heap_.chunk, heap_.gpu);
        registered_.store(off + heap_.chunk);
    }
}

void HeapWindow::register_buffer(uint64_t addr, uint64_t bytes, bool gpu) {
    if (addr == 0 || bytes == 0 || addr + bytes < addr)
        throw std::invalid_argument("a buffer must be a non-empty range");
    std::lock_guard lk(mu_);
    auto next = buffers_.lower_bound(addr);
    if ((next != buffers_.end() && next->first < addr + bytes) ||
        (next != buffers_.begin() && std::prev(next)->first + std::prev(next)->second.bytes > addr))
        throw std::invalid_argument("the buffer overlaps a registered one");
    const uint64_t id = nextId_++;
    try {
        engine_->register_region(id, addr, bytes, gpu);
    } catch (const std::exception&) {
        if (!gpu) throw;
        engine_->register_region(id, addr, bytes, false);  // host memory, which UCX told apart
    }
    buffers_.emplace(addr, Buffer{bytes, id});
}

bool HeapWindow::deregister_buffer(uint64_t addr) {
    uint64_t id;
    {
        std::lock_guard lk(mu_);
        auto it = buffers_.find(addr);
        if (it == buffers_.end()) return false;
        id = it->second.id;
        buffers_.erase(it);  // later transfers from it are staged or registered for the call again
    }
    return engine_->deregister_region(id);
}

HeapWindow::Stats HeapWindow::stats() const {
    std::lock_guard lk(mu_);
    return Stats{staged_.load(), forCall_.load(), buffers_.size()};
}

std::string HeapWindow::check(int pe, uint64_t offset, uint64_t bytes, const char* what) const {
    if (pe < 0 || static_cast<size_t>(pe) >= peers_.size() || !peers_[pe])
        return std::string(what) + " names PE " + std::to_string(pe) +
               ", which is not reached through the remote "
               "transport";
    if (offset > heap_.size || bytes > heap_.size - offset)
        return std::string(what) + " of " + std::to_string(bytes) + " bytes at heap offset " + std::to_string(offset) +
               " runs past the heap (" + std::to_string(heap_.size) + " bytes)";
    return "";
}

bool HeapWindow::find_local(uint64_t addr, uint64_t bytes, Local& out) const {
    if (in_heap(addr, bytes)) {
        out = Local{true, 0, heap_.base};
        return true;
    }
    std::lock_guard lk(mu_);
    auto it = buffers_.upper_bound(addr);
    if (it == buffers_.begin()) return false;
    --it;
    if (bytes > it->second.bytes || addr - it->first > it->second.bytes - bytes) return false;
    out = Local{false, it->second.id, it->first};
    return true;
}

std::shared_ptr<Lease> HeapWindow::lease(uint64_t addr, uint64_t bytes, bool gpu, bool eitherKind) {
    std::lock_guard lk(mu_);
    // A kernel's buffer stays the kernel's until its commands are complete (quiet): while one
    // registration of it is in use, later transfers in the same range share it.
    leases_.erase(std::remove_if(leases_.begin(), leases_.end(), [](const auto& w) { return w.expired(); }),
                  leases_.end());
    for (const auto& w : leases_) {
        std::shared_ptr<Lease> held = w.lock();
        if (held && addr >= held->addr && bytes <= held->bytes && addr - held->addr <= held->bytes - bytes) return held;
    }
    const uint64_t id = nextId_++;
    try {
        engine_->register_region(id, addr, bytes, gpu);
    } catch (const std::exception&) {
        if (!eitherKind) throw;
        engine_->register_region(id, addr, bytes, !gpu);
    }
    auto made = std::make_shared<Lease>();
    made->engine = engine_;
    made->id = id;
    made->addr = addr;
    made->bytes = bytes;
    leases_.push_back(made);
    forCall_.fetch_add(1);
    return made;
}

std::vector<std::shared_ptr<Transfer>> HeapWindow::submit(Peer& to, Op op, const Local& local, uint64_t addr,
                                                          uint64_t remote, uint64_t bytes) {
    // One batch per pair of memory ids: rows split only where a chunk of either side ends (the
    // engine moves each row as one message, pipelined with the rest of the batch).
    std::vector<std::shared_ptr<Transfer>> parts;
    std::vector<uint64_t> lofs, rofs, sizes;
    uint64_t groupL = 0, groupR = 0;
    auto flush = [&] {
        parts.push_back(
            to.submit(op, groupL, lofs.data(), groupR, rofs.data(), sizes.data(), sizes.size(), 0, false, heap_.gpu));
        lofs.clear();
        rofs.clear();
        sizes.clear();
    };
    const uint64_t chunk = heap_.chunk;
    for (uint64_t done = 0; done < bytes;) {
        const uint64_t r = remote + done, rId = heap_.firstId + r / chunk, rIn = r % chunk;
        uint64_t lId = local.id, lIn = addr + done - local.base, n = std::min(bytes - done, chunk - rIn);
        if (local.heap) {
            lId = heap_.firstId + lIn / chunk;
            lIn %= chunk;
            n = std::min(n, chunk - lIn);
        }
        if (!sizes.empty() && (lId != groupL || rId != groupR)) flush();
        groupL = lId;
        groupR = rId;
        lofs.push_back(lIn);
        rofs.push_back(rIn);
        sizes.push_back(n);
        done += n;
    }
    if (!sizes.empty()) flush();
    return parts;
}

Outcome HeapWindow::run(Peer& to, Op op, const Local& local, uint64_t addr, uint64_t remote, uint64_t bytes) {
    const uint64_t chunk = heap_.chunk, rIn = remote % chunk;
    uint64_t lId = local.id;
    bool one = rIn + bytes <= chunk;
    if (local.heap) {
        const uint64_t l = addr - heap_.base;
        lId = heap_.firstId + l / chunk;
        one = one && l % chunk + bytes <= chunk;
    }
    if (one)  // the usual case: one row, posted and waited for at once
        return outcome_of(*to.run_one(op, lId, addr, rIn, bytes, heap_.firstId + remote / chunk, heap_.gpu, waitFor_));
    // Every part is waited for before the outcome is known: none may still use the staging area
    // or memory registered for this transfer once it returns.
    Outcome out;
    for (const auto& t : submit(to, op, local, addr, remote, bytes)) {
        Outcome part = t->wait(waitFor_) ? outcome_of(*t) : Outcome{kInProgress, ""};
        if (out.code == kSuccess && part.code != kSuccess) out = part;
    }
    return out;
}

Outcome HeapWindow::transfer(Op op, int pe, uint64_t offset, uint64_t local, uint64_t bytes, bool localGpu) {
    const std::string why = check(pe, offset, bytes, op == kOpWrite ? "a put" : "a get");
    if (!why.empty()) return Outcome{kErrInvalidArgs, why};
    if (bytes == 0) return Outcome{};
    Peer& to = *peers_[pe];
    Local where;
    if (find_local(local, bytes, where)) return run(to, op, where, local, offset, bytes);
    if (!localGpu && bytes <= kStagingBytes) {
        std::lock_guard lk(stagingMu_);
        staged_.fetch_add(1);
        void* stage = staging_.data();
        if (op == kOpWrite) std::memcpy(stage, reinterpret_cast<const void*>(local), bytes);
        Outcome out = run(to, op, Local{false, stagingId_, address_of(stage)}, address_of(stage), offset, bytes);
        if (op == kOpRead && out.code == kSuccess) std::memcpy(reinterpret_cast<void*>(local), stage, bytes);
        return out;
    }
    std::shared_ptr<Lease> held;
    try {
        held = lease(local, bytes, localGpu, false);
    } catch (const std::exception& e) {
        return Outcome{kErrTransport, std::string("registering the local buffer: ") + e.what()};
    }
    return run(to, op, Local{false, held->id, held->addr}, local, offset, bytes);
}

Outcome HeapWindow::put(int pe, uint64_t offset, uint64_t local, uint64_t bytes, bool localGpu) {
    return transfer(kOpWrite, pe, offset, local, bytes, localGpu);
}

Outcome HeapWindow::get(int pe, uint64_t offset, uint64_t local, uint64_t bytes, bool localGpu) {
    return transfer(kOpRead, pe, offset, local, bytes, localGpu);
}

Outcome HeapWindow::put_signal(int pe, uint64_t offset, uint64_t local, uint64_t bytes, bool localGpu,
                               uint64_t sigOffset, AtomicOp op, uint64_t value) {
    std::string why = check_signal_put(pe, offset, bytes, sigOffset);
    if (why.empty() && op != kAtomicStore && op != kAtomicFetchAdd) why = "a signal's op is store or fetch_add";
    if (!why.empty()) return Outcome{kErrInvalidArgs, why};
    // The message carries host bytes (the heap's GPU bytes copied out by signal_put); other GPU
    // memory (the caller's, maybe of another context) goes as a put, complete, then the atomic.
    if (bytes > kMaxSignalPutBytes || localGpu || !one_chunk(offset, bytes)) {
        Outcome out = put(pe, offset, local, bytes, localGpu);
        return out.code == kSuccess ? atomic(pe, op, sigOffset, value, 0, 64) : out;
    }
    try {
        Staged staged;
        remote_signal_put(*engine_, *peers_[pe],
                          signal_put(offset, host_bytes(local, bytes, staged), bytes, sigOffset, op, value), timeout_);
    } catch (const std::invalid_argument& e) {
        return Outcome{kErrInvalidArgs, e.what()};
    } catch (const std::exception& e) {
        return Outcome{kErrBadState, e.what()};
    }
    return Outcome{};
}

std::string HeapWindow::check_signal_put(int pe, uint64_t offset, uint64_t bytes, uint64_t sigOffset) const {
    const std::string why = check(pe, offset, bytes, "a put with signal");
    return why.empty() ? check(pe, sigOffset, 8, "the signal of a put with signal") : why;
}

const void* HeapWindow::host_bytes(uint64_t local, uint64_t bytes, Staged& staged) const {
    if (bytes == 0 || !heap_.gpu || !in_heap(local, bytes)) return reinterpret_cast<const void*>(local);
    const std::shared_ptr<GpuWords> gpu = engine_->gpu_words();
    if (!gpu) throw std::runtime_error("the engine stages no GPU memory (serve_gpu was not called)");
    staged = gpu->to_host(local, bytes, true);
    return staged.data();
}

SignalPut HeapWindow::signal_put(uint64_t offset, const void* src, uint64_t bytes, uint64_t sigOffset, AtomicOp op,
                                 uint64_t value) const {
    const uint64_t chunk = heap_.chunk;
    return SignalPut{heap_.firstId + offset / chunk,    offset % chunk,    src, bytes,
                     heap_.firstId + sigOffset / chunk, sigOffset % chunk, op,  value};
}

Outcome HeapWindow::atomic(int pe, AtomicOp op, uint64_t offset, uint64_t value, uint64_t compare, int width) {
    const std::string why = check(pe, offset, width == 32 ? 4 : 8, "an atomic");
    if (!why.empty()) return Outcome{kErrInvalidArgs, why};
    try {
        const uint64_t old = remote_atomic(*engine_, *peers_[pe], op, heap_.firstId + offset / heap_.chunk,
                                           offset % heap_.chunk, value, compare, width, timeout_);
        return Outcome{kSuccess, "", old};
    } catch (const std::invalid_argument& e) {
        return Outcome{kErrInvalidArgs, e.what()};
    } catch (const std::exception& e) {
        return Outcome{kErrBadState, e.what()};
    }
}

bool HeapWindow::plain(uint64_t dest, uint64_t src, uint64_t bytes, int pe, Plain& out) const {
    if (pe < 0 || static_cast<size_t>(pe) >= peers_.size() || !peers_[pe] || bytes == 0 || !in_heap(dest, bytes))
        return false;
    const uint64_t off = dest - heap_.base;
    if (off < heap_.reserved || !live_->find(off, bytes)) return false;
    Local where;
    if (!find_local(src, bytes, where)) return false;
    out = Plain{pe, where, src, off, bytes};
    return true;
}

Outcome HeapWindow::run_plain(const Plain& p) {
    return run(*peers_[p.pe], kOpWrite, p.local, p.src, p.offset, p.bytes);
}

HeapWindow::Posted HeapWindow::post(Op op, int pe, uint64_t offset, uint64_t local, uint64_t bytes) {
    const std::string why = check(pe, offset, bytes, op == kOpWrite ? "a put" : "a get");
    if (!why.empty()) throw std::invalid_argument(why);
    Posted posted;
    // Nothing to move (a put with signal of no rows: its signal still follows): no transfer, and
    // no registration, which UCX refuses for an empty range.
    if (bytes == 0) return posted;
    Local where;
    if (!find_local(local, bytes, where)) {
        // A kernel's buffer: GPU memory first where the heap is (the usual one), else host memory.
        posted.lease = lease(local, bytes, heap_.gpu, true);
        where = Local{false, posted.lease->id, posted.lease->addr};
    }
    posted.parts = submit(*peers_[pe], op, where, local, offset, bytes);
    return posted;
}

void HeapWindow::check_one_message(int pe, uint64_t offset, uint64_t bytes, uint64_t sigOffset, bool sourceFits,
                                   const char* from) const {
    const std::string why = check_signal_put(pe, offset, bytes, sigOffset);
    if (!why.empty()) throw std::invalid_argument(why);
    if (!sourceFits || !fits_one_message(offset, bytes))
        throw std::invalid_argument("one message carries a put with signal of 1 to " +
                                    std::to_string(kMaxSignalPutBytes) + " bytes" + from +
                                    " into one chunk of the remote heap");
}

std::unique_ptr<AtomicInFlight> HeapWindow::start_signal_put(int pe, uint64_t offset, uint64_t local, uint64_t bytes,
                                                             uint64_t sigOffset, AtomicOp op, uint64_t value) {
    check_one_message(pe, offset, bytes, sigOffset, in_heap(local, bytes), " from the local heap");
    Staged staged;  // its bytes are copied into the request: staged may go once it is sent (checked first)
    return std::make_unique<AtomicInFlight>(
        *engine_, peers_[pe], signal_put(offset, host_bytes(local, bytes, staged), bytes, sigOffset, op, value),
        timeout_);
}

std::unique_ptr<AtomicInFlight> HeapWindow::start_signal_put_bytes(int pe, uint64_t offset, const void* data,
                                                                   uint64_t bytes, uint64_t sigOffset, AtomicOp op,
                                                                   uint64_t value) {
    check_one_message(pe, offset, bytes, sigOffset, true, "");
    return std::make_unique<AtomicInFlight>(*engine_, peers_[pe], signal_put(offset, data, bytes, sigOffset, op, value),
                                            timeout_);
}

std::unique_ptr<AtomicInFlight> HeapWindow::start_atomic(int pe, AtomicOp op, uint64_t offset, uint64_t value,
                                                         uint64_t compare, int width) {
    const std::string why = check(pe, offset, width == 32 ? 4 : 8, "an atomic");
    if (!why.empty()) throw std::invalid_argument(why);
    return std::make_unique<AtomicInFlight>(*engine_, peers_[pe], op, heap_.firstId + offset / heap_.chunk,
                                            offset % heap_.chunk, value, compare, width, timeout_);
}

}  // namespace mori::ucx
