// Initiator side of the native TCP data plane: transfers, connections and striping.
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "base/thread_name.hpp"
#include "base/trace.hpp"
#include "tcp/engine.hpp"
#include "tcp/staged.hpp"

namespace mori::tcp {

namespace {

constexpr int kIovBatch = 1024;
constexpr uint64_t kInlineSendBytes = 256 * 1024;
constexpr size_t kSendBatchBytes = 8 << 20;
// Staged reads whose copies to the device run while the next replies are read: at most this
// many before they are waited for (each holds pinned memory).
constexpr size_t kPendingReads = 16;

// The request frame of row i of w.
ReqHdr request_header(const Work& w, size_t i) {
    ReqHdr h;
    std::memset(&h, 0, sizeof(h));
    h.magic = kReqMagic;
    h.op = w.op;
    h.block = RequestEntry{w.memId, w.rows[i].dst, w.rows[i].bytes};
    if (w.notify && i == 0) h.flags |= kFlagBegin;
    if (w.notify && i + 1 == w.rows.size()) h.flags |= kFlagNotify;
    return h;
}

}  // namespace

// ---- Transfer ---------------------------------------------------------------------------------

bool Transfer::wait(double timeoutSec) {
    return wait_until(deadline_in(timeoutSec), [this](int64_t deadline) {
        if (auto conn = conn_.lock()) conn->lead(*this, deadline);
    });
}

// ---- InitConn ---------------------------------------------------------------------------------

InitConn::InitConn(int fd, std::string peerName, double ioTimeout, std::string timeoutSetting)
    : fd_(fd), peer_(std::move(peerName)), ioTimeout_(ioTimeout), timeoutSetting_(std::move(timeoutSetting)), rd_(fd) {
    struct timeval tv{};
    tv.tv_sec = static_cast<time_t>(ioTimeout);
    tv.tv_usec = static_cast<suseconds_t>((ioTimeout - static_cast<double>(tv.tv_sec)) * 1e6);
    setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    // Without an epoll set (descriptors ran out) the receiver thread polls the socket itself.
    watchFd_ = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev{};
    ev.events = EPOLLIN;
    if (watchFd_ >= 0 && epoll_ctl(watchFd_, EPOLL_CTL_ADD, fd_, &ev) != 0) {
        ::close(watchFd_);
        watchFd_ = -1;
    }
    sender_ = std::thread([this] {
        name_this_thread("mori-tcp-send");
        send_loop();
    });
    receiver_ = std::thread([this] {
        name_this_thread("mori-tcp-recv");
        recv_loop();
    });
}

InitConn::~InitConn() { close(); }

void InitConn::close() {
    {
        std::lock_guard lk(mu_);
        if (stop_ && !sender_.joinable()) return;
        stop_ = true;
    }
    mark_broken("connection closed by this engine");
    cv_.notify_all();
    rxCv_.notify_all();
    if (sender_.joinable()) sender_.join();
    if (receiver_.joinable()) receiver_.join();
    {
        // A waiter reading replies stops at once: its socket calls fail after the shutdown.
        std::unique_lock lk(mu_);
        rxCv_.wait(lk, [this] { return !receiving_; });
    }
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    if (watchFd_ >= 0) ::close(watchFd_);
    watchFd_ = -1;
}

bool InitConn::idle() const {
    std::lock_guard lk(mu_);
    return pending_.empty() && sendq_.empty() && !sending_;
}

bool InitConn::broken() const {
    std::lock_guard lk(mu_);
    return !broken_.empty();
}

bool InitConn::claim_locked(const std::shared_ptr<Work>& w) {
    if (!broken_.empty()) return false;
    sending_ = true;
    if (w->op != kOpNotify) {
        if (pending_.empty()) pendingSinceNs_ = now_ns();
        pending_.push_back(w);
    }
    return true;
}

void InitConn::release_send(const std::string& err) {
    bool wake;
    {
        std::lock_guard lk(mu_);
        sending_ = false;
        wake = !sendq_.empty() || stop_;  // the sender thread has nothing to do otherwise
    }
    if (!err.empty()) mark_broken(err);  // wakes everyone itself
    if (wake) cv_.notify_all();
}

void InitConn::enqueue(std::shared_ptr<Work> work) {
    uint64_t bytes = 0;
    if (work->op == kOpWrite)
        for (const plan::Row& r : work->rows) bytes += r.bytes;
    {
        std::unique_lock lk(mu_);
        // Small work with an idle socket goes out on the caller's thread: no hand-off to the
        // sender thread (a wake-up that dominates the latency of small transfers). Big work is
        // queued so that the caller returns at once, and so is staged work of several blocks:
        // their copies then run on the connections' own threads side by side, not one after
        // another on the caller's.
        const size_t inlineRows = work->stager ? 1 : 64;
        if (!sending_ && sendq_.empty() && !stop_ && bytes <= kInlineSendBytes && work->rows.size() <= inlineRows &&
            claim_locked(work)) {
            lk.unlock();
            release_send(send_work(*work));
            return;
        }
        sendq_.push_back(std::move(work));
    }
    cv_.notify_all();
}

void InitConn::enqueue_notify(uint64_t uid, int code) {
    auto w = std::make_shared<Work>();
    w->op = kOpNotify;
    w->memId = uid;
    w->rows.push_back(plan::Row{0, static_cast<uint64_t>(code), 0});
    enqueue(std::move(w));
}

void InitConn::fail_rest(std::vector<std::pair<std::shared_ptr<Work>, size_t>>& failed, const std::string& why) {
    for (auto& [w, n] : failed) {
        if (n == 0 || !w->transfer) continue;
        if (w->transfer->complete_blocks(static_cast<int64_t>(n), kErrBadState, why)) w->transfer->finish();
    }
}

void InitConn::mark_broken(const std::string& reason) {
    std::vector<std::pair<std::shared_ptr<Work>, size_t>> failed;
    std::string why;
    {
        std::lock_guard lk(mu_);
        if (broken_.empty()) {
            broken_ = reason;
            if (fd_ >= 0) shutdown(fd_, SHUT_RDWR);
        }
        why = "TCP connection to " + peer_ + " failed: " + broken_;
        // Claim every unanswered block so the receiver cannot complete it a second time.
        for (auto& w : pending_) {
            failed.emplace_back(w, w->rows.size() - w->done);
            w->done = w->rows.size();
        }
        pending_.clear();
    }
    cv_.notify_all();
    rxCv_.notify_all();
    fail_rest(failed, why);
}

std::string InitConn::send_staged_work(const Work& w) {
    std::vector<DeviceSource::Span> spans;
    spans.reserve(w.rows.size());
    for (const plan::Row& b : w.rows) spans.push_back({b.src, b.bytes});
    uint64_t uid = w.notify ? w.transfer->uid() : 0;
    try {
        const gpu::Current current(w.stager->config());    // once, not per copy (an application's thread)
        DeviceSource source(*w.stager, std::move(spans));  // copies run ahead of the socket, across rows
        for (; !source.done(); source.pop()) {
            DeviceSource::Piece& p = source.next();
            trace::mark('O', 1);
            struct iovec iov[3];
            int n = 0;
            ReqHdr h = request_header(w, p.span);
            if (p.first) {
                iov[n++] = {&h, sizeof(h)};
                if (h.flags & kFlagNotify) iov[n++] = {&uid, sizeof(uid)};
            }
            iov[n++] = {p.data(), p.size()};
            trace::mark('m', w.op);
            std::string e = send_all(fd_, iov, n);
            trace::mark('M', w.op);
            if (!e.empty()) return e;
        }
    } catch (const std::exception& e) {  // a request may be half sent: the connection cannot go on
        return std::string("copying local GPU memory out for a write: ") + e.what();
    }
    return "";
}

std::string InitConn::send_work(const Work& w) {
    if (w.stager && w.op == kOpWrite) return send_staged_work(w);
    std::vector<ReqHdr> hdrs(w.rows.size());
    std::vector<struct iovec> iov;
    iov.reserve(kIovBatch + 3);
    size_t bytes = 0;
    uint64_t uid = w.notify ? w.transfer->uid() : 0;
    for (size_t i = 0; i < w.rows.size(); ++i) {
        const plan::Row& b = w.rows[i];
        ReqHdr& h = hdrs[i];
        h = request_header(w, i);
        iov.push_back({&h, sizeof(h)});
        bytes += sizeof(h);
        if (h.flags & kFlagNotify) {
            iov.push_back({&uid, sizeof(uid)});
            bytes += sizeof(uid);
        }
        if (w.op == kOpWrite && b.bytes > 0) {
            iov.push_back({reinterpret_cast<void*>(b.src), b.bytes});
            bytes += b.bytes;
        }
        if (static_cast<int>(iov.size()) >= kIovBatch || bytes >= kSendBatchBytes || i + 1 == w.rows.size()) {
            trace::mark('m', w.op);
            std::string e = send_all(fd_, iov.data(), static_cast<int>(iov.size()));
            trace::mark('M', w.op);
            if (!e.empty()) return e;
            iov.clear();
            bytes = 0;
        }
    }
    return "";
}

void InitConn::send_loop() {
    gpu::own_thread();  // staged copies keep the GPU's context current here (gpu/staging.hpp)
    for (;;) {
        std::shared_ptr<Work> w;
        std::string broken;
        {
            std::unique_lock lk(mu_);
            cv_.wait(lk, [this] { return (stop_ && !sending_) || (!sendq_.empty() && !sending_); });
            if (sendq_.empty()) return;
            w = std::move(sendq_.front());
            sendq_.pop_front();
            if (!claim_locked(w)) broken = broken_;
        }
        if (!broken.empty()) {
            if (w->op == kOpNotify) continue;
            std::vector<std::pair<std::shared_ptr<Work>, size_t>> one{{w, w->rows.size()}};
            fail_rest(one, "TCP connection to " + peer_ + " failed: " + broken);
            continue;
        }
        release_send(send_work(*w));
    }
}

std::string InitConn::abort_check(const Reader& rd) {
    std::lock_guard lk(mu_);
    if (stop_) return "closed";
    if (!broken_.empty()) return broken_;
    if (!pending_.empty()) {
        double since = std::min(rd.idle_seconds(), static_cast<double>(now_ns() - pendingSinceNs_) * 1e-9);
        if (since > ioTimeout_)
            return "no reply for " + std::to_string(static_cast<int>(ioTimeout_)) + " s (" + timeoutSetting_ + ")";
    }
    return "";
}

bool InitConn::claim_recv() {
    std::lock_guard lk(mu_);
    if (receiving_ || stop_ || !broken_.empty()) return false;
    receiving_ = true;
    mute_locked(true);
    return true;
}

void InitConn::release_recv(const std::string& err) {
    if (!err.empty()) mark_broken(err);
    bool wake;
    {
        std::lock_guard lk(mu_);
        receiving_ = false;
        mute_locked(false);  // replies left unread wake the receiver thread now
        wake = recvWaiting_ || stop_;
    }
    if (wake) rxCv_.notify_all();
}

void InitConn::mute_locked(bool mute) {
    if (watchFd_ < 0 || muted_ == mute) return;
    // Interest 0 still reports a hang-up or an error: then the receiver thread waits on rxCv_.
    struct epoll_event ev{};
    ev.events = mute ? 0 : EPOLLIN;
    if (epoll_ctl(watchFd_, EPOLL_CTL_MOD, fd_, &ev) == 0) muted_ = mute;
}

std::string InitConn::watch_replies(const AbortCheck& check) {
    if (watchFd_ < 0) return rd_.wait_readable(check);
    for (;;) {
        struct epoll_event ev{};
        int n = epoll_wait(watchFd_, &ev, 1, 100);
        if (n > 0) return "";
        if (n < 0 && errno != EINTR) return std::string("epoll_wait: ") + std::strerror(errno);
        std::string e = check();
        if (!e.empty()) return e;
    }
}

bool InitConn::lead(const Transfer& t, int64_t deadlineNs) {
    if (!claim_recv()) return false;
    std::string err;
    // Stop only between frames with the buffer empty: the receive side is handed back clean.
    while (err.empty() && (t.code() == kInProgress || rd_.buffered() > 0)) {
        if (rd_.buffered() == 0) {
            bool ready = rd_.spin_readable(Reader::kSpinNs);
            while (!ready && err.empty()) {
                int64_t left = deadlineNs - now_ns();
                if (left <= 0) break;
                ready = rd_.readable(static_cast<int>(std::min<int64_t>(left / 1000000 + 1, 100)));
                if (!ready) err = abort_check(rd_);
            }
            if (!ready) break;
        }
        err = read_reply();
    }
    settle_reads();  // the receive side is handed back with no block left waiting on it
    release_recv(err);
    return true;
}

void InitConn::recv_loop() {
    gpu::own_thread();  // staged copies keep the GPU's context current here (gpu/staging.hpp)
    AbortCheck check = [this] { return abort_check(rd_); };
    for (;;) {
        // Not owning the receive side: its buffer is empty, so the socket tells whether replies
        // wait. A waiter may be reading them; then this thread stands by until it is done.
        std::string e = watch_replies(check);
        if (!e.empty()) {
            mark_broken(e);
            return;
        }
        {
            std::unique_lock lk(mu_);
            recvWaiting_ = true;
            rxCv_.wait(lk, [this] { return !receiving_ || stop_ || !broken_.empty(); });
            recvWaiting_ = false;
            if (stop_ || !broken_.empty()) return;
            receiving_ = true;
        }
        while (e.empty() && (rd_.buffered() > 0 || rd_.readable(0))) e = read_reply();
        settle_reads();
        release_recv(e);
        if (!e.empty()) return;
    }
}

std::string InitConn::read_reply() {
    std::string e = read_reply_frame();
    if (!e.empty()) settle_reads();  // the connection is going: what was received still completes
    return e;
}

std::string InitConn::read_reply_frame() {
    AbortCheck check = [this] { return abort_check(rd_); };
    std::string e = rd_.fill(sizeof(RepHdr), check);
    if (!e.empty()) return e;
    trace::mark('Q');
    RepHdr h;
    std::memcpy(&h, rd_.data(), sizeof(h));
    rd_.consume(sizeof(h));
    std::shared_ptr<Work> w;
    size_t idx = 0;
    {
        std::lock_guard lk(mu_);
        if (!pending_.empty()) {
            w = pending_.front();
            idx = w->done;
        }
    }
    if (h.magic != kRepMagic || !w) return "protocol error: unexpected reply frame";
    const plan::Row& b = w->rows[idx];
    std::string msg;
    if (h.code == kSuccess && w->op == kOpRead) {
        if (h.size != b.bytes) return "protocol error: read reply of wrong size";
        if (w->stager) return read_staged(w, idx, check);
        e = rd_.read_into(reinterpret_cast<char*>(b.src), b.bytes, check);
        if (!e.empty()) return e;
    } else if (h.code != kSuccess) {
        msg = "block (remote memory id " + std::to_string(w->memId) + ", offset " + std::to_string(b.dst) + ", size " +
              std::to_string(b.bytes) + "): " + reason_text(static_cast<uint32_t>(h.size));
    }
    bool finished = false;
    {
        std::lock_guard lk(mu_);
        if (w->done != idx) return "";  // already failed by mark_broken
        if (++w->done == w->rows.size()) pending_.pop_front();
        pendingSinceNs_ = now_ns();
        finished = w->transfer->complete_blocks(1, h.code, msg);
    }
    if (finished) {
        if (w->transfer->notify()) enqueue_notify(w->transfer->uid(), w->transfer->final_code());
        w->transfer->finish();
    }
    return "";
}

// ---- Peer -------------------------------------------------------------------------------------

Peer::Peer(const std::string& name, const std::string& host, int port, int nconn, const std::string& myKey,
           const std::string& token, const std::string& ticket, double ioTimeout, const std::string& timeoutSetting)
    : name_(name) {
    if (nconn < 1 || nconn > 64) throw std::invalid_argument("connections per peer must be 1..64");
    if (myKey.empty() || myKey.size() > kMaxNameLen || token.size() > kMaxNameLen || ticket.size() > kMaxTicketLen)
        throw std::invalid_argument("engine key must be 1..4096 bytes, token at most 4096 bytes, ticket at most 256");
    for (int i = 0; i < nconn; ++i) {
        std::string err;
        int fd = connect_to(host, port, ioTimeout, err);
        if (fd < 0) throw std::runtime_error(err);
        Hello h{kHelloMagic, kVersion, static_cast<uint16_t>(myKey.size()), static_cast<uint16_t>(token.size()),
                static_cast<uint16_t>(ticket.size())};
        std::string msg(reinterpret_cast<const char*>(&h), sizeof(h));
        msg += myKey;
        msg += token;
        msg += ticket;
        err = send_bytes(fd, msg.data(), msg.size());
        Reader rd(fd, 64);
        AbortCheck deadline = [&rd, ioTimeout, &timeoutSetting]() -> std::string {
            return rd.idle_seconds() > ioTimeout ? "no answer to hello (" + timeoutSetting + ")" : "";
        };
        if (err.empty()) err = rd.fill(sizeof(HelloReply), deadline);
        HelloReply rep{0, 0};
        if (err.empty()) std::memcpy(&rep, rd.data(), sizeof(rep));
        if (err.empty() && (rep.magic != kHelloMagic || rep.code != kSuccess))
            err = rep.code == kErrBadState ? "rejected: auth token or data-plane ticket not accepted"
                                           : "rejected: bad hello reply";
        if (!err.empty()) {
            ::close(fd);
            throw std::runtime_error(err.rfind("rejected:", 0) == 0 ? err : "handshake with " + name + ": " + err);
        }
        conns_.push_back(std::make_shared<InitConn>(fd, name, ioTimeout, timeoutSetting));
    }
}

Peer::~Peer() { close(); }

void Peer::close() {
    for (auto& c : conns_) c->close();
}

bool Peer::healthy() const {
    return std::none_of(conns_.begin(), conns_.end(), [](const auto& c) { return c->broken(); });
}

std::string InitConn::read_staged(const std::shared_ptr<Work>& w, size_t idx, const AbortCheck& check) {
    const plan::Row& b = w->rows[idx];
    DeviceSink sink(*w->stager, b.src, b.bytes, &landing_);
    {
        const gpu::Current current(w->stager->config());  // once, not per copy (maybe an application's thread)
        std::string e = sink.receive(rd_, check);
        if (!e.empty()) return e;
        trace::mark('L');
    }
    {
        std::lock_guard lk(mu_);
        if (w->done != idx)
            return "";  // already failed by mark_broken (the sink's memory is never lent
                        // again while its copies may run)
        if (++w->done == w->rows.size()) pending_.pop_front();
        pendingSinceNs_ = now_ns();
    }
    pendingReads_.push_back(PendingRead{w, idx, std::move(sink)});
    settle_reads(false);
    while (pendingReads_.size() > kPendingReads) settle_oldest_read();
    // Nothing more to read now (a landing run was closed by the sink as the buffer emptied): the
    // copies are waited for while the socket is watched, so that no block waits on a thread that
    // stopped reading, and a reply that comes meanwhile is read at once (a wait for the copies at
    // every block would stall the receive for a copy's time).
    while (!pendingReads_.empty() && rd_.buffered() == 0 && !rd_.readable(0)) {
        std::this_thread::yield();
        settle_reads(false);
    }
    return "";
}

void InitConn::settle_reads(bool wait) {
    while (!pendingReads_.empty()) {
        PendingRead& p = pendingReads_.front();
        if (!wait) {
            const gpu::Current current(p.work->stager->config());
            if (!p.sink.settled()) return;
        }
        settle_oldest_read();
    }
}

void InitConn::settle_oldest_read() {
    PendingRead& p = pendingReads_.front();
    std::string failed;
    {
        const gpu::Current current(p.work->stager->config());
        failed = p.sink.finish();
        trace::mark('E');
    }
    std::string msg;
    if (!failed.empty()) {
        const plan::Row& b = p.work->rows[p.idx];
        msg = "block (remote memory id " + std::to_string(p.work->memId) + ", offset " + std::to_string(b.dst) +
              ", size " + std::to_string(b.bytes) + "): copying it into local GPU memory failed: " + failed;
    }
    if (p.work->transfer->complete_blocks(1, failed.empty() ? kSuccess : kErrDevice, msg)) {
        if (p.work->transfer->notify()) enqueue_notify(p.work->transfer->uid(), p.work->transfer->final_code());
        p.work->transfer->finish();
    }
    pendingReads_.pop_front();
}

std::shared_ptr<Transfer> Peer::submit(uint8_t op, const plan::Batch& batch, uint64_t memId, uint64_t uid, bool notify,
                                       uint64_t stripe, std::shared_ptr<gpu::Stager> stager) {
    if (op != kOpRead && op != kOpWrite) throw std::invalid_argument("op must be read (1) or write (2)");
    trace::mark('T', op);
    // Pieces: rows cut at the stripe size (a Batch holds no empty row).
    const plan::Batch pieces = batch.stripe(std::max<uint64_t>(stripe, 4096));
    size_t n = conns_.size();
    // Back-to-back transfers stay on one idle connection: its threads at both ends are still
    // polling (see Reader::kSpinNs) and answer at once, where a rotation would find them asleep.
    // A busy connection passes the turn on, so concurrent transfers still spread out.
    size_t first = static_cast<size_t>(next_.load(std::memory_order_relaxed) % n);
    if (!conns_[first]->idle()) first = static_cast<size_t>((next_.fetch_add(1) + 1) % n);
    if (pieces.empty()) {
        if (notify) conns_[first]->enqueue_notify(uid, kSuccess);
        auto t = std::make_shared<Transfer>(0, false, uid);
        t->finish();
        return t;
    }
    // Contiguous runs of about equal bytes, one per connection, starting at a rotating connection
    // so that concurrent small transfers spread over all of them.
    std::vector<plan::Batch> runs = pieces.deal(n, 1);
    // On one connection the requests themselves carry the notification (the target records it
    // before it answers the last); a striped transfer notifies with a frame once it finishes.
    bool carried = notify && runs.size() == 1;
    auto t = std::make_shared<Transfer>(static_cast<int64_t>(pieces.size()), notify && !carried, uid);
    for (size_t r = 0; r < runs.size(); ++r) {
        auto w = std::make_shared<Work>();
        w->transfer = t;
        w->op = op;
        w->memId = memId;
        w->notify = carried;
        w->rows.assign(runs[r].begin(), runs[r].end());
        w->stager = stager;
        conns_[(first + r) % n]->enqueue(std::move(w));
    }
    if (runs.size() == 1) t->set_conn(conns_[first]);
    return t;
}

}  // namespace mori::tcp
