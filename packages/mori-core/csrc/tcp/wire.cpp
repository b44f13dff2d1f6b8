// Socket helpers of the native TCP data plane (see tcp/wire.hpp).
#include "tcp/wire.hpp"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "base/copy_for_device.hpp"

namespace mori::tcp {

namespace {

void copy_plain(void* dst, const void* src, size_t n) { std::memcpy(dst, src, n); }

// Reads a number from /proc with plain POSIX calls. Not iostreams: their locale facets crashed
// (SIGSEGV in codecvt) when the extension shared a process with PyTorch on the GPU machine.
long read_sysctl(const char* path) {
    int fd = ::open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    char buf[32] = {};
    ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
    ::close(fd);
    return n > 0 ? std::strtol(buf, nullptr, 10) : 0;
}

std::string errno_text(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

}  // namespace

Reader::Reader(int fd, size_t cap) : fd_(fd), buf_(cap), lastDataNs_(now_ns()) {}

double Reader::idle_seconds() const { return static_cast<double>(now_ns() - lastDataNs_) * 1e-9; }

void tune_socket(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    // Setting SO_SNDBUF/SO_RCVBUF turns kernel autotuning off and is capped by *mem_max, so we
    // only set it where the cap allows a buffer bigger than autotuning would reach by itself.
    const int want = 8 << 20;
    if (read_sysctl("/proc/sys/net/core/wmem_max") >= want) setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &want, sizeof(want));
    if (read_sysctl("/proc/sys/net/core/rmem_max") >= want) setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &want, sizeof(want));
}

std::string send_all(int fd, struct iovec* iov, int n) {
    int i = 0;
    while (i < n) {
        struct msghdr msg{};
        msg.msg_iov = iov + i;
        msg.msg_iovlen = static_cast<size_t>(std::min(n - i, IOV_MAX));
        ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return "send timed out (peer not reading)";
            return errno_text("send");
        }
        size_t left = static_cast<size_t>(sent);
        while (i < n && left >= iov[i].iov_len) {
            left -= iov[i].iov_len;
            ++i;
        }
        if (i < n) {
            iov[i].iov_base = static_cast<char*>(iov[i].iov_base) + left;
            iov[i].iov_len -= left;
        }
    }
    return "";
}

std::string send_bytes(int fd, const void* data, size_t len) {
    struct iovec iov{const_cast<void*>(data), len};
    return send_all(fd, &iov, 1);
}

int connect_to(const std::string& host, int port, double timeoutSec, std::string& err) {
    struct addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    struct addrinfo* res = nullptr;
    std::string portText = std::to_string(port);
    int rc = getaddrinfo(host.c_str(), portText.c_str(), &hints, &res);
    if (rc != 0) {
        err = "cannot resolve " + host + ": " + gai_strerror(rc);
        return -1;
    }
    int fd = -1;
    for (auto* ai = res; ai != nullptr && fd < 0; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
        if (fd < 0) continue;
        tune_socket(fd);
        rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
        if (rc < 0 && errno == EINPROGRESS) {
            struct pollfd p{fd, POLLOUT, 0};
            rc = poll(&p, 1, static_cast<int>(timeoutSec * 1000));
            int soerr = 0;
            socklen_t len = sizeof(soerr);
            if (rc == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len) == 0 && soerr == 0) {
                rc = 0;
            } else {
                err = rc == 0 ? "connect timed out" : std::string("connect: ") + std::strerror(soerr ? soerr : errno);
                rc = -1;
            }
        } else if (rc < 0) {
            err = errno_text("connect");
        }
        if (rc != 0) {
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(res);
    if (fd < 0) {
        err = "cannot connect to " + host + ":" + portText + " (" + err + ")";
        return -1;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    return fd;
}

std::string Reader::recv_some(char* dst, size_t cap, size_t& got, const AbortCheck& check) {
    for (;;) {
        ssize_t r = recv(fd_, dst, cap, MSG_DONTWAIT);
        if (r > 0) {
            got = static_cast<size_t>(r);
            lastDataNs_.store(now_ns(), std::memory_order_relaxed);
            return "";
        }
        if (r == 0) return "connection closed by peer";
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return errno_text("recv");
        std::string e = wait_readable(check);
        if (!e.empty()) return e;
    }
}

bool Reader::readable(int timeoutMs) const {
    struct pollfd p{fd_, POLLIN, 0};
    return poll(&p, 1, timeoutMs) != 0;  // errors too: the next recv reports them
}

bool Reader::spin_readable(int64_t spinNs) const {
    for (int64_t until = now_ns() + spinNs; now_ns() < until;) {
        if (readable(0)) return true;
        // The thread this one waits for may share its core (few cores, a busy host): yield to
        // it, and when the yield ran someone else, stop spinning and block instead, which
        // leaves the core to the thread that has work.
        int64_t before = now_ns();
        sched_yield();
        if (now_ns() - before > kSharedCoreNs) return readable(0);
    }
    return false;
}

std::string Reader::wait_readable(const AbortCheck& check, int64_t spinNs) {
    if (spinNs > 0 && spin_readable(spinNs)) return "";
    struct pollfd p{fd_, POLLIN, 0};
    for (;;) {
        int rc = poll(&p, 1, 100);
        if (rc > 0) return "";
        if (rc < 0 && errno != EINTR) return errno_text("poll");
        std::string e = check();
        if (!e.empty()) return e;
    }
}

std::string Reader::fill(size_t n, const AbortCheck& check) {
    if (buffered() >= n) return "";
    if (head_ + n > buf_.size()) {  // compact so n bytes fit after head
        std::memmove(buf_.data(), buf_.data() + head_, buffered());
        tail_ -= head_;
        head_ = 0;
    }
    while (buffered() < n) {
        size_t got = 0;
        std::string e = recv_some(buf_.data() + tail_, buf_.size() - tail_, got, check);
        if (!e.empty()) return e;
        tail_ += got;
    }
    return "";
}

std::string Reader::read_into(char* dst, uint64_t n, const AbortCheck& check, bool direct) {
    size_t take = static_cast<size_t>(std::min<uint64_t>(n, buffered()));
    // Not direct: dst is staged memory that the copy engine reads next (see wire.hpp).
    void (*copy)(void*, const void*, size_t) = direct ? copy_plain : copy_for_device;
    if (dst != nullptr && take > 0) copy(dst, data(), take);
    consume(take);
    n -= take;
    uint64_t done = take;
    while (n > 0) {
        size_t got = 0;
        if (dst != nullptr && direct && n >= buf_.size() / 4) {
            // Large remainder: straight into place, no copy.
            std::string e = recv_some(dst + done, static_cast<size_t>(n), got, check);
            if (!e.empty()) return e;
        } else {
            std::string e = fill(1, check);
            if (!e.empty()) return e;
            got = static_cast<size_t>(std::min<uint64_t>(n, buffered()));
            if (dst != nullptr) copy(dst + done, data(), got);
            consume(got);
        }
        n -= got;
        done += got;
    }
    return "";
}

}  // namespace mori::tcp
