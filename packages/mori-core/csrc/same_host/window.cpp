// The same-host path's direct copies (see same_host/window.hpp): the target's window of its
// host regions and the pins of its initiators; an initiator's checks and copies.
#include "same_host/window.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "base/transfer.hpp"
#include "same_host/ring.hpp"

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010  // Linux 5.1
#endif

namespace mori::ucx::same_host {

namespace {

// The pin array's first line: the target sets revoked when the connection ended; an initiator
// that finds it set after pinning backs off (so the target can let the array go once it is 0).
struct PinHeader {
    std::atomic<uint32_t> revoked;
    uint8_t pad[60];
};
// The notes after the counts: a ring the initiator writes at head and the target reads at tail.
struct NoteHeader {
    std::atomic<uint64_t> head;  // the initiator's: notes written
    uint8_t pad[56];
    std::atomic<uint64_t> tail;  // the target's: notes recorded
    uint8_t pad2[56];
};
struct NoteEntry {
    std::atomic<uint64_t> uid;
    std::atomic<int64_t> code;
};
static_assert(sizeof(PinHeader) == 64 && sizeof(NoteHeader) == 128 && sizeof(NoteEntry) == 16,
              "same-host pin and note layout");
constexpr size_t kNotesAt = sizeof(PinHeader) + kPinBytes;
constexpr size_t kPinFileBytes = kNotesAt + sizeof(NoteHeader) + kNotes * sizeof(NoteEntry);

PinHeader& pin_header(void* base) { return *static_cast<PinHeader*>(base); }
std::atomic<uint32_t>* pin_counts(void* base) {
    return reinterpret_cast<std::atomic<uint32_t>*>(static_cast<uint8_t*>(base) + sizeof(PinHeader));
}
NoteHeader& note_header(void* base) { return *reinterpret_cast<NoteHeader*>(static_cast<uint8_t*>(base) + kNotesAt); }
NoteEntry* note_entries(void* base) {
    return reinterpret_cast<NoteEntry*>(static_cast<uint8_t*>(base) + kNotesAt + sizeof(NoteHeader));
}

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

// A new sealed memfd of bytes, mapped read-write; its fd (-1 with errno set on failure).
int sealed_memfd(const char* name, size_t bytes, unsigned seals, void*& map) {
    int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return -1;
    map = MAP_FAILED;
    if (::ftruncate(fd, static_cast<off_t>(bytes)) == 0)
        map = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    // Sealed after the mapping: F_SEAL_FUTURE_WRITE refuses writable mappings made after it.
    if (map == MAP_FAILED || fcntl(fd, F_ADD_SEALS, seals | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        const int err = errno;
        if (map != MAP_FAILED) ::munmap(map, bytes);
        ::close(fd);
        errno = err;
        return -1;
    }
    return fd;
}

// fd's mapping when it is a memfd of bytes that cannot shrink; null otherwise.
void* map_checked(int fd, size_t bytes, int prot) {
    struct stat st{};
    const int seals = fcntl(fd, F_GET_SEALS);
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size != static_cast<off_t>(bytes) || seals < 0 ||
        !(seals & F_SEAL_SHRINK))
        return nullptr;
    void* p = ::mmap(nullptr, bytes, prot, MAP_SHARED, fd, 0);
    return p == MAP_FAILED ? nullptr : p;
}

}  // namespace

int peer_pidfd(int fd, pid_t pid) {
#ifndef SO_PEERPIDFD
    constexpr int SO_PEERPIDFD = 77;  // Linux 6.5
#endif
    int pidfd = -1;
    socklen_t len = sizeof(pidfd);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &len) == 0 && pidfd >= 0) return pidfd;
    return static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
}

ssize_t send_with_fds(int fd, const void* msg, size_t len, const int* fds, size_t nfds, int flags) {
    iovec v{const_cast<void*>(msg), len};
    alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))] = {};
    msghdr m{};
    m.msg_iov = &v;
    m.msg_iovlen = 1;
    m.msg_control = control;
    m.msg_controllen = CMSG_SPACE(nfds * sizeof(int));
    cmsghdr* cm = CMSG_FIRSTHDR(&m);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(nfds * sizeof(int));
    std::memcpy(CMSG_DATA(cm), fds, nfds * sizeof(int));
    return ::sendmsg(fd, &m, flags);
}

ssize_t recv_with_fds(int fd, void* buf, size_t len, int flags, int* fds, size_t maxFds) {
    std::fill(fds, fds + maxFds, -1);
    iovec v{buf, len};
    alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))];
    msghdr m{};
    m.msg_iov = &v;
    m.msg_iovlen = 1;
    m.msg_control = control;
    m.msg_controllen = sizeof(control);
    const ssize_t n = ::recvmsg(fd, &m, flags | MSG_CMSG_CLOEXEC);
    size_t got = 0;
    for (cmsghdr* cm = n >= 0 ? CMSG_FIRSTHDR(&m) : nullptr; cm != nullptr; cm = CMSG_NXTHDR(&m, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
        for (size_t i = 0; i < (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int); ++i) {
            int passed;
            std::memcpy(&passed, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
            if (got < maxFds && !(m.msg_flags & MSG_CTRUNC))
                fds[got++] = passed;
            else
                ::close(passed);
        }
    }
    return n;
}

int copy_all(pid_t pid, bool intoLocal, iovec* local, iovec* remote, size_t count) {
    size_t first = 0;
    while (first < count) {
        const size_t cnt = count - first;
        ssize_t n = intoLocal ? process_vm_readv(pid, &local[first], cnt, &remote[first], cnt, 0)
                              : process_vm_writev(pid, &local[first], cnt, &remote[first], cnt, 0);
        if (n < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (n == 0) return EFAULT;
        size_t left = static_cast<size_t>(n);
        while (first < count && left >= local[first].iov_len) left -= local[first++].iov_len;
        if (left > 0) {
            for (auto* v : {&local[first], &remote[first]}) {
                v->iov_base = static_cast<char*>(v->iov_base) + left;
                v->iov_len -= left;
            }
        }
        while (first < count && local[first].iov_len == 0) ++first;
    }
    return 0;
}

// ---- the target's side --------------------------------------------------------------------------

std::atomic<uint32_t>* Pins::counts() const { return pin_counts(base); }

Pins::~Pins() {
    if (base != nullptr) ::munmap(base, kPinFileBytes);
    for (int f : {fd, pidfd})
        if (f >= 0) ::close(f);
}

bool Pins::gone() const {
    struct pollfd p{pidfd, POLLIN, 0};
    return ::poll(&p, 1, 0) > 0;
}

std::unique_ptr<Window> Window::create(RecordNote record, std::string& why) {
    std::unique_ptr<Window> w(new Window());
    w->record_ = std::move(record);
    void* map = nullptr;
    w->fd_ = sealed_memfd("mori-same-host-window", kWindowBytes, F_SEAL_FUTURE_WRITE, map);
    if (w->fd_ < 0) {
        why = "the region window (memfd): " + errno_text(errno);
        return nullptr;
    }
    w->base_ = static_cast<uint8_t*>(map);
    if (getrandom(w->nonce_, sizeof(w->nonce_), 0) != sizeof(w->nonce_)) {
        why = "getrandom failed";
        return nullptr;
    }
    auto& h = *reinterpret_cast<WindowHeader*>(w->base_);
    h.magic = kWindowMagic;
    h.slots = kWindowSlots;
    h.probe = reinterpret_cast<uint64_t>(w->nonce_);
    std::memcpy(h.nonce, w->nonce_, sizeof(h.nonce));
    for (size_t i = kWindowSlots; i > 0; --i) w->free_.push_back(i - 1);
    return w;
}

Window::~Window() {
    if (base_ != nullptr) ::munmap(base_, kWindowBytes);
    if (fd_ >= 0) ::close(fd_);
}

WindowSlot& Window::slot(size_t i) const { return reinterpret_cast<WindowSlot*>(base_ + sizeof(WindowHeader))[i]; }

void Window::publish(uint64_t id, uint64_t addr, uint64_t size) {
    std::lock_guard lk(mu_);
    reclaim_locked();
    if (free_.empty() || slots_.count(id)) return;
    const size_t i = free_.back();
    free_.pop_back();
    WindowSlot& s = slot(i);
    // Written while the slot is not live; an initiator that read them torn sees the word change.
    s.id.store(id, std::memory_order_relaxed);
    s.addr.store(addr, std::memory_order_relaxed);
    s.size.store(size, std::memory_order_relaxed);
    s.word.store(((s.word.load(std::memory_order_relaxed) >> 1) + 1) << 1 | 1, std::memory_order_release);
    slots_[id] = i;
}

bool Window::withdraw(uint64_t id, int64_t deadlineNs) {
    size_t i;
    {
        std::lock_guard lk(mu_);
        auto it = slots_.find(id);
        if (it == slots_.end()) return true;
        i = it->second;
        slots_.erase(it);
        WindowSlot& s = slot(i);
        // Not live, and a new generation: then the pins read (both sequentially consistent).
        s.word.store(((s.word.load(std::memory_order_relaxed) >> 1) + 1) << 1, std::memory_order_seq_cst);
        std::atomic_thread_fence(std::memory_order_release);  // before the slot is written again
    }
    int sleepUs = 20;
    for (;;) {
        const bool free = pinned(i) == 0;
        if (free || now_ns() >= deadlineNs) {
            std::lock_guard lk(mu_);
            (free ? free_ : retired_).push_back(i);
            return free;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(sleepUs));
        sleepUs = std::min(sleepUs * 2, 2000);
    }
}

void Window::set_queued(uint32_t n) {
    std::atomic<uint32_t>& q = reinterpret_cast<WindowHeader*>(base_)->queued;
    if (q.load(std::memory_order_relaxed) != n) q.store(n, std::memory_order_relaxed);  // a line initiators read
}

void Window::withdraw_all(int64_t deadlineNs) {
    std::vector<uint64_t> ids;
    {
        std::lock_guard lk(mu_);
        for (auto& [id, i] : slots_) ids.push_back(id);
    }
    for (uint64_t id : ids) withdraw(id, deadlineNs);
}

void Window::reclaim_locked() {
    for (size_t k = 0; k < retired_.size();) {
        if (pinned(retired_[k]) == 0) {
            free_.push_back(retired_[k]);
            retired_[k] = retired_.back();
            retired_.pop_back();
        } else {
            ++k;
        }
    }
}

uint64_t Window::pinned(size_t i) {
    std::lock_guard lk(pinsMu_);
    uint64_t sum = 0;
    for (size_t k = 0; k < pins_.size();) {
        Pins& p = *pins_[k];
        bool drop = p.gone();  // the process exited: it copies no more
        if (!drop && p.closed.load(std::memory_order_acquire)) {
            // Revoked when its connection ended (Pins::closed): no new pin holds from then on, so
            // once every count is 0 the array can go.
            drop = std::all_of(p.counts(), p.counts() + kWindowSlots,
                               [](const std::atomic<uint32_t>& c) { return c.load(std::memory_order_seq_cst) == 0; });
        }
        if (drop) {
            drain_locked(p);  // what it noted before it went
            pins_[k] = pins_.back();
            pins_.pop_back();
            continue;
        }
        sum += p.counts()[i].load(std::memory_order_seq_cst);
        ++k;
    }
    return sum;
}

void Window::drain() {
    std::lock_guard lk(pinsMu_);
    for (auto& p : pins_) drain_locked(*p);
}

void Window::drain_locked(Pins& p) {
    NoteHeader& h = note_header(p.base);
    const uint64_t tail = h.tail.load(std::memory_order_relaxed);
    const uint64_t head = h.head.load(std::memory_order_acquire);
    if (head == tail) return;
    if (head - tail > kNotes) {  // not a count the initiator can have written: its notes are lost
        malformed_.fetch_add(1, std::memory_order_relaxed);
        h.tail.store(head, std::memory_order_release);
        return;
    }
    for (uint64_t n = tail; n != head; ++n) {
        const NoteEntry& e = note_entries(p.base)[n % kNotes];
        const int64_t code = e.code.load(std::memory_order_relaxed);
        if (code != kSuccess)  // an initiator notes only what it copied whole
            malformed_.fetch_add(1, std::memory_order_relaxed);
        else if (record_)
            record_(p.key, e.uid.load(std::memory_order_relaxed), kSuccess);
    }
    h.tail.store(head, std::memory_order_release);
}

std::shared_ptr<Pins> Window::add_pins(int pidfd, const std::string& key) {
    if (pidfd < 0) return nullptr;
    auto p = std::make_shared<Pins>();
    p->pidfd = pidfd;  // closed with p
    p->key = key;
    void* map = nullptr;
    p->fd = sealed_memfd("mori-same-host-pins", kPinFileBytes, 0, map);
    if (p->fd < 0) return nullptr;
    p->base = static_cast<uint8_t*>(map);
    std::lock_guard lk(pinsMu_);
    pins_.push_back(p);
    return p;
}

void revoke(Pins& p) {
    if (p.base == nullptr) return;
    pin_header(p.base).revoked.store(1, std::memory_order_seq_cst);
    p.closed.store(true, std::memory_order_release);
}

// ---- the initiator's side -------------------------------------------------------------------------

std::unique_ptr<DirectPath> DirectPath::open(int windowFd, int pinsFd, pid_t pid, std::string& why) {
    std::unique_ptr<DirectPath> d(new DirectPath());
    d->pid_ = pid;
    void* w = map_checked(windowFd, kWindowBytes, PROT_READ);
    d->window_ = static_cast<const uint8_t*>(w);
    void* p = map_checked(pinsFd, kPinFileBytes, PROT_READ | PROT_WRITE);
    d->pins_ = static_cast<uint8_t*>(p);
    if (w == nullptr || p == nullptr) {
        why = "the target sent a region window or pin array that is not a sealed memfd of the right size";
        return nullptr;
    }
    const auto& h = *static_cast<const WindowHeader*>(w);
    if (h.magic != kWindowMagic || h.slots != kWindowSlots) {
        why = "the target's region window has another layout";
        return nullptr;
    }
    uint8_t got[sizeof(h.nonce)] = {};
    iovec local{got, sizeof(got)}, remote{reinterpret_cast<void*>(h.probe), sizeof(got)};
    ssize_t n = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (n < 0) {
        why = "process_vm_readv of the target's memory: " + errno_text(errno);
        return nullptr;
    }
    if (n != static_cast<ssize_t>(sizeof(got)) || std::memcmp(got, h.nonce, sizeof(got)) != 0) {
        why = "the process behind the target's socket (pid " + std::to_string(pid) + ") does not own its window";
        return nullptr;
    }
    return d;
}

DirectPath::~DirectPath() {
    if (window_ != nullptr) ::munmap(const_cast<uint8_t*>(window_), kWindowBytes);
    if (pins_ != nullptr) ::munmap(pins_, kPinFileBytes);
}

const WindowSlot& DirectPath::slot(size_t i) const {
    return reinterpret_cast<const WindowSlot*>(window_ + sizeof(WindowHeader))[i];
}

bool DirectPath::pin_slot(size_t i, uint64_t remoteId, uint64_t& addr, uint64_t& size) {
    const WindowSlot& s = slot(i);
    const uint64_t w = s.word.load(std::memory_order_acquire);
    if (!(w & 1) || s.id.load(std::memory_order_relaxed) != remoteId) return false;
    addr = s.addr.load(std::memory_order_relaxed);
    size = s.size.load(std::memory_order_relaxed);
    std::atomic<uint32_t>& pin = pin_counts(pins_)[i];
    pin.fetch_add(1, std::memory_order_seq_cst);
    // Unchanged after the pin: the target's withdrawal, later, waits for it.
    if (s.word.load(std::memory_order_seq_cst) == w && pin_header(pins_).revoked.load(std::memory_order_seq_cst) == 0)
        return true;
    pin.fetch_sub(1, std::memory_order_release);
    return false;
}

bool DirectPath::pin(uint64_t remoteId, size_t& i, uint64_t& addr, uint64_t& size) {
    std::atomic<uint32_t>& hint = cache_[remoteId % (sizeof(cache_) / sizeof(cache_[0]))];
    i = hint.load(std::memory_order_relaxed);
    if (pin_slot(i, remoteId, addr, size)) return true;
    for (i = 0; i < kWindowSlots; ++i) {
        if (!pin_slot(i, remoteId, addr, size)) continue;
        hint.store(static_cast<uint32_t>(i), std::memory_order_relaxed);
        return true;
    }
    return false;
}

bool DirectPath::target_busy() const {
    return reinterpret_cast<const WindowHeader*>(window_)->queued.load(std::memory_order_relaxed) >= 2;
}

bool DirectPath::note(uint64_t uid) {
    std::lock_guard lk(notesMu_);
    NoteHeader& h = note_header(pins_);
    const uint64_t head = h.head.load(std::memory_order_relaxed);
    if (head - h.tail.load(std::memory_order_acquire) >= kNotes) return false;
    NoteEntry& e = note_entries(pins_)[head % kNotes];
    e.uid.store(uid, std::memory_order_relaxed);
    e.code.store(kSuccess, std::memory_order_relaxed);
    h.head.store(head + 1, std::memory_order_release);
    return true;
}

DirectPath::Result DirectPath::copy(Op op, const plan::Row* rows, size_t n, uint64_t remoteId, int& err) {
    size_t i = 0;
    uint64_t addr = 0, size = 0;
    if (n == 0 || n > kMaxEntries || !pin(remoteId, i, addr, size)) return Result::kService;
    thread_local std::vector<iovec> local, remote;  // grown, never shrunk: no allocation per copy
    if (local.size() < n) {
        local.resize(n);
        remote.resize(n);
    }
    Result r = Result::kDone;
    for (size_t k = 0; k < n && r == Result::kDone; ++k) {
        const plan::Row& row = rows[k];
        if (row.dst > size || row.bytes > size - row.dst) r = Result::kService;  // the target refuses it
        local[k] = iovec{reinterpret_cast<void*>(row.src), row.bytes};
        remote[k] = iovec{reinterpret_cast<void*>(addr + row.dst), row.bytes};
    }
    if (r == Result::kDone) {
        err = copy_all(pid_, op == kOpRead, local.data(), remote.data(), n);
        // Refused by the kernel now (the target's ptrace rules changed): the target's thread copies.
        if (err == EPERM || err == EACCES)
            r = Result::kService;
        else if (err != 0)
            r = Result::kFailed;
    }
    pin_counts(pins_)[i].fetch_sub(1, std::memory_order_release);
    return r;
}

}  // namespace mori::ucx::same_host
