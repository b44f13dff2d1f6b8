// The target side of the same-host path and the engine's same-host thread (see same_host/ring.hpp):
// accepting peers, their rings and the probe, checking each request against the live
// registrations, the copies (process_vm_readv/writev), and the doorbells of the engine's own links.
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "base/thread_name.hpp"
#include "same_host/ring.hpp"
#include "same_host/window.hpp"
#include "ucx/engine.hpp"
#include "ucx/wire.hpp"

namespace mori::ucx {

namespace {

// After activity the thread polls this long before it sleeps: back-to-back requests find it awake.
constexpr int64_t kSpinNs = 200'000;
constexpr int kMaxSleepMs = 100;
constexpr int64_t kRingsOnlyNs = 20'000;  // while awake, the sockets are looked at this often
// A completion that finds no initiator thread polling its ring is announced by a bell on the
// socket, which wakes the initiator's service thread. Its caller is usually about to poll (the
// Python between a post and its wait, a few µs), and a wake-up that lands on the core of that
// caller or of this thread costs both a context switch: on a 2-core VM a third of 4 KiB
// transfers rang, and the round trip settled at 10-11 µs instead of 4 for a whole run. While this
// thread is awake it holds the bell back up to kBellDelayNs and drops it once the completions
// were reaped; before it sleeps it rings every bell it holds.
constexpr int64_t kBellDelayNs = 20'000;
constexpr int64_t kExpiryEveryNs = 10'000'000;
constexpr size_t kMaxUnproven = 64;  // connections that have not said hello yet
// The epoll tags of the two fds that are neither connections nor links.
constexpr uint64_t kTagListen = ~uint64_t{0}, kTagWake = ~uint64_t{0} - 1;

[[noreturn]] void sys_fail(const char* what) {
    throw std::runtime_error(std::string("same-host service: ") + what + ": " + std::strerror(errno));
}

}  // namespace

struct SameHostService::Conn {
    int fd = -1;
    pid_t pid = 0;
    bool proven = false;  // said hello with a valid ticket and ring, and passed the probe
    same_host::Ring ring;
    uint64_t tail = 0;   // the next slot to serve (this side's count: the ring's words are the peer's too)
    std::string key;     // the engine its ticket admitted
    uint64_t order = 0;  // accept order, to drop the oldest unproven first
    Outbox out;
    std::unordered_map<uint64_t, int> refused;  // notifying transfers in flight with a refusal: uid -> code
    int64_t bellAt = 0;                         // a bell held back until then (kBellDelayNs), 0: none
    std::shared_ptr<same_host::Pins> pins;      // its pins on the window (direct copies), when offered
};

SameHostService::SameHostService(Engine& engine)
    : engine_(engine), buf_(same_host::kMaxMessage + 1), entries_(same_host::kMaxEntries) {
    uint64_t r[2];
    if (getrandom(r, sizeof(r), 0) != sizeof(r)) throw std::runtime_error("getrandom failed");
    char name[64];
    std::snprintf(name, sizeof(name), "mori-ucx-%d-%016llx%016llx", static_cast<int>(getpid()),
                  static_cast<unsigned long long>(r[0]), static_cast<unsigned long long>(r[1]));
    name_ = name;
    listenFd_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (listenFd_ < 0) sys_fail("socket");
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::memcpy(a.sun_path + 1, name_.data(), name_.size());
    auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name_.size());
    if (::bind(listenFd_, reinterpret_cast<sockaddr*>(&a), len) != 0 || ::listen(listenFd_, 128) != 0) {
        ::close(listenFd_);
        sys_fail("bind/listen");
    }
    epollFd_ = epoll_create1(EPOLL_CLOEXEC);
    wakeFd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (epollFd_ < 0 || wakeFd_ < 0) sys_fail("epoll/eventfd");
    for (auto [fd, tag] : {std::pair{listenFd_, kTagListen}, std::pair{wakeFd_, kTagWake}}) {
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.u64 = tag;
        if (epoll_ctl(epollFd_, EPOLL_CTL_ADD, fd, &ev) != 0) sys_fail("epoll_ctl");
    }
    std::string why;  // without a window initiators send every request to this thread
    window_ = same_host::Window::create(
        [this](const std::string& key, uint64_t uid, int code) { engine_.record_inbound(key, uid, code); }, why);
    thread_ = std::thread([this] {
        name_this_thread("mori-same-host");
        run();
    });
}

SameHostService::~SameHostService() {
    stop();
    for (int fd : {listenFd_, epollFd_, wakeFd_})
        if (fd >= 0) ::close(fd);
}

void SameHostService::watch(int fd, uint32_t events, bool add) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = static_cast<uint64_t>(fd);
    epoll_ctl(epollFd_, add ? EPOLL_CTL_ADD : EPOLL_CTL_MOD, fd, &ev);
}

void SameHostService::add_link(const std::shared_ptr<SameHostLink>& link) {
    std::lock_guard lk(linksMu_);
    links_[link->fd()] = link;
    // Links are tagged by their fd with the high bit set, connections by their fd.
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = (uint64_t{1} << 62) | static_cast<uint64_t>(link->fd());
    epoll_ctl(epollFd_, EPOLL_CTL_ADD, link->fd(), &ev);
}

void SameHostService::remove_link(const SameHostLink* link) {
    std::lock_guard lk(linksMu_);
    auto it = links_.find(link->fd());
    if (it == links_.end() || it->second.get() != link) return;
    epoll_ctl(epollFd_, EPOLL_CTL_DEL, link->fd(), nullptr);
    links_.erase(it);  // the fd closes with the link's last owner, after this
}

void SameHostService::want_write(int fd) {
    std::lock_guard lk(linksMu_);
    if (!links_.count(fd)) return;
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLOUT;
    ev.data.u64 = (uint64_t{1} << 62) | static_cast<uint64_t>(fd);
    epoll_ctl(epollFd_, EPOLL_CTL_MOD, fd, &ev);
}

void SameHostService::stop() {
    if (stop_.exchange(true)) return;
    uint64_t one = 1;
    ssize_t n = ::write(wakeFd_, &one, sizeof(one));
    (void)n;
    if (thread_.joinable()) thread_.join();
    // No initiator copies into this engine's memory after this (nor after the timeout, for one
    // that holds a pin now).
    if (window_) window_->withdraw_all(now_ns() + static_cast<int64_t>(engine_.options().timeout * 1e9));
    for (auto& [fd, c] : conns_) {
        if (c->pins) same_host::revoke(*c->pins);
        ::close(fd);
    }
    conns_.clear();
    std::unordered_map<int, std::shared_ptr<SameHostLink>> links;
    {
        std::lock_guard lk(linksMu_);
        links.swap(links_);
    }
    for (auto& [fd, l] : links) l->fail("the UCX engine was closed");
}

void SameHostService::drop(int fd) {
    auto it = conns_.find(fd);
    if (it != conns_.end() && it->second->pins) same_host::revoke(*it->second->pins);
    epoll_ctl(epollFd_, EPOLL_CTL_DEL, fd, nullptr);
    ::close(fd);
    conns_.erase(fd);
}

void SameHostService::accept_all() {
    static uint64_t order = 0;
    for (;;) {
        int fd = ::accept4(listenFd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE) {  // out of descriptors: pause accepting a while
                listenPausedUntil_ = now_ns() + 100'000'000;
                epoll_event ev{};
                ev.data.u64 = kTagListen;
                epoll_ctl(epollFd_, EPOLL_CTL_MOD, listenFd_, &ev);
            }
            return;
        }
        ucred cred{};
        socklen_t len = sizeof(cred);
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.pid <= 0) {
            ::close(fd);  // no pid of ours to copy with (another PID namespace)
            continue;
        }
        // Bounded: the oldest connection that has not proven itself goes first.
        size_t unproven = 0;
        Conn* oldest = nullptr;
        size_t proven = 0;
        for (auto& [f, c] : conns_) {
            if (c->proven) {
                ++proven;
                continue;
            }
            ++unproven;
            if (oldest == nullptr || c->order < oldest->order) oldest = c.get();
        }
        if (unproven >= kMaxUnproven && oldest != nullptr) drop(oldest->fd);
        if (proven >= engine_.options().maxTickets) {
            ::close(fd);
            continue;
        }
        auto c = std::make_unique<Conn>();
        c->fd = fd;
        c->pid = cred.pid;
        c->order = ++order;
        watch(fd, EPOLLIN | EPOLLRDHUP, true);
        conns_[fd] = std::move(c);
    }
}

void SameHostService::reply(Conn& c, const void* msg, size_t len) {
    int err = 0;
    if (!c.out.send(c.fd, msg, len, err)) {
        drop(c.fd);
        return;
    }
    // The initiator does not read its doorbells: serve no more of its requests until it does.
    if (!c.out.queued.empty()) watch(c.fd, EPOLLOUT | EPOLLRDHUP, false);
}

void SameHostService::hello(Conn& c, const same_host::Hello& h, int ringFd) {
    c.key = engine_.tickets().admit(h.ticket);
    if (c.key.empty()) {  // no valid ticket (counted)
        drop(c.fd);
        return;
    }
    // A memfd of the ring's size, sealed against shrinking (or the target could fault on it).
    if (ringFd < 0 || !c.ring.attach(ringFd)) {
        engine_.count(&EngineStats::malformed);
        drop(c.fd);
        return;
    }
    uint8_t got[sizeof(h.nonce)] = {};
    iovec local{got, sizeof(got)}, remote{reinterpret_cast<void*>(h.probe), sizeof(got)};
    int err = 0;
    ssize_t n = process_vm_readv(c.pid, &local, 1, &remote, 1, 0);
    if (n < 0)
        err = errno;
    else if (n != static_cast<ssize_t>(sizeof(got)) || std::memcmp(got, h.nonce, sizeof(got)) != 0)
        err = EACCES;  // another process's memory: the pid is not the initiator's
    same_host::HelloReply r{same_host::kMagic, same_host::kHelloReply, {}, err};
    const int fd = c.fd;
    if (err == 0 && offer_window(c, &r, sizeof(r))) {
        c.proven = true;
        return;
    }
    reply(c, &r, sizeof(r));
    if (err != 0 && conns_.count(fd))
        drop(fd);
    else if (conns_.count(fd))
        c.proven = true;
}

bool SameHostService::offer_window(Conn& c, const void* msg, size_t len) {
    if (!window_ || !engine_.options().sameHostDirect) return false;
    std::shared_ptr<same_host::Pins> pins = window_->add_pins(same_host::peer_pidfd(c.fd, c.pid), c.key);
    if (!pins) return false;
    const int fds[2] = {window_->fd(), pins->fd};
    const bool sent =
        same_host::send_with_fds(c.fd, msg, len, fds, 2, MSG_DONTWAIT | MSG_NOSIGNAL) == static_cast<ssize_t>(len);
    ::close(std::exchange(pins->fd, -1));  // the initiator maps its own copy
    if (!sent) {
        same_host::revoke(*pins);
        return false;
    }
    c.pins = std::move(pins);
    return true;
}

void SameHostService::copy(Conn& c, const same_host::Request& h, const same_host::Entry* entries, same_host::Reply& r) {
    std::vector<std::shared_ptr<Region>> pins;
    std::vector<iovec> local(h.count), remote(h.count);
    // Every block is checked against the region table (Engine::acquire: pinned, a deregistration
    // waits) before any byte moves; the same-host path moves host memory only.
    for (size_t i = 0; i < h.count && r.reason == kReasonNone; ++i) {
        const same_host::Entry& e = entries[i];
        std::shared_ptr<Region> reg = engine_.acquire(e.block, r.reason);
        if (reg) pins.push_back(reg);
        uint64_t end;
        if (reg && reg->gpu())
            r.reason = kReasonGpu;
        else if (reg && __builtin_add_overflow(e.addr, e.block.size, &end))
            r.reason = kReasonShape;
        r.entry = static_cast<uint32_t>(i);
        local[i] = iovec{reinterpret_cast<void*>(reg ? reg->addr + e.block.offset : 0), e.block.size};
        remote[i] = iovec{reinterpret_cast<void*>(e.addr), e.block.size};
    }
    if (r.reason == kReasonNone) {
        r.entry = 0;
        r.err = same_host::copy_all(c.pid, h.op == kOpWrite, local.data(), remote.data(), local.size());
        if (r.err != 0) r.reason = kReasonFailed;
    } else {
        engine_.count(&EngineStats::refused);
    }
    for (auto& reg : pins) reg->unpin();
    r.code = reason_code(r.reason);
}

bool SameHostService::serve_ring(Conn& c) {
    // An initiator that does not read its doorbells gets no more served until it does.
    if (!c.proven || !c.out.queued.empty()) return false;
    const int fd = c.fd;
    int served = 0;
    for (; served < 16; ++served) {  // a few per call: one peer cannot hold the thread
        same_host::Slot& s = c.ring.slot(c.tail);
        uint32_t posted = same_host::kPosted;
        if (!s.state.compare_exchange_strong(posted, same_host::kServing, std::memory_order_acq_rel)) break;
        // Copied out before it is checked: the initiator can write the slot at any time.
        same_host::Request h;
        std::memcpy(&h, &s.request, sizeof(h));
        // A note: the initiator copied a notifying transfer itself (window.hpp); it succeeded.
        const bool note = h.type == same_host::kNote && h.op == 0 && h.count == 0 && h.flags == 0;
        if (h.magic != same_host::kMagic ||
            (!note &&
             (h.type != same_host::kRequest || (h.op != kOpRead && h.op != kOpWrite) || h.count == 0 ||
              h.count > same_host::kMaxEntries || (h.flags & ~(same_host::kNotify | same_host::kLast)) != 0))) {
            engine_.count(&EngineStats::malformed);
            drop(fd);
            return true;
        }
        same_host::Reply r{same_host::kMagic, same_host::kReply, {}, kSuccess, kReasonNone, 0, 0, 0, h.id};
        if (!note) {
            std::memcpy(entries_.data(), s.entries, h.count * sizeof(same_host::Entry));
            copy(c, h, entries_.data(), r);
        }
        // The transfer's outcome, when it notifies: its first refusal, else success; recorded
        // with its last request, as the initiator reports it (a transport failure is not
        // recorded: it reports that).
        int outcome = r.code;
        if (h.flags & same_host::kNotify) {
            auto it = c.refused.find(h.uid);
            if (it != c.refused.end()) outcome = it->second;
            if (h.flags & same_host::kLast) {
                if (it != c.refused.end()) c.refused.erase(it);
            } else if (outcome != kSuccess && it == c.refused.end()) {
                if (c.refused.size() >= same_host::kMaxOpenNotes) {
                    drop(fd);
                    return true;
                }
                c.refused.emplace(h.uid, outcome);
            }
        }
        std::memcpy(&s.reply, &r, sizeof(r));
        // Done, then the initiator's polling count read (both sequentially consistent): an
        // initiator that stops polling looks at the ring once more after it said so.
        s.state.store(same_host::kDone, std::memory_order_seq_cst);
        ++c.tail;
        if (note || ((h.flags & (same_host::kNotify | same_host::kLast)) == (same_host::kNotify | same_host::kLast) &&
                     outcome != kErrTransport))
            engine_.record_inbound(c.key, h.uid, outcome);
    }
    if (served == 0) return false;
    c.ring.header().targetAsleep.store(0, std::memory_order_relaxed);  // awake: posters need not ring
    if (c.ring.header().spinning.load(std::memory_order_seq_cst) == 0 && c.out.queued.empty()) {
        if (!engine_.options().polling) {
            ring_bell(c);
        } else if (c.bellAt == 0) {
            c.bellAt = now_ns() + kBellDelayNs;
            bells_.push_back(c.fd);
        }
    }
    return true;
}

void SameHostService::ring_bell(Conn& c) {
    const same_host::Bell bell{same_host::kMagic, same_host::kBell, {}};
    reply(c, &bell, sizeof(bell));
}

void SameHostService::ring_bells(bool all) {
    const int64_t now = now_ns();
    size_t kept = 0;
    for (int fd : bells_) {
        auto it = conns_.find(fd);
        if (it == conns_.end()) continue;  // dropped meanwhile
        Conn& c = *it->second;
        // Reaped: the initiator frees its slots in order, so the last served one tells. A thread
        // polling now reaps them before it stops (it looks at the ring once more after it said so).
        const bool reaped = c.ring.slot(c.tail - 1).state.load(std::memory_order_acquire) != same_host::kDone ||
                            c.ring.header().spinning.load(std::memory_order_seq_cst) != 0;
        if (!reaped && !all && now < c.bellAt) {
            bells_[kept++] = fd;
            continue;
        }
        c.bellAt = 0;
        if (!reaped && c.out.queued.empty()) ring_bell(c);
    }
    bells_.resize(kept);
}

bool SameHostService::poll_rings() {
    ready_.clear();
    uint32_t queued = 0;  // for the window: initiators whose requests wait now
    for (auto& [fd, c] : conns_) {
        if (!c->proven) continue;
        ready_.push_back(fd);
        queued += c->ring.slot(c->tail).state.load(std::memory_order_relaxed) == same_host::kPosted;
    }
    if (window_) window_->set_queued(queued);
    bool served = false;
    for (int fd : ready_) {
        auto it = conns_.find(fd);  // serving a connection drops at most that one
        if (it != conns_.end()) served = serve_ring(*it->second) || served;
    }
    return served;
}

bool SameHostService::any_posted() {
    if (window_) window_->set_queued(0);  // asleep: nothing waits for this thread's copies
    bool posted = false;
    for (auto& [fd, c] : conns_) {
        if (!c->proven) continue;
        c->ring.header().targetAsleep.store(1, std::memory_order_seq_cst);
        if (c->ring.slot(c->tail).state.load(std::memory_order_seq_cst) == same_host::kPosted) posted = true;
    }
    return posted;
}

void SameHostService::serve(Conn& c, const uint8_t* msg, size_t len, int passedFd) {
    uint32_t magic;
    if (len < 5 || (std::memcpy(&magic, msg, 4), magic != same_host::kMagic)) {
        engine_.count(&EngineStats::malformed);
        drop(c.fd);
        return;
    }
    const uint8_t type = msg[4];
    if (!c.proven) {
        if (type != same_host::kHello || len != sizeof(same_host::Hello)) {
            engine_.count(&EngineStats::malformed);
            drop(c.fd);
            return;
        }
        same_host::Hello h;
        std::memcpy(&h, msg, sizeof(h));
        hello(c, h, passedFd);
        return;
    }
    if (type == same_host::kNote && len == sizeof(same_host::Note)) {
        same_host::Note n;
        std::memcpy(&n, msg, sizeof(n));
        if (is_final_code(n.code))
            engine_.record_inbound(c.key, n.uid, n.code);
        else
            engine_.count(&EngineStats::malformed);
        return;
    }
    if (type != same_host::kBell || len != sizeof(same_host::Bell)) {
        engine_.count(&EngineStats::malformed);
        drop(c.fd);
        return;
    }
    serve_ring(c);
}

// One message of connection fd into buf_, with the descriptor a hello passes (-1 for none; a
// message that is not a hello never installs one: recv drops what a peer attaches). The length,
// 0 when the peer closed, < 0 with errno set.
ssize_t SameHostService::receive(int fd, bool hello, int& passedFd) {
    passedFd = -1;
    if (!hello) return ::recv(fd, buf_.data(), buf_.size(), MSG_DONTWAIT | MSG_TRUNC);
    return same_host::recv_with_fds(fd, buf_.data(), buf_.size(), MSG_DONTWAIT | MSG_TRUNC, &passedFd, 1);
}

void SameHostService::run() {
    const bool polling = engine_.options().polling;
    int64_t lastBusy = 0, nextExpiry = 0;
    epoll_event evs[64];
    while (!stop_.load(std::memory_order_acquire)) {
        int64_t now = now_ns();
        bool spin = polling && now - lastBusy < kSpinNs;
        // About to sleep: the bells held back are rung; every ring's initiator is told to ring the
        // socket from now on, then the rings are looked at once more (a request posted before the
        // flag was seen is there).
        if (!spin && !bells_.empty()) ring_bells(true);
        if (!spin && any_posted()) spin = true;
        resume_listening(now);
        int n = epoll_wait(epollFd_, evs, 64, spin ? 0 : kMaxSleepMs);
        now = now_ns();
        for (int i = 0; i < n; ++i) {
            const uint64_t tag = evs[i].data.u64;
            if (tag == kTagWake) {
                uint64_t drained;
                while (::read(wakeFd_, &drained, sizeof(drained)) > 0) {
                }
            } else if (tag == kTagListen) {
                accept_all();
            } else if (tag & (uint64_t{1} << 62)) {
                on_link_event(static_cast<int>(tag & 0xffffffff), evs[i].events);
            } else {
                // Only serving keeps the thread polling: replies to this engine's own transfers
                // are read by their waiters first, and otherwise wake it from its sleep; the note
                // of a direct copy asks for nothing more.
                if (on_conn_event(static_cast<int>(tag), evs[i].events)) lastBusy = now;
            }
        }
        // Awake: only the rings are polled for a while (no system call but the yields of relax)
        // before the sockets are looked at again; what comes by socket waits up to that long.
        if (poll_rings()) lastBusy = now;
        if (spin) spin_on_rings(lastBusy);
        if (now < nextExpiry) continue;
        nextExpiry = now + kExpiryEveryNs;  // deadlines of the engine's own links, every few milliseconds
        expire_links(now);
        if (window_) window_->drain();  // notes no one looked up yet: room for more
    }
}

void SameHostService::resume_listening(int64_t now) {
    if (listenPausedUntil_ == 0 || now < listenPausedUntil_) return;
    listenPausedUntil_ = 0;
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = kTagListen;
    epoll_ctl(epollFd_, EPOLL_CTL_MOD, listenFd_, &ev);
}

void SameHostService::on_link_event(int fd, uint32_t events) {
    std::shared_ptr<SameHostLink> link;
    {
        std::lock_guard lk(linksMu_);
        auto it = links_.find(fd);
        if (it != links_.end()) link = it->second;
    }
    if (!link) return;
    if (events & EPOLLOUT) {
        link->on_writable();
        watch(link->fd(), EPOLLIN, false);  // re-armed by the next message that waits
        link->on_writable();                // one that queued meanwhile
    }
    if (events & (EPOLLIN | EPOLLHUP | EPOLLERR)) link->on_readable();
    if (!link->usable()) remove_link(link.get());
}

bool SameHostService::on_conn_event(int fd, uint32_t events) {
    auto it = conns_.find(fd);
    if (it == conns_.end()) return true;
    Conn& c = *it->second;
    if (events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
        // The initiator closed (it failed the transfers, or ended): what it had queued is not
        // served, so no byte moves for a transfer it gave up on.
        drop(c.fd);
        return true;
    }
    if (events & EPOLLOUT) {
        int err = 0;
        if (!c.out.flush(c.fd, err)) {
            drop(c.fd);
            return true;
        }
        if (!c.out.queued.empty()) return true;
        watch(c.fd, EPOLLIN | EPOLLRDHUP, false);
    }
    bool busy = (events & EPOLLOUT) != 0;
    // A few messages per wake and connection: one peer cannot hold the thread.
    for (int k = 0; k < 16 && conns_.count(fd) && c.out.queued.empty(); ++k) {
        int passedFd;
        ssize_t len = receive(c.fd, !c.proven, passedFd);
        if (len < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
        if (len <= 0 || static_cast<size_t>(len) > same_host::kMaxMessage) {
            if (passedFd >= 0) ::close(passedFd);
            if (len > 0) engine_.count(&EngineStats::malformed);
            drop(c.fd);  // the peer left (or sent what no peer sends)
            break;
        }
        busy = busy || len != sizeof(same_host::Note) || buf_[4] != same_host::kNote;
        serve(c, buf_.data(), static_cast<size_t>(len), passedFd);
        if (passedFd >= 0) ::close(passedFd);  // a ring stays mapped without it
    }
    return busy;
}

void SameHostService::spin_on_rings(int64_t& lastBusy) {
    int polls = 0;
    for (int64_t t = now_ns(), until = t + kRingsOnlyNs; t < until && !stop_.load(std::memory_order_relaxed);
         t = now_ns()) {
        if (poll_rings())
            lastBusy = t;
        else
            same_host::relax(polls);
        if (!bells_.empty()) ring_bells(false);
    }
}

void SameHostService::expire_links(int64_t now) {
    std::vector<std::shared_ptr<SameHostLink>> links;
    {
        std::lock_guard lk(linksMu_);
        for (auto& [fd, l] : links_) links.push_back(l);
    }
    for (auto& l : links) {
        l->expire(now);
        if (!l->usable()) remove_link(l.get());
    }
}

}  // namespace mori::ucx
