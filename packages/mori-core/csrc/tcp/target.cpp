// Target side of the native TCP data plane: its regions, tickets and connections (accepted,
// admitted, evicted); each admitted connection is served by tcp/session.cpp, where every request
// is checked against the registered regions before a byte of memory is touched. As in MORI, any
// engine that presents the auth token is served; registering a remote engine is the initiator's
// step only.
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <optional>
#include <stdexcept>
#include <system_error>

#include "base/thread_name.hpp"
#include "tcp/engine.hpp"
#include "tcp/staged.hpp"

namespace mori::tcp {

namespace {

void set_send_timeout(int fd, double sec) {
    struct timeval tv{};
    tv.tv_sec = static_cast<time_t>(sec);
    tv.tv_usec = static_cast<suseconds_t>((sec - static_cast<double>(tv.tv_sec)) * 1e6);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

}  // namespace

Target::Target(const std::string& host, int port, std::string token, double ioTimeout, TargetLimits limits,
               std::string timeoutSetting, std::shared_ptr<InboundRecords> inbound)
    : token_(std::move(token)),
      ioTimeout_(ioTimeout),
      limits_(limits),
      timeoutSetting_(std::move(timeoutSetting)),
      inbound_(inbound_table(std::move(inbound), limits.maxInbound, limits.inboundTtl)),
      tickets_(TicketRules{limits.maxTickets, limits.ticketTtl, limits.ticketUses}) {
    if (limits_.maxConnections < 1 || limits_.maxHandshakes < 1 || limits_.maxInbound < 1 || limits_.maxTickets < 1 ||
        limits_.maxPerKey < 1 || limits_.ticketUses < 1 || !(limits_.helloTimeout > 0) || !(limits_.inboundTtl > 0) ||
        !(limits_.ticketTtl > 0))
        throw std::invalid_argument("TCP data plane: every limit must be positive");
    struct addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    struct addrinfo* res = nullptr;
    std::string portText = std::to_string(port);
    int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), portText.c_str(), &hints, &res);
    if (rc != 0) throw std::runtime_error("TCP data plane: cannot resolve " + host + ": " + gai_strerror(rc));
    std::string err = "no address";
    for (auto* ai = res; ai != nullptr && listenFd_ < 0; ai = ai->ai_next) {
        int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) continue;
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 256) == 0) {
            listenFd_ = fd;
        } else {
            err = std::strerror(errno);
            ::close(fd);
        }
    }
    freeaddrinfo(res);
    if (listenFd_ < 0)
        throw std::runtime_error("TCP data plane: cannot listen on " + host + ":" + portText + ": " + err);
    struct sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    getsockname(listenFd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                             : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
    acceptThread_ = std::thread([this] {
        name_this_thread("mori-tcp-accept");
        accept_loop();
    });
}

Target::~Target() { close(); }

void Target::register_region(uint64_t id, uint64_t addr, uint64_t size, std::shared_ptr<gpu::Stager> stager) {
    auto r = std::make_shared<Region>();
    r->id = id;
    r->addr = addr;
    r->size = size;
    r->kind = stager ? MemoryKind::kGpu : MemoryKind::kHost;
    r->stager = std::move(stager);
    if (!regions_.add(std::move(r)))
        throw std::invalid_argument("memory id " + std::to_string(id) + " is already registered");
}

bool Target::deregister_region(uint64_t id) {
    // Requests being served on it end by themselves within the I/O timeout unless a peer reads
    // (or writes) slowly but steadily; such a peer's connection is cut at the timeout, so the
    // wait is bounded whatever it does. Cutting makes its blocked send or receive fail at once.
    const int64_t deadline = now_ns() + static_cast<int64_t>(ioTimeout_ * 1e9);
    auto cut = [this](const Region& r) {
        size_t n = cut_users(&r);
        std::lock_guard sk(statsMu_);
        stats_.cut += n;
        return n;
    };
    switch (regions_.deregister(id, deadline, cut)) {
        case RegionTable<Region>::Ended::kUnknown: return false;
        case RegionTable<Region>::Ended::kReleased: return true;
        case RegionTable<Region>::Ended::kStillPinned: break;
    }
    throw std::runtime_error("memory id " + std::to_string(id) + ": requests still use it after the I/O timeout (" +
                             timeoutSetting_ +
                             ") and their connections were cut; it is no longer served, but do "
                             "not free it yet");
}

size_t Target::cut_users(const Region* r) {
    size_t n = 0;
    std::lock_guard lk(connsMu_);
    for (auto& c : conns_) {
        if (c.holds(r)) {
            // Reset rather than close: what the kernel still holds for the peer is dropped too,
            // so a slow reader sees the cut at once.
            struct linger reset{1, 0};
            setsockopt(c.fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
            shutdown(c.fd, SHUT_RDWR);
            ++n;
        }
    }
    return n;
}

int Target::RegionUse::acquire(const RequestEntry& block, uint64_t& addr, uint64_t& reason) {
    uint32_t why = kReasonNone;
    region_ = Pinned<Region>(t_.regions_.acquire(block.memId, block.offset, block.size, why));
    reason = why;
    if (!region_) return reason_code(why);
    addr = region_->addr + block.offset;
    std::lock_guard lk(c_->usesMu);
    c_->uses.push_back(region_.get());
    return kSuccess;
}

void Target::RegionUse::release() {
    if (!region_) return;
    {
        std::lock_guard lk(c_->usesMu);
        c_->uses.erase(std::find(c_->uses.begin(), c_->uses.end(), region_.get()));
    }
    region_.reset();
}

std::string Target::issue_ticket(const std::string& key, const std::optional<std::string>& ticket) {
    if (!ticket) return tickets_.issue(key);
    if (ticket->empty() || ticket->size() > kMaxTicketLen) throw std::invalid_argument("ticket must be 1..256 bytes");
    tickets_.grant(key, *ticket);
    return *ticket;
}

std::optional<int> Target::pop_inbound(const std::string& key, uint64_t uid) { return inbound_->pop_code(key, uid); }

size_t Target::inbound_count() { return inbound_->count(); }

size_t Target::connection_count() {
    std::lock_guard lk(connsMu_);
    reap(false);
    return conns_.size();
}

TargetStats Target::stats() {
    uint64_t dropped = inbound_->dropped();
    std::lock_guard lk(statsMu_);
    TargetStats s = stats_;
    s.inboundDropped = dropped;
    s.badTickets = tickets_.bad();
    return s;
}

void Target::close() {
    if (stop_.exchange(true)) return;
    if (acceptThread_.joinable()) acceptThread_.join();
    {
        std::lock_guard lk(connsMu_);
        for (auto& c : conns_) shutdown(c.fd, SHUT_RDWR);
        reap(true);
    }
    ::close(listenFd_);
}

void Target::reap(bool all) {
    for (auto it = conns_.begin(); it != conns_.end();) {
        if (all || it->done.load()) {
            if (it->thread.joinable()) it->thread.join();
            ::close(it->fd);
            it = conns_.erase(it);
        } else {
            ++it;
        }
    }
}

bool Target::evict_oldest_handshake_locked() {
    for (auto& c : conns_) {  // accept order: the first one handshaking is the oldest
        int expected = kHandshaking;
        if (!c.done.load() && c.state.compare_exchange_strong(expected, kEvicted)) {
            shutdown(c.fd, SHUT_RDWR);  // its thread notices, ends and is reaped
            std::lock_guard sk(statsMu_);
            ++stats_.evicted;
            return true;
        }
    }
    return false;
}

bool Target::evict_idlest_locked() {
    const int64_t now = now_ns(), least = static_cast<int64_t>(limits_.helloTimeout * 1e9);
    Conn* idlest = nullptr;
    int64_t since = now - least;  // idle at least helloTimeout: a pool that is in use keeps its connections
    for (auto& c : conns_) {
        int64_t idleSince = c.idleSinceNs.load();
        if (!c.done.load() && c.state.load() == kServing && idleSince != 0 && idleSince <= since) {
            idlest = &c;
            since = idleSince;
        }
    }
    if (idlest == nullptr) return false;
    drop_locked(*idlest);
    return true;
}

void Target::drop_locked(Conn& c) {
    c.state.store(kEvicted);
    shutdown(c.fd, SHUT_RDWR);
    std::lock_guard sk(statsMu_);
    ++stats_.idleEvicted;
}

void Target::bind_key(Conn* conn, const std::string& key) {
    std::lock_guard lk(connsMu_);
    conn->key = key;
    size_t held = 0;
    for (auto& c : conns_) held += &c != conn && !c.done.load() && c.state.load() == kServing && c.key == key;
    // Over the bound, the key's oldest connections go (accept order): a peer that reconnects
    // replaces its old pool, and one key cannot take every descriptor.
    for (auto it = conns_.begin(); held >= limits_.maxPerKey && it != conns_.end(); ++it) {
        if (&*it != conn && !it->done.load() && it->state.load() == kServing && it->key == key) {
            drop_locked(*it);
            --held;
        }
    }
}

bool Target::admit() {
    int fd = accept4(listenFd_, nullptr, nullptr, SOCK_CLOEXEC);
    std::lock_guard lk(connsMu_);
    if (fd < 0) {
        if (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED) return true;
        // Out of descriptors (EMFILE/ENFILE), buffers or memory. Finished connections are reaped
        // first: while accepts keep failing this is the only place that happens, and peers that
        // vanished hold descriptors until it does. Nothing to reap: free what a peer that has not
        // even said hello holds (else an admitted connection idle for a while), and tell the
        // caller to back off (the queued connection stays readable, so retrying would spin).
        size_t before = conns_.size();
        reap(false);
        if (conns_.size() < before) return true;
        if (!evict_oldest_handshake_locked()) evict_idlest_locked();
        std::lock_guard sk(statsMu_);
        ++stats_.acceptErrors;
        return false;
    }
    reap(false);
    if (stop_.load() || conns_.size() >= limits_.maxConnections) {
        ::close(fd);
        if (!stop_.load()) {
            std::lock_guard sk(statsMu_);
            ++stats_.refused;
        }
        return true;
    }
    size_t handshaking = 0;
    for (auto& c : conns_) handshaking += c.state.load() == kHandshaking && !c.done.load();
    if (handshaking >= limits_.maxHandshakes) evict_oldest_handshake_locked();
    tune_socket(fd);
    set_send_timeout(fd, ioTimeout_);
    try {
        Conn& c = conns_.emplace_back();
        c.fd = fd;
        c.acceptNs = now_ns();
        c.thread = std::thread([this, conn = &c] {
            name_this_thread("mori-tcp-serve");
            try {
                serve(conn);
            } catch (const std::exception&) {  // out of memory mid-request: this connection only
            }
            shutdown(conn->fd, SHUT_RDWR);
            conn->done.store(true);
        });
    } catch (const std::exception&) {
        // No thread or memory to be had (RLIMIT_NPROC, RLIMIT_AS): refuse this connection and
        // keep serving; an escaping exception would terminate the process.
        ::close(fd);
        if (!conns_.empty() && conns_.back().fd == fd && !conns_.back().thread.joinable()) conns_.pop_back();
        std::lock_guard sk(statsMu_);
        ++stats_.acceptErrors;
        return false;
    }
    return true;
}

void Target::accept_loop() {
    struct pollfd p{listenFd_, POLLIN, 0};
    int backoffMs = 0;
    while (!stop_.load()) {
        int ready = poll(&p, 1, backoffMs > 0 ? 0 : 200);
        if (backoffMs > 0) std::this_thread::sleep_for(std::chrono::milliseconds(backoffMs));
        if (ready <= 0) {
            // Reap finished connections on every wake-up, not only after an accept: their
            // descriptors and threads are released even when no one connects again.
            std::lock_guard lk(connsMu_);
            reap(false);
            continue;
        }
        bool ok = false;
        try {
            ok = admit();
        } catch (const std::exception&) {  // out of memory: back off, keep accepting
        }
        backoffMs = ok ? 0 : std::min(std::max(backoffMs * 2, 10), 200);
    }
}

bool Target::handshake(Conn* conn, Reader& rd, std::string& peerKey) {
    // The whole hello must arrive within helloTimeout of the accept: a peer trickling bytes
    // cannot hold a connection open.
    int64_t deadlineNs = conn->acceptNs + static_cast<int64_t>(limits_.helloTimeout * 1e9);
    AbortCheck deadline = [this, deadlineNs]() -> std::string {
        if (stop_.load()) return "closed";
        return now_ns() > deadlineNs ? "no hello" : "";
    };
    if (!rd.fill(sizeof(Hello), deadline).empty()) return false;
    Hello h;
    std::memcpy(&h, rd.data(), sizeof(h));
    rd.consume(sizeof(h));
    if (h.magic != kHelloMagic || h.version != kVersion || h.keyLen == 0 || h.keyLen > kMaxNameLen ||
        h.tokenLen > kMaxNameLen || h.ticketLen > kMaxTicketLen)
        return false;
    size_t rest = size_t(h.keyLen) + h.tokenLen + h.ticketLen;
    if (!rd.fill(rest, deadline).empty()) return false;
    peerKey.assign(rd.data(), h.keyLen);
    std::string token(rd.data() + h.keyLen, h.tokenLen);
    std::string ticket(rd.data() + h.keyLen + h.tokenLen, h.ticketLen);
    rd.consume(rest);
    // Requests may follow only after the reply: anything already buffered is a protocol error.
    bool ok = rd.buffered() == 0 && equal_const_time(token, token_);
    if (!ok)
        tickets_.count_bad();
    else
        ok = tickets_.admit(ticket, peerKey);  // counts a refusal itself
    int expected = kHandshaking;
    if (ok && !conn->state.compare_exchange_strong(expected, kServing)) return false;  // evicted meanwhile
    if (ok) bind_key(conn, peerKey);
    HelloReply rep{kHelloMagic, ok ? kSuccess : kErrBadState};
    if (!send_bytes(conn->fd, &rep, sizeof(rep)).empty()) return false;
    return ok;
}

void Target::record_inbound(const std::string& peerKey, uint64_t uid, int code) {
    inbound_->record(peerKey, uid, code);
}

}  // namespace mori::tcp
