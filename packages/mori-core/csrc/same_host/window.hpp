// The same-host path's direct copies: an initiator copies a small transfer itself
// (process_vm_readv/process_vm_writev into the target), with no target thread involved, checked
// against the target's registrations as the target would check it.
//
// The target publishes its host regions in a window: a memfd it maps read-write and seals against
// any other writable mapping (F_SEAL_FUTURE_WRITE), so an initiator can only read it. Each slot
// holds one region (id, address, size) and a word: its generation, and whether it is live. Each
// initiator connection gets a pin array of its own (a memfd of one counter per slot) that the
// initiator writes and the target reads. Both come with the hello reply (SCM_RIGHTS), after the
// target admitted the ticket and proved the initiator's pid.
//
// An initiator's access: read the slot's word (live, generation g) and its region, add a pin to
// the slot, read the word again (sequentially consistent both): unchanged, the region cannot be
// withdrawn until the pin drops; then check every block against the region and copy. The target
// withdraws a region by making its word not live, then waits (within the deregistration's
// deadline) until no connection holds a pin on the slot; either the initiator sees the word
// change, or the target sees the pin. Pins of an initiator process that is gone (its pidfd is
// readable) are not waited for: it can copy no more.
//
// Anything the initiator cannot check here (a region not in the window: not registered, GPU
// memory, a full window; a block outside the region; the word changing under it) goes through
// the target's service thread and its checks instead (ring.hpp), which answer with the same
// codes and messages: the window only ever speeds up transfers the target would serve.
//
// Why the window is not a security boundary: the kernel allows an initiator to copy into the
// target only when it may ptrace the target (same user and Yama's rules, or CAP_SYS_PTRACE), which
// allows it any access anyway. What the window keeps is the target's rules for mori's own
// initiators: nothing moves outside a live registration, and deregistration waits for copies.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/ops.hpp"
#include "batch/plan.hpp"

namespace mori::ucx::same_host {

constexpr uint32_t kWindowMagic = 0x4d535731;  // "1WSM"
constexpr size_t kWindowSlots = 1024;          // regions published; more go through the service only
// A transfer of at most this many bytes (and one request's blocks) is copied by its initiator.
// Larger ones go to the target's thread: the call that starts them returns at once, and their
// copy overlaps the caller's own work, as on every other path. Unless that thread is busy with
// other initiators' requests (WindowHeader::queued): then a transfer would wait for it anyway, and
// many initiators copying for themselves use every core instead of that one thread's.
constexpr uint64_t kDirectMaxBytes = 64 << 10;

struct WindowHeader {
    uint32_t magic, slots;
    uint64_t probe;     // the address of nonce in the target's own memory
    uint8_t nonce[16];  // what an initiator must read there: the pid it copies into is the target's
    // Initiators whose requests waited for the target's thread at its last look (0 while it
    // sleeps): from 2 on, an initiator copies a larger transfer itself too (kDirectMaxBytes).
    std::atomic<uint32_t> queued;
    uint8_t pad[28];
};
struct WindowSlot {
    std::atomic<uint64_t> word;  // generation << 1 | live
    std::atomic<uint64_t> id, addr, size;
    uint8_t pad[32];
};
static_assert(sizeof(WindowHeader) == 64 && offsetof(WindowHeader, queued) == 32 && sizeof(WindowSlot) == 64,
              "same-host window layout");
constexpr size_t kWindowBytes = sizeof(WindowHeader) + kWindowSlots * sizeof(WindowSlot);
constexpr size_t kPinBytes = kWindowSlots * sizeof(std::atomic<uint32_t>);
constexpr size_t kNotes = 1024;  // notes of one connection not yet recorded; more go through the ring

// Moves every byte of iovs (local and remote of equal segment sizes) with process_vm_readv
// (intoLocal) or process_vm_writev, resuming after partial copies. 0, or the errno of the first
// failure. Both sides' copies.
int copy_all(pid_t pid, bool intoLocal, iovec* local, iovec* remote, size_t count);

// A pidfd of the process behind Unix socket fd (SO_PEERPIDFD, else pidfd_open of pid, the
// socket's SO_PEERCRED); -1 when the kernel has neither.
int peer_pidfd(int fd, pid_t pid);
// Sends msg on a Unix socket with nfds (at most 2) fds beside it (SCM_RIGHTS); sendmsg's result
// (errno kept).
ssize_t send_with_fds(int fd, const void* msg, size_t len, const int* fds, size_t nfds, int flags);

// Receives one message into buf with up to maxFds fds passed beside it (SCM_RIGHTS) into fds
// (-1 where none; all closed when the control data was cut); recvmsg's result (errno kept).
ssize_t recv_with_fds(int fd, void* buf, size_t len, int flags, int* fds, size_t maxFds);

// One initiator connection's pins and notes, as the target holds them. The notes: a direct
// copy that notifies writes (uid, code) into a ring in the same memfd before it reports success;
// the target moves them into its completion records before every lookup of those
// (InboundRecords' feed) and from its own thread.
struct Pins {
    ~Pins();
    int fd = -1;                      // the memfd, until it was sent
    int pidfd = -1;                   // the initiator process: readable once it is gone
    std::string key;                  // the engine its ticket admitted: its notes are recorded as its
    uint8_t* base = nullptr;          // the memfd's mapping
    std::atomic<bool> closed{false};  // its connection ended: dropped once its pins are 0
    bool gone() const;                // the process exited: its pins no longer count
    std::atomic<uint32_t>* counts() const;
};

// Why a record of a same-host note is made: (engine key, uid, code).
using RecordNote = std::function<void(const std::string&, uint64_t, int)>;

// The connection of p ended: no pin taken from now on holds (the initiator backs off), and p goes
// once its counts are 0.
void revoke(Pins& p);

// The target's window (see the top of this file).
class Window {
public:
    // Null, with why, when the kernel refused the memfd or its seals. record: where the notes go.
    static std::unique_ptr<Window> create(RecordNote record, std::string& why);
    ~Window();
    int fd() const { return fd_; }
    // Publishes a host region (nothing when every slot is taken: it is served by the thread).
    void publish(uint64_t id, uint64_t addr, uint64_t size);
    // Withdraws region id (no initiator starts a copy into it after this returns or fails) and
    // waits until no live initiator holds a pin on it, up to deadlineNs; false when some still do.
    bool withdraw(uint64_t id, int64_t deadlineNs);
    void withdraw_all(int64_t deadlineNs);
    // What the target's thread found at its last look: initiators with requests waiting.
    void set_queued(uint32_t n);
    // The pins of a new connection from the process of pidfd (taken over): null when the kernel
    // refused the memfd (that initiator then uses the service only).
    std::shared_ptr<Pins> add_pins(int pidfd, const std::string& key);
    // Records every connection's notes (any thread); malformed ones are skipped and counted.
    void drain();
    uint64_t malformed() const { return malformed_.load(std::memory_order_relaxed); }

private:
    Window() = default;
    WindowSlot& slot(size_t i) const;
    uint64_t pinned(size_t i);   // pins held on slot i by live initiators (prunes ended connections)
    void drain_locked(Pins& p);  // pinsMu_ held
    void reclaim_locked();       // slots withdrawn while pinned go back to the free list once unpinned
    int fd_ = -1;
    uint8_t* base_ = nullptr;
    uint8_t nonce_[16] = {};
    std::mutex mu_;
    std::unordered_map<uint64_t, size_t> slots_;  // published id -> slot
    std::vector<size_t> free_, retired_;
    std::mutex pinsMu_;
    std::vector<std::shared_ptr<Pins>> pins_;
    RecordNote record_;
    std::atomic<uint64_t> malformed_{0};
};

// An initiator's view of one target's window: the window read-only, its own pins, the target's pid.
class DirectPath {
public:
    // Maps windowFd and pinsFd (checked: memfds of the right sizes that cannot shrink) and proves
    // that pid is the window's owner and that the kernel lets this process copy into it (reading
    // the window's nonce there). Null with why otherwise. The fds are not closed here.
    static std::unique_ptr<DirectPath> open(int windowFd, int pinsFd, pid_t pid, std::string& why);
    ~DirectPath();
    enum class Result {
        kDone,     // every byte moved
        kService,  // not checkable here: the caller sends it to the target's thread
        kFailed,   // the copy failed (err): the target is gone or refused the kernel's access
    };
    // Copies rows (local address, remote offset, bytes) of local memory to or from the target's
    // region remoteId (write: into the target).
    Result copy(Op op, const plan::Row* rows, size_t n, uint64_t remoteId, int& err);
    // Writes the notification of a transfer that succeeded into this connection's notes; false
    // when they are full (the caller sends it through the ring).
    bool note(uint64_t uid);
    // Whether the target's thread has other initiators' requests waiting (a larger transfer is
    // then copied here too).
    bool target_busy() const;

private:
    DirectPath() = default;
    // The slot holding remoteId, pinned, with its region; false (nothing pinned) when there is none.
    bool pin(uint64_t remoteId, size_t& slot, uint64_t& addr, uint64_t& size);
    bool pin_slot(size_t i, uint64_t remoteId, uint64_t& addr, uint64_t& size);
    const WindowSlot& slot(size_t i) const;
    pid_t pid_ = 0;
    const uint8_t* window_ = nullptr;
    uint8_t* pins_ = nullptr;  // this connection's pins and notes (its memfd)
    std::mutex notesMu_;       // one writer of the notes at a time
    // Where each remote id was last found, by id modulo its size: a hint, checked by pin_slot.
    std::atomic<uint32_t> cache_[64] = {};
};

}  // namespace mori::ucx::same_host
