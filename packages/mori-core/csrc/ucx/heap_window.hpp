// The remote side of one symmetric heap on the UCX engine: one object per heap, which
// mori.shmem's host API (mori.core.ucx.UcxHeapWindow) and the device proxy (proxy/) both call,
// as PyTorch's SymmetricMemory is one object per allocation for host code and kernels alike.
//
// It owns:
// - the heap's memory ids: chunk k of the heap (`chunk` bytes at k * chunk) is memory id
//   firstId + k on every PE alike, registered as the heap grows (grow). A transfer is cut where
//   a chunk of either side ends, and its rows grouped by (local id, remote id): one engine batch
//   per pair, one row unless it crosses a chunk;
// - the local side of every transfer, in this order: inside the local heap it goes as is; inside
//   a buffer registered for good (register_buffer: mori.shmem's shmem_buffer_register, the
//   proxy's bounce area) too; host memory of at most kStagingBytes elsewhere is copied through
//   the window's staging area (host calls, one at a time: the transfer is waited for there);
//   anything else is registered for the transfer (a Lease, shared by the transfers in flight in
//   the same range, released when the last of them ends);
// - every operation on a remote PE's heap (put, get, put with signal, atomic), each checked here
//   once: the PE has a peer, the range lies in the heap. The target checks it again against its
//   own registrations before it touches a byte.
//
// Host operations (put, get, put_signal, atomic) are complete when they return, or failed: the
// Outcome says how (a TransferCode and why). The device proxy posts with post() and
// start_atomic(), which throw std::invalid_argument for a bad command, and waits itself.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "host/live_ranges.hpp"
#include "ucx/atomic.hpp"
#include "ucx/engine.hpp"
#include "ucx/gpu.hpp"

namespace mori::ucx {

// Bytes of the staging area: host memory elsewhere up to this size is copied through it.
inline constexpr uint64_t kStagingBytes = 48 << 10;

struct HeapLayout {
    uint64_t base = 0, size = 0;  // the local heap (every PE's heap has this size)
    uint64_t reserved = 0;        // bytes at its start that no plain put writes (mori's own area)
    uint64_t chunk = 0;           // bytes per memory id; divides size
    uint64_t firstId = 0;         // memory id of chunk 0
    bool gpu = false;             // every PE's heap is GPU memory
};

// How a host operation ended: code kSuccess (value: an atomic's old value), kInProgress when it
// did not finish within the window's wait, another TransferCode when it failed (message: why).
struct Outcome {
    int code = kSuccess;
    std::string message;
    uint64_t value = 0;
};

// Memory registered for the transfers in flight that lie in it; deregistered when the last goes.
struct Lease {
    std::shared_ptr<Engine> engine;
    uint64_t id = 0, addr = 0, bytes = 0;
    ~Lease();
};

class HeapWindow {
public:
    // peers[pe]: the endpoints to PE pe (null for a PE reached otherwise). timeout: seconds an
    // atomic may take (the engine's); a host transfer is waited for 5 s longer, so that the
    // engine's own failure, which names what was missing, arrives first.
    HeapWindow(std::shared_ptr<Engine> engine, std::shared_ptr<memory::LiveRanges> live, const HeapLayout& heap,
               std::vector<std::shared_ptr<Peer>> peers, double timeout);
    ~HeapWindow();
    HeapWindow(const HeapWindow&) = delete;
    HeapWindow& operator=(const HeapWindow&) = delete;

    // Registers the heap's chunks in [registered(), end): the heap as mapped so far.
    void grow(uint64_t end);
    uint64_t registered() const { return registered_.load(); }
    // Registers [addr, addr + bytes) for good, as GPU memory when gpu (as host memory where the
    // engine refuses that); throws std::invalid_argument when it overlaps a registered buffer.
    void register_buffer(uint64_t addr, uint64_t bytes, bool gpu);
    // Releases the buffer registered at addr (waiting, at most the engine's timeout, for
    // transfers still using it); false when none is.
    bool deregister_buffer(uint64_t addr);

    // Host operations: complete, or failed, on return. localGpu: local is GPU memory.
    Outcome put(int pe, uint64_t offset, uint64_t local, uint64_t bytes, bool localGpu);
    Outcome get(int pe, uint64_t offset, uint64_t local, uint64_t bytes, bool localGpu);
    // A put, then op (store or fetch_add) with value on the 64-bit word at sigOffset: one message
    // up to kMaxSignalPutBytes of host memory, else the put, complete, then the atomic.
    Outcome put_signal(int pe, uint64_t offset, uint64_t local, uint64_t bytes, bool localGpu, uint64_t sigOffset,
                       AtomicOp op, uint64_t value);
    Outcome atomic(int pe, AtomicOp op, uint64_t offset, uint64_t value, uint64_t compare, int width);
    // The usual put of a host caller: dest an address of the heap inside one live block (past
    // the reserved bytes), src inside the local heap or a registered buffer, pe with a peer.
    // plain() checks (with the GIL held: the live blocks are the allocator's, which changes them
    // under it) and is false, with nothing done, for any other call (the caller's checked path
    // says what is wrong); run_plain() then moves it.
    struct Local {          // where the local side of a transfer lies
        bool heap = false;  // in the local heap: cut per chunk (id unused)
        uint64_t id = 0;    // else its memory id
        uint64_t base = 0;  // and the address that id starts at
    };
    struct Plain {
        int pe = -1;
        Local local;
        uint64_t src = 0, offset = 0, bytes = 0;
    };
    bool plain(uint64_t dest, uint64_t src, uint64_t bytes, int pe, Plain& out) const;
    Outcome run_plain(const Plain& p);

    // For the device proxy: posts a transfer, waits for nothing. The lease (null for the heap
    // and registered buffers) must outlive the transfer's parts.
    struct Posted {
        std::vector<std::shared_ptr<Transfer>> parts;
        std::shared_ptr<Lease> lease;
    };
    Posted post(Op op, int pe, uint64_t offset, uint64_t local, uint64_t bytes);
    std::unique_ptr<AtomicInFlight> start_atomic(int pe, AtomicOp op, uint64_t offset, uint64_t value, uint64_t compare,
                                                 int width);
    // A put with signal that one_message() allows, as one message (the bytes copied into it, out
    // of the GPU first on a GPU heap); throws std::invalid_argument for any other put, or a range
    // outside the heap.
    std::unique_ptr<AtomicInFlight> start_signal_put(int pe, uint64_t offset, uint64_t local, uint64_t bytes,
                                                     uint64_t sigOffset, AtomicOp op, uint64_t value);
    // The same for bytes the caller holds in host memory at `data` (a kernel's inline bytes), into
    // one chunk of the PE's heap (fits_one_message); throws std::invalid_argument otherwise.
    std::unique_ptr<AtomicInFlight> start_signal_put_bytes(int pe, uint64_t offset, const void* data, uint64_t bytes,
                                                           uint64_t sigOffset, AtomicOp op, uint64_t value);

    // Transfers whose local side went through the staging area, and that were registered for
    // the transfer; buffers registered now.
    struct Stats {
        uint64_t staged = 0, registeredForCall = 0, buffers = 0;
    };
    Stats stats() const;
    const std::shared_ptr<Engine>& engine() const { return engine_; }
    // Whether a put with signal of bytes from local to heap offset `offset` can travel as one
    // message: 1 to kMaxSignalPutBytes from the local heap, into one chunk (memory id) of the PE's.
    bool one_message(uint64_t offset, uint64_t local, uint64_t bytes) const {
        return in_heap(local, bytes) && fits_one_message(offset, bytes);
    }
    // Whether 1 to kMaxSignalPutBytes at heap offset `offset` lie in one chunk (memory id).
    bool fits_one_message(uint64_t offset, uint64_t bytes) const {
        return bytes != 0 && bytes <= kMaxSignalPutBytes && one_chunk(offset, bytes);
    }
    double timeout() const { return timeout_; }
    // Releases the buffers and the staging area, and lets the peers go (the window takes no
    // operation after it).
    void close();

private:
    struct Buffer {
        uint64_t bytes, id;
    };
    std::shared_ptr<Peer> peer(int pe) const;
    // "" when pe has a peer and [offset, offset + bytes) lies in the heap; else why not.
    std::string check(int pe, uint64_t offset, uint64_t bytes, const char* what) const;
    bool in_heap(uint64_t addr, uint64_t bytes) const {
        return addr >= heap_.base && bytes <= heap_.size && addr - heap_.base <= heap_.size - bytes;
    }
    bool one_chunk(uint64_t offset, uint64_t bytes) const {
        return bytes == 0 || offset / heap_.chunk == (offset + bytes - 1) / heap_.chunk;
    }
    bool find_local(uint64_t addr, uint64_t bytes, Local& out) const;  // the heap or a registered buffer
    // "" when pe has a peer and both a put with signal's range and its signal word lie in the heap.
    std::string check_signal_put(int pe, uint64_t offset, uint64_t bytes, uint64_t sigOffset) const;
    // check_signal_put, then whether the put goes as one message (its source fits, named by
    // `from` in the message, and fits_one_message): std::invalid_argument when either fails.
    void check_one_message(int pe, uint64_t offset, uint64_t bytes, uint64_t sigOffset, bool sourceFits,
                           const char* from) const;
    // The bytes at local as host memory: the heap's GPU bytes copied out into `staged` (waited
    // for, through the engine's GPU staging; std::runtime_error when the engine has none or the
    // copy failed), else local itself.
    const void* host_bytes(uint64_t local, uint64_t bytes, Staged& staged) const;
    // The signal put of the host bytes at src to heap offset `offset` (one chunk), with its signal.
    SignalPut signal_put(uint64_t offset, const void* src, uint64_t bytes, uint64_t sigOffset, AtomicOp op,
                         uint64_t value) const;
    // Memory registered for the transfers in flight in [addr, addr + bytes) (shared with those
    // already holding it): as GPU memory when gpu; eitherKind: as the other kind where refused.
    std::shared_ptr<Lease> lease(uint64_t addr, uint64_t bytes, bool gpu, bool eitherKind);
    // Posts the rows of a transfer between local (at address addr) and heap offset remote of to.
    std::vector<std::shared_ptr<Transfer>> submit(Peer& to, Op op, const Local& local, uint64_t addr, uint64_t remote,
                                                  uint64_t bytes);
    // submit, then waits for every part (none may still use the local side once it returns).
    Outcome run(Peer& to, Op op, const Local& local, uint64_t addr, uint64_t remote, uint64_t bytes);
    Outcome transfer(Op op, int pe, uint64_t offset, uint64_t local, uint64_t bytes, bool localGpu);

    std::shared_ptr<Engine> engine_;
    std::shared_ptr<memory::LiveRanges> live_;
    HeapLayout heap_;
    std::vector<std::shared_ptr<Peer>> peers_;
    double timeout_, waitFor_;
    std::atomic<uint64_t> registered_{0};
    std::atomic<uint64_t> nextId_;
    mutable std::mutex mu_;               // buffers_ and leases_
    std::map<uint64_t, Buffer> buffers_;  // by address
    std::vector<std::weak_ptr<Lease>> leases_;
    std::mutex stagingMu_;  // one staged transfer at a time
    std::vector<uint8_t> staging_;
    uint64_t stagingId_ = 0;
    std::atomic<uint64_t> staged_{0}, forCall_{0};
};

}  // namespace mori::ucx
