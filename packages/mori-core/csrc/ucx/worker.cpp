// A UCX worker of the engine: its progress thread, endpoints, deadlines and the operations in
// flight on it (see ucx/engine.hpp).
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "base/thread_name.hpp"
#include "base/trace.hpp"
#include "ucx/atomic.hpp"
#include "ucx/wire.hpp"

namespace mori::ucx {

namespace {

// How long a progress thread keeps polling after the last event before it sleeps (POLLING
// mode): back-to-back small transfers find it awake, an idle engine costs no CPU.
constexpr int64_t kSpinNs = 200'000;
constexpr int kMaxSleepMs = 100;
// How long a claim (Worker::claim) tries the lock before it sleeps on it, and how long the
// progress thread stands aside for claims at a stretch.
constexpr int64_t kClaimSpinNs = 50'000;
constexpr int64_t kMaxAsideNs = 1'000'000;

api::Status dispatch_request(void* arg, const void* h, size_t hl, void* d, size_t l, const api::AmRecvParam* p) {
    return Serve::on_request(*static_cast<Worker*>(arg), h, hl, d, l, p);
}
api::Status dispatch_reply(void* arg, const void* h, size_t hl, void* d, size_t l, const api::AmRecvParam* p) {
    return Serve::on_reply(*static_cast<Worker*>(arg), h, hl, d, l, p);
}
api::Status dispatch_note(void* arg, const void* h, size_t hl, void*, size_t, const api::AmRecvParam*) {
    Serve::on_note(*static_cast<Worker*>(arg), h, hl);
    return api::kOk;
}

}  // namespace

Worker::Worker(Engine& engine, int index) : engine_(engine), index_(index) {}

Worker::~Worker() {
    if (epollFd_ >= 0) ::close(epollFd_);
    if (wakeFd_ >= 0) ::close(wakeFd_);
}

void Worker::start() {
    const auto& f = fn();
    std::string name = engine_.options().name + ":" + std::to_string(index_);
    api::WorkerParams p{};
    p.fieldMask = api::kWorkerParamThreadMode | api::kWorkerParamEvents | api::kWorkerParamName;
    p.threadMode = api::kThreadModeSerialized;
    p.events = api::kWakeupRma | api::kWakeupAmo | api::kWakeupTx | api::kWakeupRx;
    p.name = name.c_str();
    check("ucp_worker_create", f.worker_create(engine_.context(), &p, &w_));
    api::WorkerAttr attr{};
    attr.fieldMask = api::kWorkerAttrAddress | api::kWorkerAttrMaxAmHeader;
    check("ucp_worker_query", f.worker_query(w_, &attr));
    address_.assign(reinterpret_cast<const char*>(attr.address), attr.addressLength);
    f.worker_release_address(w_, attr.address);
    maxHeader_ = attr.maxAmHeader;
    check("ucp_worker_get_efd", f.worker_get_efd(w_, &efd_));
    for (auto [id, cb] : {std::pair<unsigned, api::AmRecvCallback>{kAmRequest, dispatch_request},
                          {kAmReply, dispatch_reply},
                          {kAmNote, dispatch_note},
                          {kAmAtomic, on_atomic_request},
                          {kAmAtomicReply, on_atomic_reply},
                          {kAmSignalPut, on_signal_put_request}}) {
        api::AmHandlerParam h{};
        h.fieldMask = api::kAmHandlerId | api::kAmHandlerFlags | api::kAmHandlerCb | api::kAmHandlerArg;
        h.id = id;
        h.flags = api::kAmFlagWholeMsg;
        h.cb = cb;
        h.arg = this;
        check("ucp_worker_set_am_recv_handler", f.worker_set_am_recv_handler(w_, &h));
    }
    wakeFd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    epollFd_ = epoll_create1(EPOLL_CLOEXEC);
    if (wakeFd_ < 0 || epollFd_ < 0) throw std::runtime_error(std::string("UCX engine: ") + std::strerror(errno));
    for (int fd : {efd_, wakeFd_}) {
        struct epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.fd = fd;
        if (epoll_ctl(epollFd_, EPOLL_CTL_ADD, fd, &ev) != 0)
            throw std::runtime_error(std::string("UCX engine: epoll_ctl: ") + std::strerror(errno));
    }
    thread_ = std::thread([this] {
        name_this_thread("mori-ucx-worker");
        run();
    });
}

void Worker::wake() {
    if (!sleeping_.load(std::memory_order_acquire)) return;
    uint64_t one = 1;
    ssize_t n = ::write(wakeFd_, &one, sizeof(one));
    (void)n;  // a full counter already wakes the thread
}

std::unique_lock<std::mutex> Worker::claim() {
    claims_.fetch_add(1, std::memory_order_acq_rel);
    std::unique_lock lk(mu_, std::defer_lock);
    const int64_t until = now_ns() + kClaimSpinNs;
    while (!lk.try_lock()) {
        if (now_ns() > until) {
            lk.lock();
            break;
        }
        sched_yield();  // the holder may need this core to finish
    }
    claims_.fetch_sub(1, std::memory_order_acq_rel);
    return lk;
}

unsigned Worker::progress_locked() {
    const auto& f = fn();
    unsigned n = f.worker_progress(w_);
    // Work the callbacks left for after progress (UCX calls that must not run inside them).
    while (!failedLinks_.empty()) {
        Link* link = failedLinks_.back();
        failedLinks_.pop_back();
        close_link_locked(*link, link->failed);
    }
    if (!copies_.empty()) n += finish_copies_locked();
    if (sweep_) sweep_parts_locked();
    if (!closing_.empty()) {
        closing_.erase(std::remove_if(closing_.begin(), closing_.end(),
                                      [&f](void* req) {
                                          if (f.request_check_status(req) == api::kInProgress) return false;
                                          f.request_free(req);
                                          return true;
                                      }),
                       closing_.end());
    }
    if (nextDeadlineNs_ != INT64_MAX) {
        int64_t now = now_ns();
        if (now >= nextDeadlineNs_) expire_locked(now);
    }
    return n;
}

void Worker::run() {
    const auto& f = fn();
    const bool polling = engine_.options().polling;
    int64_t lastBusy = now_ns();
    int64_t asideSince = 0;  // when the thread began to stand aside for claims (0: it does not)
    uint64_t cudaSeen = 0;
    for (;;) {
        engine_.apply_cuda_context(cudaSeen);
        if (leaders_.load(std::memory_order_acquire) > 0) {
            if (stop_.load()) return;
            if (!muted_.load(std::memory_order_acquire)) {
                sched_yield();  // the leader is about to mute the worker's events, or to leave
                continue;
            }
            if (!engine_.options().standAside) {  // the peer's next message is this thread's: awake
                lastBusy = now_ns();              // (a sleeper wakes tens of µs late on a VM)
                sched_yield();
                continue;
            }
            // A caller leads with the worker's events muted: this thread sleeps until the last
            // leader hands back (its events then wake this thread, ucx/engine.hpp) or wake().
            // Neither the replies the leader reads nor its leaving wake it, where a wake-up a
            // transfer cost a small one several microseconds on a shared core.
            sleeping_.store(true, std::memory_order_release);
            struct epoll_event evs[2];
            if (leaders_.load(std::memory_order_acquire) > 0) epoll_wait(epollFd_, evs, 2, kMaxSleepMs);
            sleeping_.store(false, std::memory_order_release);
            uint64_t drained;
            while (::read(wakeFd_, &drained, sizeof(drained)) > 0) {
            }
            // The caller that led polls for its transfers, and will again for its next one:
            // this thread progresses once, then sleeps on the worker's events unless that found
            // work, instead of spinning beside it (a 4 KiB loop between namespaces on the H200
            // machine: initiator CPU per GB 4.5-4.6 against 6.2-7.8 with the spin, latency lower).
            lastBusy = now_ns() - kSpinNs;
            continue;
        }
        // Another thread takes the lock next: stand aside, for kMaxAsideNs at most at a stretch, so
        // that threads claiming it one after another cannot keep the worker from progressing.
        if (claims_.load(std::memory_order_acquire) > 0) {
            const int64_t now = now_ns();
            if (asideSince == 0) asideSince = now;
            if (now - asideSince < kMaxAsideNs) {
                lastBusy = now;
                sched_yield();
                continue;
            }
        }
        asideSince = 0;
        unsigned n;
        {
            std::lock_guard lk(mu_);
            if (stop_.load()) return;
            n = progress_locked();
        }
        const int64_t now = now_ns();
        if (n > 0) {
            lastBusy = now;
            continue;
        }
        if (copying_.load(std::memory_order_acquire) > 0) {  // a GPU copy ends with no event to wake us
            lastBusy = now;
            sched_yield();
            continue;
        }
        if (polling && now - lastBusy < kSpinNs) {
            sched_yield();  // polite: a busy machine's other threads (the peer's, say) still run
            continue;
        }
        int timeoutMs = kMaxSleepMs;
        {
            std::lock_guard lk(mu_);
            if (stop_.load()) return;
            api::Status s = f.worker_arm(w_);
            if (s == api::kErrBusy) continue;  // events arrived meanwhile: progress them
            if (nextDeadlineNs_ != INT64_MAX)
                timeoutMs =
                    static_cast<int>(std::clamp<int64_t>((nextDeadlineNs_ - now) / 1'000'000 + 1, 0, kMaxSleepMs));
            sleeping_.store(true, std::memory_order_release);
        }
        struct epoll_event evs[2];
        epoll_wait(epollFd_, evs, 2, timeoutMs);
        sleeping_.store(false, std::memory_order_release);
        uint64_t drained;
        while (::read(wakeFd_, &drained, sizeof(drained)) > 0) {
        }
        lastBusy = now_ns();  // woken by an event: poll for the next one a while
    }
}

void Worker::mute_locked(bool mute) {
    if (muted_.load(std::memory_order_relaxed) == mute) return;
    struct epoll_event ev{};
    ev.events = mute ? 0 : EPOLLIN;
    ev.data.fd = efd_;
    if (epoll_ctl(epollFd_, EPOLL_CTL_MOD, efd_, &ev) == 0) muted_.store(mute, std::memory_order_release);
}

void Worker::hand_back_locked() {
    // Armed, the worker's descriptor signals the next event; unmuted, that event wakes the
    // progress thread (at once when one came meanwhile: the epoll set is level-triggered).
    const bool pending = fn().worker_arm(w_) == api::kErrBusy;
    mute_locked(false);
    // Events arrived since the leader's last progress: the thread takes them, awake or about to
    // sleep (wake() skips a thread not yet asleep).
    if (pending) {
        uint64_t one = 1;
        ssize_t n = ::write(wakeFd_, &one, sizeof(one));
        (void)n;  // a full counter already wakes the thread
    }
}

void Worker::after_copy_locked(Staged& staged, std::function<void(const std::string& error)> then) {
    copies_.push_back(CopyWait{&staged, std::move(then)});
    copying_.store(copies_.size(), std::memory_order_release);
    if (sleeping_.load(std::memory_order_acquire)) wake();
}

unsigned Worker::finish_copies_locked() {
    unsigned ended = 0;
    while (!copies_.empty()) {
        std::string error;
        try {
            if (!copies_.front().staged->copied()) break;
        } catch (const std::exception& e) {
            error = e.what();
        }
        trace::mark('E');
        CopyWait c = std::move(copies_.front());
        copies_.pop_front();
        copying_.store(copies_.size(), std::memory_order_release);
        c.then(error);
        ++ended;
    }
    return ended;
}

void Worker::stop() {
    if (stop_.exchange(true) || !thread_.joinable()) return;
    sleeping_.store(true);
    wake();
    thread_.join();
}

void Worker::destroy() {
    stop();
    std::lock_guard lk(mu_);
    if (w_ == nullptr) return;
    // GPU copies of staged bytes still running: let them end (bounded, else their memory is never
    // lent again) and drop what would follow them (the transfers fail here; no answer leaves).
    const int64_t copiesUntil = now_ns() + 2'000'000'000;
    for (CopyWait& c : copies_) {
        try {
            while (!c.staged->copied() && now_ns() < copiesUntil) sched_yield();
        } catch (const std::exception&) {
        }
    }
    copies_.clear();
    copying_.store(0, std::memory_order_release);
    for (auto& t : inflight_)
        if (!t->finished()) t->fail(kErrBadState, "the UCX engine was closed during the transfer");
    inflight_.clear();
    for (auto& link : links_)
        if (!link->eps.empty()) close_link_locked(*link, "the UCX engine was closed");
    // Let the forced closes finish (bounded): UCX then calls back what was still in flight.
    const int64_t until = now_ns() + 2'000'000'000;
    while (!closing_.empty() && now_ns() < until) progress_locked();
    fn().worker_destroy(w_);
    w_ = nullptr;
    parts_.clear();
    closing_.clear();
    links_.clear();
}

Link* Worker::connect_locked(const std::shared_ptr<PeerState>& peer, const std::string& address, int lanes) {
    const auto& f = fn();
    auto owned = std::make_unique<Link>();
    Link* link = owned.get();
    link->peer = peer;
    link->worker = this;
    links_.push_back(std::move(owned));
    for (int lane = 0; lane < lanes; ++lane) {
        api::EpParams p{};
        p.fieldMask = api::kEpParamRemoteAddress | api::kEpParamErrMode | api::kEpParamErrHandler | api::kEpParamName;
        p.address = reinterpret_cast<const api::Address*>(address.data());
        // Peer-failure detection: a dead peer fails its operations instead of leaving them
        // hanging. The engine's context keeps shared memory usable with it (see Engine).
        p.errMode = api::kErrModePeer;
        p.errHandler = on_ep_error;
        p.errArg = link;
        p.name = peer->key.c_str();
        api::Endpoint* ep = nullptr;
        api::Status s = f.ep_create(w_, &p, &ep);
        if (s != api::kOk) {
            close_link_locked(*link, "could not connect");
            throw UcxError("ucp_ep_create (connecting to engine '" + peer->key + "')", s);
        }
        link->eps.push_back(ep);
    }
    return link;
}

void Worker::on_ep_error(void* arg, api::Endpoint*, api::Status status) {
    auto* link = static_cast<Link*>(arg);
    link->worker->link_failed_locked(*link,
                                     "connection to engine '" + link->peer->key + "' failed: " + status_text(status));
}

void Worker::link_failed_locked(Link& link, const std::string& why) {
    if (!link.failed.empty()) return;
    link.failed = why;
    link.peer->fail(why);
    fail_parts_locked(&link, kErrTransport, why);
    failedLinks_.push_back(&link);  // closed once progress returns
}

void Worker::close_link_locked(Link& link, const std::string& why) {
    const auto& f = fn();
    if (link.failed.empty()) link.failed = why;
    fail_parts_locked(&link, kErrTransport, link.failed);
    for (auto& [id, region] : link.regions)
        for (api::RemoteKey* k : region.keys)
            if (k != nullptr) f.rkey_destroy(k);
    link.regions.clear();
    // Forced: what is still in flight on these endpoints is cancelled, so no late byte of a
    // failed transfer lands in its buffer.
    api::RequestParam p{};
    p.opAttrMask = api::kOpFlags;
    p.flags = api::kEpCloseForce;
    for (api::Endpoint* ep : link.eps) {
        api::StatusPtr r = f.ep_close_nbx(ep, &p);
        if (r != nullptr && !api::is_error_ptr(r)) closing_.push_back(r);
    }
    link.eps.clear();
    failedLinks_.erase(std::remove(failedLinks_.begin(), failedLinks_.end(), &link), failedLinks_.end());
}

void Worker::reap_links_locked() {
    // A closed link is freed once no operation in flight refers to it.
    links_.erase(std::remove_if(links_.begin(), links_.end(),
                                [this](const std::unique_ptr<Link>& l) {
                                    if (l->held || !l->eps.empty() || l->failed.empty()) return false;
                                    for (auto& [id, p] : parts_)
                                        if (p->link == l.get()) return false;
                                    return true;
                                }),
                 links_.end());
}

void Worker::track_locked(const std::shared_ptr<Transfer>& t) {
    // Finished transfers are dropped once the list has doubled since the last time: however many
    // run at once, each transfer costs a constant share of the scans.
    if (inflight_.size() >= pruneAt_) {
        inflight_.erase(std::remove_if(inflight_.begin(), inflight_.end(), [](auto& x) { return x->finished(); }),
                        inflight_.end());
        pruneAt_ = std::max<size_t>(64, 2 * inflight_.size());
    }
    inflight_.push_back(t);
    nextDeadlineNs_ = std::min(nextDeadlineNs_, t->deadline_ns());
}

void Worker::expire_locked(int64_t now) {
    nextDeadlineNs_ = INT64_MAX;
    std::vector<std::pair<Link*, std::string>> expired;
    std::vector<std::shared_ptr<Transfer>> still;
    const auto& o = engine_.options();
    for (auto& t : inflight_) {
        if (t->finished()) continue;
        if (t->deadline_ns() > now) {
            nextDeadlineNs_ = std::min(nextDeadlineNs_, t->deadline_ns());
            still.push_back(std::move(t));
            continue;
        }
        Link* link = t->link();
        std::string why = "no completion from engine '" + link->peer->key + "' within " + seconds_text(o.timeout) +
                          " s (" + o.timeoutSetting + ")" + stall_locked(*t);
        link->peer->fail(why);  // before the transfer: its waiter may ask at once
        t->fail(kErrTransport, why);
        expired.emplace_back(link, why);
    }
    inflight_ = std::move(still);
    // The endpoints of a peer that stopped answering are closed: its operations in flight are
    // cancelled (no late bytes), and the owner connects anew.
    for (auto& [link, why] : expired)
        if (!link->eps.empty()) close_link_locked(*link, why);
}

std::string Worker::stall_locked(const Transfer& t) const {
    // Where the transfer stopped: messages whose UCX operation has not ended (a send, with
    // rendezvous until the target has the data; a read's incoming data), or messages done moving
    // their data that the target never answered.
    size_t open = 0, unsent = 0;
    for (const auto& [id, p] : parts_) {
        if (p->transfer.get() != &t || p->done) continue;
        ++open;
        if (p->ops > 0) ++unsent;
    }
    if (open == 0) return "";
    return "; " + std::to_string(open) + (open == 1 ? " message" : " messages") + " unanswered, " +
           (unsent == 0 ? std::string("every one sent")
                        : std::to_string(unsent) +
                              " not completed by UCX here (a rendezvous send completes once the "
                              "target has its data)");
}

Part& Worker::add_part_locked(std::unique_ptr<Part> part) {
    part->id = nextPart_++;
    Part& p = *part;
    parts_.emplace(p.id, std::move(part));
    return p;
}

Part* Worker::find_part_locked(uint64_t id) {
    auto it = parts_.find(id);
    return it == parts_.end() ? nullptr : it->second.get();
}

void Worker::retire_part_locked(Part& part) {
    if (part.done && part.ops == 0) parts_.erase(part.id);
}

void Worker::fail_parts_locked(const Link* link, int code, const std::string& why) {
    // Parts are only marked here: the caller may be inside a callback of one of them. Those with
    // no UCX operation left go at the next sweep.
    for (auto& [id, p] : parts_)
        if (p->link == link) p->finish(code, why);
    sweep_ = true;
}

void Worker::sweep_parts_locked() {
    sweep_ = false;
    for (auto it = parts_.begin(); it != parts_.end();)
        it = it->second->done && it->second->ops == 0 ? parts_.erase(it) : std::next(it);
    reap_links_locked();
}

}  // namespace mori::ucx
