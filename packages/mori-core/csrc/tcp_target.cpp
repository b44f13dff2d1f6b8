// Target side of the native TCP data plane: every request is checked against the registered
// regions before a byte of memory is touched. As in MORI, any engine that presents the auth token
// is served; registering a remote engine is the initiator's step only.
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <stdexcept>

#include "tcp_engine.hpp"

namespace mori::tcp {

namespace {

constexpr size_t kInlineRead = 64 * 1024;  // reads up to this size are copied into the reply buffer
constexpr size_t kFlushBytes = 1 << 20;

void set_send_timeout(int fd, double sec) {
    struct timeval tv {};
    tv.tv_sec = static_cast<time_t>(sec);
    tv.tv_usec = static_cast<suseconds_t>((sec - static_cast<double>(tv.tv_sec)) * 1e6);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

bool equal_const_time(const std::string& a, const std::string& b) {
    if (a.size() != b.size()) return false;
    unsigned char diff = 0;
    for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
    return diff == 0;
}

}  // namespace

Target::Target(const std::string& host, int port, std::string token, double ioTimeout)
    : token_(std::move(token)), ioTimeout_(ioTimeout) {
    struct addrinfo hints {};
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
    if (listenFd_ < 0) throw std::runtime_error("TCP data plane: cannot listen on " + host + ":" + portText + ": " + err);
    struct sockaddr_storage addr {};
    socklen_t len = sizeof(addr);
    getsockname(listenFd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                             : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
    acceptThread_ = std::thread([this] { accept_loop(); });
}

Target::~Target() { close(); }

void Target::register_region(uint64_t id, uint64_t addr, uint64_t size) {
    std::unique_lock lk(stateMu_);
    regions_[id] = Region{addr, size};
}

bool Target::deregister_region(uint64_t id) {
    // Waits for requests in flight on this region (they hold the lock shared).
    std::unique_lock lk(stateMu_);
    return regions_.erase(id) > 0;
}

std::optional<int> Target::pop_inbound(const std::string& key, uint64_t uid) {
    std::lock_guard lk(inboundMu_);
    auto it = inbound_.find({key, uid});
    if (it == inbound_.end()) return std::nullopt;
    int code = it->second;
    inbound_.erase(it);
    return code;
}

size_t Target::connection_count() {
    std::lock_guard lk(connsMu_);
    reap(false);
    return conns_.size();
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
            it->thread.join();
            ::close(it->fd);
            it = conns_.erase(it);
        } else {
            ++it;
        }
    }
}

void Target::accept_loop() {
    struct pollfd p {listenFd_, POLLIN, 0};
    while (!stop_.load()) {
        if (poll(&p, 1, 200) <= 0) continue;
        int fd = accept4(listenFd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd < 0) continue;
        tune_socket(fd);
        set_send_timeout(fd, ioTimeout_);
        std::lock_guard lk(connsMu_);
        reap(false);
        if (stop_.load()) {
            ::close(fd);
            break;
        }
        Conn& c = conns_.emplace_back();
        c.fd = fd;
        c.thread = std::thread([this, conn = &c] { serve(conn); });
    }
}

bool Target::handshake(int fd, Reader& rd, std::string& peerKey) {
    AbortCheck deadline = [this, &rd]() -> std::string {
        if (stop_.load()) return "closed";
        return rd.idle_seconds() > ioTimeout_ ? "no hello" : "";
    };
    if (!rd.fill(sizeof(Hello), deadline).empty()) return false;
    Hello h;
    std::memcpy(&h, rd.data(), sizeof(h));
    rd.consume(sizeof(h));
    if (h.magic != kHelloMagic || h.version != kVersion || h.keyLen == 0 || h.keyLen > kMaxNameLen ||
        h.tokenLen > kMaxNameLen)
        return false;
    if (!rd.fill(size_t(h.keyLen) + h.tokenLen, deadline).empty()) return false;
    peerKey.assign(rd.data(), h.keyLen);
    std::string token(rd.data() + h.keyLen, h.tokenLen);
    rd.consume(size_t(h.keyLen) + h.tokenLen);
    HelloReply rep{kHelloMagic, equal_const_time(token, token_) ? kSuccess : kErrBadState};
    if (!send_bytes(fd, &rep, sizeof(rep)).empty()) return false;
    return rep.code == kSuccess;
}

int Target::check(uint64_t memId, uint64_t off, uint64_t size, uint64_t& addr, uint64_t& reason) {
    auto it = regions_.find(memId);
    if (it == regions_.end()) {
        reason = kReasonMemory;
        return kErrNotFound;
    }
    if (off > it->second.size || size > it->second.size - off) {
        reason = kReasonRange;
        return kErrInvalidArgs;
    }
    addr = it->second.addr + off;
    reason = 0;
    return kSuccess;
}

void Target::record_inbound(const std::string& peerKey, uint64_t uid, int code) {
    std::lock_guard lk(inboundMu_);
    inbound_[{peerKey, uid}] = code;
}

void Target::serve(Conn* conn) {
    int fd = conn->fd;
    Reader rd(fd);
    std::string peerKey;
    if (handshake(fd, rd, peerKey)) {
        std::vector<char> out;
        out.reserve(kFlushBytes + kInlineRead + 64);
        AbortCheck idle = [this]() -> std::string { return stop_.load() ? "closed" : ""; };
        AbortCheck midFrame = [this, &rd]() -> std::string {
            if (stop_.load()) return "closed";
            return rd.idle_seconds() > ioTimeout_ ? "peer stalled mid-frame" : "";
        };
        int outcome = kSuccess;  // first failure of the notifying transfer being served
        auto append = [&out](const void* p, size_t n) {
            out.insert(out.end(), static_cast<const char*>(p), static_cast<const char*>(p) + n);
        };
        for (;;) {
            if (rd.buffered() == 0) {
                // About to block: answer everything received so far first.
                if (!out.empty() && !send_bytes(fd, out.data(), out.size()).empty()) break;
                out.clear();
                if (!rd.wait_readable(idle, Reader::kSpinNs).empty()) break;
            }
            if (!rd.fill(sizeof(ReqHdr), midFrame).empty()) break;
            ReqHdr h;
            std::memcpy(&h, rd.data(), sizeof(h));
            rd.consume(sizeof(h));
            if (h.magic != kReqMagic || h.size > kMaxBlock || (h.flags & ~kFlagsKnown) != 0 ||
                (h.flags != 0 && h.op == kOpNotify))
                break;  // malformed: drop the connection
            uint64_t uid = 0;
            if (h.flags & kFlagNotify) {
                if (!rd.fill(sizeof(uid), midFrame).empty()) break;
                std::memcpy(&uid, rd.data(), sizeof(uid));
                rd.consume(sizeof(uid));
            }
            if (h.flags & kFlagBegin) outcome = kSuccess;
            uint64_t addr = 0, reason = 0;
            if (h.op == kOpNotify) {
                record_inbound(peerKey, h.memId, static_cast<int>(h.offset));
                continue;
            }
            if (h.op != kOpWrite && h.op != kOpRead) break;
            std::shared_lock lk(stateMu_);
            int code = check(h.memId, h.offset, h.size, addr, reason);
            if (outcome == kSuccess) outcome = code;
            // The outcome of a notifying transfer is recorded once its last block's bytes have
            // left (or entered) the registered memory, and before the initiator can see the
            // transfer finish.
            bool record = (h.flags & kFlagNotify) != 0;
            if (h.op == kOpWrite) {
                char* dst = code == kSuccess ? reinterpret_cast<char*>(addr) : nullptr;
                if (!rd.read_into(dst, h.size, midFrame).empty()) break;
                RepHdr rep{kRepMagic, code, reason};
                append(&rep, sizeof(rep));
            } else {
                RepHdr rep{kRepMagic, code, code == kSuccess ? h.size : reason};
                append(&rep, sizeof(rep));
                if (code == kSuccess && h.size <= kInlineRead) {
                    append(reinterpret_cast<const void*>(addr), h.size);
                } else if (code == kSuccess) {
                    // A notifying read holds its last byte back until the record is made.
                    uint64_t held = record ? 1 : 0;
                    struct iovec iov[2] = {{out.data(), out.size()}, {reinterpret_cast<void*>(addr), h.size - held}};
                    if (!send_all(fd, iov, 2).empty()) break;
                    out.clear();
                    if (record) {
                        record_inbound(peerKey, uid, outcome);
                        record = false;
                        if (!send_bytes(fd, reinterpret_cast<const void*>(addr + h.size - 1), 1).empty()) break;
                    }
                }
            }
            if (record) record_inbound(peerKey, uid, outcome);
            lk.unlock();
            if (out.size() >= kFlushBytes) {
                if (!send_bytes(fd, out.data(), out.size()).empty()) break;
                out.clear();
            }
        }
    }
    shutdown(fd, SHUT_RDWR);
    conn->done.store(true);
}

}  // namespace mori::tcp
