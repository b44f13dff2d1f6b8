// The initiator side of the same-host path (see same_host/ring.hpp): the ring, connecting and the
// probe, requests, completions, notifications and deadlines.
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "same_host/ring.hpp"
#include "same_host/window.hpp"
#include "ucx/engine.hpp"
#include "ucx/wire.hpp"

namespace mori::ucx {

namespace {

// A waiter polls its link's ring for about as long as its copy should take (kLeadSpinNs plus its
// bytes at kSpinBytesPerNs), at most kMaxLeadSpinNs; then it sleeps on its transfer. A 4 KiB round
// trip takes a few µs, a 1 MiB copy 60-100.
constexpr int64_t kLeadSpinNs = 50'000, kMaxLeadSpinNs = 1'000'000;
// ...unless its oldest request is still unclaimed this long after it began: the target's thread
// serves other initiators' rings first. Then it sleeps at once: many initiators polling while they
// queue take the cores that thread needs (16 initiators moved half of one initiator's bytes).
constexpr int64_t kQueuedSpinNs = 20'000;
constexpr uint64_t kSpinBytesPerNs = 8;

std::string pid_namespace() {
    struct stat st{};
    return ::stat("/proc/self/ns/pid", &st) == 0 ? std::to_string(st.st_ino) : std::string();
}

sockaddr_un abstract_address(const std::string& name, socklen_t& len) {
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    if (name.size() + 1 > sizeof(a.sun_path)) throw std::invalid_argument("same-host socket name too long");
    a.sun_path[0] = '\0';  // abstract: no file, gone with the process
    std::memcpy(a.sun_path + 1, name.data(), name.size());
    len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    return a;
}

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

}  // namespace

namespace same_host {

void relax(int& polls) {
    if (++polls % kPollPauses != 0) {
        __builtin_ia32_pause();
        return;
    }
    sched_yield();
}

Ring::~Ring() {
    if (base_ != nullptr) ::munmap(base_, kRingBytes);
}

bool Ring::create(int& fd) {
    fd = memfd_create("mori-same-host-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return false;
    // Sealed so that it can never shrink: the target maps it and must not fault on it.
    if (::ftruncate(fd, kRingBytes) != 0 || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        const int err = errno;
        ::close(fd);
        errno = err;
        return false;
    }
    void* p = ::mmap(nullptr, kRingBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        const int err = errno;
        ::close(fd);
        errno = err;
        return false;
    }
    base_ = static_cast<uint8_t*>(p);  // zeroed: every slot free
    return true;
}

bool Ring::attach(int fd) {
    struct stat st{};
    const int seals = fcntl(fd, F_GET_SEALS);
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size != static_cast<off_t>(kRingBytes) || seals < 0 ||
        !(seals & F_SEAL_SHRINK))
        return false;
    void* p = ::mmap(nullptr, kRingBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return false;
    base_ = static_cast<uint8_t*>(p);
    return true;
}

}  // namespace same_host

namespace same_host {

std::string contact(const std::string& hostKey, const std::string& socketName) {
    return "mori-same-host/1 " + hostKey + " " + pid_namespace() + " " + socketName;
}

std::string reachable_socket(const std::string& contact, const std::string& hostKey) {
    std::istringstream in(contact);
    std::string tag, host, pidns, name, extra;
    if (!(in >> tag >> host >> pidns >> name) || (in >> extra) || tag != "mori-same-host/1") return "";
    if (host != hostKey || pidns != pid_namespace() || pidns.empty()) return "";
    return name;
}

}  // namespace same_host

bool Outbox::send(int fd, const void* msg, size_t len, int& err) {
    if (queued.empty()) {
        ssize_t n = ::send(fd, msg, len, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n == static_cast<ssize_t>(len)) return true;
        if (n >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
            err = n >= 0 ? EMSGSIZE : errno;
            return false;
        }
    }
    queued.emplace_back(static_cast<const char*>(msg), len);
    return true;
}

bool Outbox::flush(int fd, int& err) {
    while (!queued.empty()) {
        const std::string& m = queued.front();
        ssize_t n = ::send(fd, m.data(), m.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
        if (n != static_cast<ssize_t>(m.size())) {
            err = n >= 0 ? EMSGSIZE : errno;
            return false;
        }
        queued.pop_front();
    }
    return true;
}

SameHostLink::SameHostLink(Engine& engine, std::shared_ptr<PeerState> peer, int fd)
    : engine_(engine), peer_(std::move(peer)), fd_(fd) {}

SameHostLink::~SameHostLink() {
    if (fd_ >= 0) ::close(fd_);
}

namespace {

// Waits, within the engine's timeout, for the target's answer to the hello and the fds beside
// it (its window and our pins, when it offers direct copies; -1 else); false with why set when
// none came or the target closed the socket.
bool await_hello_reply(int fd, const EngineOptions& opts, const std::string& who, same_host::HelloReply& r,
                       int (&fds)[2], std::string& why) {
    const int64_t deadline = now_ns() + static_cast<int64_t>(opts.timeout * 1e9);
    for (;;) {
        struct pollfd p{fd, POLLIN, 0};
        int64_t left = deadline - now_ns();
        if (left <= 0) {
            why = who + " did not answer on its same-host socket within " + std::to_string(opts.timeout) + " s (" +
                  opts.timeoutSetting + ")";
            return false;
        }
        if (::poll(&p, 1, static_cast<int>(std::min<int64_t>(left / 1'000'000 + 1, 1000))) <= 0) continue;
        const ssize_t n = same_host::recv_with_fds(fd, &r, sizeof(r), 0, fds, 2);
        if (n == sizeof(r) && r.magic == same_host::kMagic && r.type == same_host::kHelloReply) return true;
        why = who + " closed its same-host socket (it refused our ticket or ring, or is not a mori engine)";
        return false;
    }
}

}  // namespace

std::shared_ptr<SameHostLink> SameHostLink::open(Engine& engine, const std::shared_ptr<PeerState>& peer,
                                                 const std::string& socketName, std::string& why) {
    const std::string who = "engine '" + peer->key + "'";
    int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        why = "socket: " + errno_text(errno);
        return nullptr;
    }
    auto link = std::make_shared<SameHostLink>(engine, peer, fd);  // closes fd if we give up
    int ringFd = -1;
    if (!link->ring_.create(ringFd)) {
        why = "the request ring (memfd): " + errno_text(errno);
        return nullptr;
    }
    socklen_t len;
    sockaddr_un a = abstract_address(socketName, len);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), len) != 0) {
        ::close(ringFd);
        why = "connecting to " + who + "'s same-host socket: " + errno_text(errno);
        return nullptr;
    }
    // The nonce the target must read from this process's memory: it proves that process_vm_*
    // works between the two (ptrace rules allow it) and that the kernel's pid is ours.
    same_host::Hello h{same_host::kMagic, same_host::kHello, {}, peer->ticket, 0, {}};
    if (getrandom(h.nonce, sizeof(h.nonce), 0) != sizeof(h.nonce)) {
        ::close(ringFd);
        why = "getrandom failed";
        return nullptr;
    }
    static thread_local uint8_t probe[sizeof(h.nonce)];
    std::memcpy(probe, h.nonce, sizeof(probe));
    h.probe = reinterpret_cast<uint64_t>(probe);
    const ssize_t sent = same_host::send_with_fds(fd, &h, sizeof(h), &ringFd, 1, MSG_NOSIGNAL);
    const int sendErr = errno;
    ::close(ringFd);  // the target holds its own copy now; the mapping keeps ours
    if (sent != sizeof(h)) {
        why = "sending to " + who + "'s same-host socket: " + errno_text(sendErr);
        return nullptr;
    }
    same_host::HelloReply r{};
    int fds[2] = {-1, -1};
    const bool answered = await_hello_reply(fd, engine.options(), who, r, fds, why);
    std::memset(probe, 0, sizeof(probe));
    if (answered && r.err != 0)
        why = who + " cannot reach this process's memory with process_vm_readv/writev: " + errno_text(r.err);
    if (answered && r.err == 0) link->open_direct(fds);
    for (int f : fds)
        if (f >= 0) ::close(f);  // mapped, or refused
    return answered && r.err == 0 ? link : nullptr;
}

void SameHostLink::open_direct(const int (&fds)[2]) {
    if (!engine_.options().sameHostDirect) {
        directWhy_ = "off in this engine (same_host_direct=False)";
        return;
    }
    if (fds[0] < 0 || fds[1] < 0) {
        directWhy_ = "the target offers none (it refused same_host_direct, or its kernel refused the window)";
        return;
    }
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (getsockopt(fd_, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.pid <= 0) {
        directWhy_ = "the target's pid is unknown here (another PID namespace)";
        return;
    }
    direct_ = same_host::DirectPath::open(fds[0], fds[1], cred.pid, directWhy_);
}

namespace {

// A ring slot's request: m rows (local address, remote offset, bytes) of remote memory remoteId.
void fill_slot(same_host::Slot& s, Op op, const plan::Row* rows, size_t m, uint64_t remoteId, uint32_t flags,
               uint64_t seq, uint64_t uid) {
    s.request = same_host::Request{
        same_host::kMagic, same_host::kRequest, static_cast<uint8_t>(op), static_cast<uint16_t>(m), flags, seq, uid};
    for (size_t i = 0; i < m; ++i) s.entries[i] = same_host::Entry{{remoteId, rows[i].dst, rows[i].bytes}, rows[i].src};
}

}  // namespace

std::string SameHostLink::ring_full_why() const {
    return "engine '" + peer_->key + "' left its same-host request ring full for " +
           seconds_text(engine_.options().timeout) + " s (" + engine_.options().timeoutSetting + ")";
}

std::shared_ptr<Transfer> SameHostLink::post(Op op, const std::shared_ptr<Region>& local, const plan::Row* rows,
                                             size_t n, uint64_t remoteId, uint64_t uid, bool notify, int64_t deadlineNs,
                                             Link* ucxLink) {
    const size_t parts = (n + same_host::kMaxEntries - 1) / same_host::kMaxEntries;
    uint64_t bytes = 0;
    for (size_t i = 0; i < n; ++i) bytes += rows[i].bytes;
    if (direct_ && parts == 1 && (bytes <= same_host::kDirectMaxBytes || direct_->target_busy()) && usable()) {
        if (auto done = copy_direct(op, rows, n, remoteId, uid, notify, deadlineNs, ucxLink)) return done;
    }
    auto t = std::make_shared<Transfer>(nullptr, ucxLink, std::max<int64_t>(1, static_cast<int64_t>(parts)), deadlineNs,
                                        notify, uid);
    t->carried_by(shared_from_this(),
                  std::min<int64_t>(kMaxLeadSpinNs, kLeadSpinNs + static_cast<int64_t>(bytes / kSpinBytesPerNs)));
    if (parts == 0) {  // nothing to move; the notification still goes
        if (notify) {
            same_host::Note note{same_host::kMagic, same_host::kNote, {}, kSuccess, 0, uid};
            send(&note, sizeof(note));
        }
        t->part_done(kSuccess, "");
        return t;
    }
    std::unique_lock lk(mu_);
    for (size_t p = 0; p < parts; ++p) {
        if (!failure_.empty()) {
            t->fail(kErrTransport, failure_);
            return t;
        }
        const uint64_t seq = head_;
        same_host::Slot& s = ring_.slot(seq);
        if (s.state.load(std::memory_order_acquire) != same_host::kFree) {
            // The ring is full: wait for the target to finish the oldest request (a caller
            // posting meanwhile takes its turn after this one).
            lk.unlock();
            const bool room = wait_for_room(seq, deadlineNs);
            lk.lock();
            if (!room || head_ != seq) {
                if (failure_.empty() && !room) {
                    t->fail(kErrTransport, ring_full_why());
                    return t;
                }
                --p;  // failed meanwhile (reported above), or another caller took the slot: look again
                continue;
            }
        }
        const size_t first = p * same_host::kMaxEntries;
        const uint32_t flags = notify ? same_host::kNotify | (p + 1 == parts ? same_host::kLast : 0) : 0;
        fill_slot(s, op, rows + first, std::min(n - first, same_host::kMaxEntries), remoteId, flags, seq, uid);
        ++local->pins;  // dropped at the reply: a deregistration of the local memory waits
        pending_.emplace(seq, Pending{t, local});
        ++head_;
        nextDeadlineNs_ = std::min(nextDeadlineNs_, deadlineNs);
        // Posted, then the target's sleep flag read (both sequentially consistent): a target
        // going to sleep rechecks the ring after it set the flag, so one of the two sees the other.
        s.state.store(same_host::kPosted, std::memory_order_seq_cst);
    }
    lk.unlock();
    if (ring_.header().targetAsleep.exchange(0, std::memory_order_seq_cst) != 0) {
        const same_host::Bell bell{same_host::kMagic, same_host::kBell, {}};
        send(&bell, sizeof(bell));
    }
    return t;
}

std::shared_ptr<Transfer> SameHostLink::copy_direct(Op op, const plan::Row* rows, size_t n, uint64_t remoteId,
                                                    uint64_t uid, bool notify, int64_t deadlineNs, Link* ucxLink) {
    int err = 0;
    const auto r = direct_->copy(op, rows, n, remoteId, err);
    if (r == same_host::DirectPath::Result::kService) return nullptr;
    if (r == same_host::DirectPath::Result::kFailed) {  // not recorded at the target: a transport failure
        auto t = std::make_shared<Transfer>(nullptr, ucxLink, 1, deadlineNs, false, uid);
        t->part_done(kErrTransport, "copying " + std::string(op == kOpWrite ? "into" : "from") + " engine '" +
                                        peer_->key + "''s memory failed" +
                                        (err == ESRCH ? " (its process is gone)" : "") + ": " + errno_text(err));
        return t;
    }
    // Noted before it reports success: a lookup of the target's records finds it from now on.
    if (notify && !direct_->note(uid)) post_note(uid, deadlineNs);
    // The slots of earlier notes, done by now: freed here, so that the target need not ring.
    std::unique_lock rl(readMu_, std::try_to_lock);
    if (rl.owns_lock()) harvest();
    // Every direct copy that succeeded reports through one finished transfer: nothing of it is
    // its own any more (its notification went).
    return finished_transfer();
}

void SameHostLink::post_note(uint64_t uid, int64_t deadlineNs) {
    std::unique_lock lk(mu_);
    for (;;) {
        if (!failure_.empty()) return;  // as for any transfer the link failed: no record
        const uint64_t seq = head_;
        same_host::Slot& s = ring_.slot(seq);
        if (s.state.load(std::memory_order_acquire) == same_host::kFree) {
            // In a slot, as a request: a polling target reads it with no system call on either side.
            s.request = same_host::Request{same_host::kMagic, same_host::kNote, 0, 0, 0, seq, uid};
            pending_.emplace(seq, Pending{});
            ++head_;
            s.state.store(same_host::kPosted, std::memory_order_seq_cst);
            break;
        }
        lk.unlock();  // the ring is full: the target makes room, as for a request
        const bool room = wait_for_room(seq, deadlineNs);
        lk.lock();
        if (!room && failure_.empty()) {
            lk.unlock();
            fail(ring_full_why());
            return;
        }
    }
    lk.unlock();
    if (ring_.header().targetAsleep.exchange(0, std::memory_order_seq_cst) != 0) {
        const same_host::Bell bell{same_host::kMagic, same_host::kBell, {}};
        send(&bell, sizeof(bell));
    }
}

bool SameHostLink::wait_for_room(uint64_t seq, int64_t deadlineNs) {
    int polls = 0;
    while (usable()) {
        if (ring_.slot(seq).state.load(std::memory_order_acquire) == same_host::kFree) return true;
        const int64_t now = now_ns();
        if (now >= deadlineNs) return false;
        {
            std::unique_lock rl(readMu_, std::try_to_lock);
            if (rl.owns_lock() && read_locked() > 0) continue;
        }
        if (polls < same_host::kPollPauses * 16) {
            same_host::relax(polls);
            continue;
        }
        struct pollfd p{fd_, POLLIN, 0};  // the target rings when it completes a request
        ::poll(&p, 1, 1);
    }
    return false;
}

void SameHostLink::send(const void* msg, size_t len) {
    int err = 0;
    bool ok, queued;
    {
        std::lock_guard lk(sendMu_);
        ok = outbox_.send(fd_, msg, len, err);
        queued = !outbox_.queued.empty();
    }
    if (!ok)
        fail("connection to engine '" + peer_->key + "' failed: same-host socket: " + errno_text(err));
    else if (queued)
        engine_.same_host()->want_write(fd_);
}

void SameHostLink::on_writable() {
    int err = 0;
    bool ok;
    {
        std::lock_guard lk(sendMu_);
        ok = outbox_.flush(fd_, err);
    }
    if (!ok) fail("connection to engine '" + peer_->key + "' failed: same-host socket: " + errno_text(err));
}

void SameHostLink::fail(const std::string& why) {
    std::unordered_map<uint64_t, Pending> failed;
    {
        std::lock_guard lk(mu_);
        if (failure_.empty()) failure_ = why;
        failed.swap(pending_);
        failed_.store(true, std::memory_order_release);
    }
    peer_->fail(why);
    ::shutdown(fd_, SHUT_RDWR);  // the target stops serving us; the fd closes with the link
    for (auto& [seq, p] : failed) {
        uint32_t posted = same_host::kPosted;  // not claimed by the target yet: taken back
        ring_.slot(seq).state.compare_exchange_strong(posted, same_host::kFree, std::memory_order_acq_rel);
        if (!p.transfer) continue;  // a note
        --p.local->pins;
        p.transfer->fail(kErrTransport, why);
    }
}

void SameHostLink::handle(uint64_t seq, const same_host::Reply& r) {
    Pending p;
    {
        std::lock_guard lk(mu_);
        auto it = pending_.find(seq);
        if (it == pending_.end()) {
            engine_.count(&EngineStats::lateReplies);
            return;
        }
        p = std::move(it->second);
        pending_.erase(it);
    }
    if (!p.transfer) return;  // a note (post_note)
    --p.local->pins;
    if (r.code == kSuccess) {
        p.transfer->part_done(kSuccess, "");
        return;
    }
    const std::string who = "engine '" + peer_->key + "'";
    std::string what = who + " refused";
    const same_host::Slot& s = ring_.slot(seq);  // still ours: freed after this
    if (r.entry < s.request.count && r.entry < same_host::kMaxEntries) {
        const same_host::Entry e = s.entries[r.entry];
        what = "block (remote memory id " + std::to_string(e.block.memId) + ", offset " +
               std::to_string(e.block.offset) + ", size " + std::to_string(e.block.size) + ") at " + who;
    }
    std::string reason = reason_text(r.reason);
    if (r.reason == kReasonFailed)
        reason = "the target could not copy " + std::string(r.err == ESRCH ? "(this process is gone for it)" : "") +
                 "to or from this process's memory: " + errno_text(r.err) + " (ERR_TRANSPORT)";
    p.transfer->part_done(is_final_code(r.code) ? r.code : kErrBadState, what + ": " + reason);
}

size_t SameHostLink::harvest() {
    size_t handled = 0;
    for (;;) {
        {
            std::lock_guard lk(mu_);
            if (done_ == head_) break;  // nothing posted is unfinished
        }
        same_host::Slot& s = ring_.slot(done_);
        if (s.state.load(std::memory_order_acquire) != same_host::kDone) break;
        same_host::Reply r;
        std::memcpy(&r, &s.reply, sizeof(r));
        handle(done_, r);
        ++done_;
        s.state.store(same_host::kFree, std::memory_order_release);
        ++handled;
    }
    return handled;
}

size_t SameHostLink::read_locked() {
    same_host::Bell b;
    for (int i = 0; i < 256; ++i) {
        ssize_t n = ::recv(fd_, &b, sizeof(b), MSG_DONTWAIT | MSG_TRUNC);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
        if (n <= 0) {
            // A peer that ended with our doorbells unread resets the connection instead of closing it.
            const bool ended = n == 0 || errno == ECONNRESET;
            const std::string how = ended ? "it closed its same-host socket (the process ended?)" : errno_text(errno);
            harvest();  // what the target finished before it went
            if (usable()) fail("connection to engine '" + peer_->key + "' failed: " + how);
            return 0;
        }
        if (n != sizeof(b) || b.magic != same_host::kMagic || b.type != same_host::kBell) {
            engine_.count(&EngineStats::malformed);
            fail("engine '" + peer_->key + "' sent a malformed message on its same-host socket");
            return 0;
        }
    }
    return harvest();
}

void SameHostLink::on_readable() {
    // A waiting caller holds the lock for one poll at a time, and drains no doorbell while it
    // polls the ring: take it, or the doorbell keeps the service thread awake.
    std::lock_guard rl(readMu_);
    read_locked();
}

void SameHostLink::lead(const Transfer& t, int64_t deadlineNs, int64_t spinNs) {
    const int64_t start = now_ns(), spinUntil = std::min(deadlineNs, start + spinNs);
    std::atomic<uint32_t>& spinning = ring_.header().spinning;
    // While this thread polls the target needs not ring the socket for completions.
    spinning.fetch_add(1, std::memory_order_seq_cst);
    int polls = 0;
    for (int64_t now = start; !t.finished() && usable() && now < spinUntil; now = now_ns()) {
        std::unique_lock rl(readMu_, std::try_to_lock);  // else another thread harvests: t as well
        if (rl.owns_lock() && harvest() > 0) continue;
        // Queued behind other initiators (the oldest request not claimed yet): sleep, see above.
        if (rl.owns_lock() && now - start > kQueuedSpinNs &&
            ring_.slot(done_).state.load(std::memory_order_acquire) == same_host::kPosted)
            break;
        if (rl.owns_lock()) rl.unlock();
        same_host::relax(polls);
    }
    // From now on the target rings the socket, which wakes the service thread: it harvests and
    // finishes t while the caller sleeps on t. (Sleeping on the socket here would race the service
    // thread for the doorbell.) When t is still running, one more look finds a completion marked
    // before the target read the counter; a finished t needs none (the service thread drains
    // any doorbell: no system call on the caller's way back).
    spinning.fetch_sub(1, std::memory_order_seq_cst);
    if (t.finished()) return;
    std::lock_guard rl(readMu_);
    read_locked();
}

void SameHostLink::expire(int64_t now) {
    std::string why;
    {
        std::lock_guard lk(mu_);
        if (now < nextDeadlineNs_) return;
        nextDeadlineNs_ = INT64_MAX;
        bool late = false;
        for (auto& [id, p] : pending_) {
            if (p.transfer->deadline_ns() <= now) late = true;
            nextDeadlineNs_ = std::min(nextDeadlineNs_, p.transfer->deadline_ns());
        }
        if (!late) return;
        const auto& o = engine_.options();
        why = "no completion from engine '" + peer_->key + "' within " + seconds_text(o.timeout) + " s (" +
              o.timeoutSetting + ")";
    }
    fail(why);  // the peer stopped answering: the owner connects anew
}

}  // namespace mori::ucx
