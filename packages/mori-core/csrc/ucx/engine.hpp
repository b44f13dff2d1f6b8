// mori-core's UCX engine: one UCX context, its workers (each driven by a native progress thread
// and by callers waiting on their transfers), registered memory, endpoints to peer engines, and
// transfers (batches of blocks between local and remote registered memory) posted in one call.
//
// Two data paths, chosen per engine (EngineOptions::rma):
// - checked (the default): blocks travel as UCX active messages whose header names (remote
//   memory id, offset, size); the target checks each against its live registrations before a
//   byte of its memory is touched, then UCX moves the bytes (eager copies for small blocks,
//   zero-copy rendezvous for large ones: cma on one host, tcp across hosts). This is the only
//   safe path on transports where UCX does not enforce remote keys (tcp, sm, cma).
// - RMA: one-sided puts and gets with remote keys the target sent (never keys from a descriptor),
//   completed by a flush of each endpoint. For transports whose hardware enforces remote keys
//   (InfiniBand/RoCE verbs).
//
// Peers authenticate with tickets: the target issues a 64-bit secret to each peer engine through
// the owner's authenticated control plane (admit), and every request carries it. Nothing here
// calls Python; the bindings (ucx/bindings.cpp) release the GIL around every call that can block.
#pragma once

#include <sched.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/completion.hpp"
#include "base/inbound.hpp"
#include "base/ops.hpp"
#include "base/regions.hpp"
#include "base/tickets.hpp"
#include "base/transfer.hpp"
#include "batch/batch.hpp"
#include "same_host/ring.hpp"
#include "ucx/api.hpp"
#include "ucx/gpu.hpp"
#include "ucx/lib.hpp"
#include "ucx/store_log.hpp"

namespace mori::ucx {

// The most eager_bytes may be: an eager message is held whole at the target before it is served.
inline constexpr uint64_t kMaxEagerBytes = 256 << 10;

struct EngineOptions {
    std::string name = "mori";
    std::vector<std::pair<std::string, std::string>> settings;  // UCX settings (TLS, NET_DEVICES, ...)
    int workers = 1;                                            // UCX workers, each with its progress thread
    int lanes = 1;           // endpoints per peer on each worker; a transfer's blocks are dealt over them
    bool roundRobin = true;  // transfers start on the workers in turn; false: on the first (Peer::submit)
    bool polling = true;     // progress threads spin briefly after activity (POLLING) or only sleep (EVENT)
    // Once a caller that led a worker is done, its progress thread sleeps at once (the caller polls
    // again for its next transfer), or, false, polls as after any activity (a caller that waits
    // elsewhere next, as a shmem PE on a signal, leaves the peer's next message to that thread).
    bool standAside = true;
    double timeout = 30.0;                    // seconds before an unfinished transfer fails
    std::string timeoutSetting = "timeout";   // the caller's name for it, in messages
    bool rma = false;                         // the RMA data path (see above)
    size_t maxInbound = 1 << 20;              // notification records kept (a table of its own)
    double inboundTtl = 3600.0;               // seconds a notification record is kept (a table of its own)
    std::shared_ptr<InboundRecords> inbound;  // the table to write, shared with the caller; null: its own
    size_t maxTickets = 1 << 16;              // peer engines admitted at once; the oldest is dropped
    bool sameHost = true;                     // the same-host path (same_host/ring.hpp) for peers that offer it
    // On it, small transfers copied by the initiator itself (same_host/window.hpp): this engine's
    // as initiator, and its regions offered to its peers' as target.
    bool sameHostDirect = true;
    std::string hostKey;  // this process's host identity (mori.core.host): machine/netns
    // MORI's send queue: operations (rows) in flight from one worker to one peer, at most this
    // many (0: no bound). A transfer that finds no room waits up to sendQueueWait seconds in the
    // call that starts it, then fails "SQ full" (SendQueue).
    uint64_t sendQueue = 0;
    double sendQueueWait = 5.0;
};

// Counters of what the engine refused (for logs, tests and benchmarks).
struct EngineStats {
    uint64_t badTickets = 0;   // messages carrying no valid ticket: dropped unread (the ticket table's count)
    uint64_t refused = 0;      // requests refused by the region checks
    uint64_t malformed = 0;    // messages of the wrong shape: dropped
    uint64_t lateReplies = 0;  // replies for a transfer that had already ended
    uint64_t spread = 0;       // transfers this initiator dealt over several workers (Peer::spread)
};

// Memory registered with the engine (in its region table, base/regions.hpp): accesses in flight
// hold a pin; deregistration waits for them.
struct Region : mori::Region {
    api::MemHandle* memh = nullptr;
    std::string rkey;                                                            // packed remote key (RMA path)
    int memType() const { return gpu() ? api::kMemoryCuda : api::kMemoryHost; }  // UCX's name for kind
};

class Engine;
class Worker;
struct Part;

// What a peer engine's endpoints share: its key, the ticket it issued to us, and whether it failed.
struct PeerState {
    PeerState(std::string k, uint64_t t) : key(std::move(k)), ticket(t) {}
    const std::string key;
    const uint64_t ticket;
    void fail(const std::string& why) {
        std::lock_guard lk(mu);
        if (failed.empty()) failed = why;
    }
    std::string failure() const {
        std::lock_guard lk(mu);
        return failed;
    }

private:
    mutable std::mutex mu;
    std::string failed;
};

// What the target told us about one of its regions (the RMA path's keys unpacked per endpoint).
struct RemoteRegion {
    uint64_t addr = 0, size = 0;
    int memType = api::kMemoryHost;
    std::vector<api::RemoteKey*> keys;  // per lane
};

// Endpoints from one worker to one peer engine (one per lane). Owned by the worker: freed once
// closed, its Peer has let go (held) and no operation in flight refers to it.
struct Link {
    std::shared_ptr<PeerState> peer;
    Worker* worker = nullptr;
    std::vector<api::Endpoint*> eps;
    std::unordered_map<uint64_t, RemoteRegion> regions;  // remote memory id -> what its target said
    std::string failed;                                  // why the endpoints failed or closed ("" while usable)
    uint64_t next = 0;                                   // rotates the first lane of successive transfers
    bool held = true;  // its Peer refers to it: not freed before the Peer closes (even once failed)
};

// Room in MORI's send queue from one worker to one peer (EngineOptions::sendQueue): a transfer
// holds as many operations as it has rows (at most the whole queue) until it finishes.
struct SendQueue {
    std::atomic<uint64_t> used{0};
    // Takes need operations of a queue of depth; false when there is no room.
    bool take(uint64_t need, uint64_t depth) {
        uint64_t u = used.load(std::memory_order_relaxed);
        while (u + need <= depth)
            if (used.compare_exchange_weak(u, u + need, std::memory_order_acq_rel)) return true;
        return false;
    }
    void give(uint64_t n) { used.fetch_sub(n, std::memory_order_acq_rel); }
};

// The outcome of one transfer: the kit's completion slot (base/completion.hpp), read without
// running any code per block (code() is one atomic load), as the TCP data plane's.
class Transfer : public CompletionSlot {
public:
    Transfer(std::shared_ptr<Worker> worker, Link* link, int64_t parts, int64_t deadlineNs, bool notify, uint64_t uid);
    // True when finished within timeout seconds. A waiter whose worker is free progresses it
    // itself (a small transfer then costs no thread hand-off).
    bool wait(double timeoutSec);
    // Accounts one finished part; the first error wins. Worker lock held, of via's worker when
    // given (a spread transfer's note then leaves on via: its own link_ is null).
    void part_done(int code, const std::string& msg, Link* via = nullptr);
    // Fails the whole transfer now (deadline, peer failure); later part results are ignored.
    // Worker lock held.
    void fail(int code, const std::string& msg);
    int64_t deadline_ns() const { return deadlineNs_; }
    Link* link() const { return link_; }  // valid while unfinished
    // The transfer travels on the same-host path: its waiter reads that link, its notification
    // goes there. Set before it is posted.
    void carried_by(std::shared_ptr<SameHostLink> link, int64_t spinNs) {
        sameHost_ = std::move(link);
        spinNs_ = spinNs;
    }
    // Gives back ops operations of queue when the transfer finishes (at once if it has).
    void holds(std::shared_ptr<SendQueue> queue, uint64_t ops);
    // A transfer spread over several workers (Peer::spread) is the parent of one transfer per
    // worker: each reports its outcome to it as a part. Set before the child is posted.
    void reports_to(std::shared_ptr<Transfer> parent) { parent_ = std::move(parent); }
    void spread_over(std::vector<std::weak_ptr<Transfer>> children) { children_ = std::move(children); }

private:
    void finish(int code, const std::string& msg, Link* via = nullptr);  // worker lock held
    std::weak_ptr<Worker> worker_;
    std::shared_ptr<SameHostLink> sameHost_;
    int64_t spinNs_ = 0;                // how long its waiter polls the same-host link
    std::shared_ptr<SendQueue> queue_;  // the send-queue room it holds (holds), given back at finish
    uint64_t queueOps_ = 0;
    std::shared_ptr<Transfer> parent_;               // the spread transfer it is a part of
    std::vector<std::weak_ptr<Transfer>> children_;  // its parts on each worker, when spread
    Link* link_;
    const bool onWorker_;  // posted on a worker (not failed before): it finishes under that worker's lock
    int64_t deadlineNs_;
    bool notify_;
    uint64_t uid_;
};

// The one transfer that every transfer finishing successfully as it starts reports through (the
// same-host path's direct copies): nothing of it is its own, so its caller needs no object of its own.
const std::shared_ptr<Transfer>& finished_transfer();

// A peer engine as this engine's initiator sees it: the endpoints to it on each of our workers.
class Peer {
public:
    Peer(std::shared_ptr<Engine> engine, std::shared_ptr<PeerState> state, std::vector<Link*> links,
         std::shared_ptr<SameHostLink> sameHost, std::string sameHostRefusal, bool stagesGpu = false);
    ~Peer();
    const std::string& key() const { return state_->key; }
    // Starts a transfer of a batch of rows (local address, remote offset, bytes; merged already):
    // every row must lie in local memory localId (checked here). remoteGpu says the remote memory
    // is GPU memory (it then travels by rendezvous only).
    std::shared_ptr<Transfer> submit(Op op, uint64_t localId, const plan::Batch& batch, uint64_t remoteId, uint64_t uid,
                                     bool notify, bool remoteGpu);
    // The same for blocks given as offsets into local memory localId and remote memory remoteId
    // (merged here; C++ callers such as the device proxy).
    std::shared_ptr<Transfer> submit(Op op, uint64_t localId, const uint64_t* localOffs, uint64_t remoteId,
                                     const uint64_t* remoteOffs, const uint64_t* sizes, size_t n, uint64_t uid,
                                     bool notify, bool remoteGpu);
    // submit of one block (local address src, remote offset dst), then wait(timeout): for a caller
    // that waits at once (UcxPeer.run_one, the heap window: mori.shmem's host puts and gets).
    std::shared_ptr<Transfer> run_one(Op op, uint64_t localId, uint64_t src, uint64_t dst, uint64_t bytes,
                                      uint64_t remoteId, bool remoteGpu, double timeout) {
        std::shared_ptr<Transfer> t =
            submit(op, localId, plan::Batch::one(src, dst, bytes), remoteId, 0, false, remoteGpu);
        t->wait(timeout);
        return t;
    }
    bool healthy() const;
    std::string failure() const { return state_->failure(); }
    // Whether host-memory transfers take the same-host path; else why the peer refused it ("" when
    // it did not offer it: another host, or the path is off on either side).
    bool same_host() const { return sameHost_ != nullptr; }
    const std::string& same_host_refusal() const { return sameHostRefusal_; }
    // On the same-host path, how its transfers move: "direct" when this process copies small
    // ones itself, else "served: " and why (the target's thread copies every one); "" off it.
    std::string same_host_path() const;
    // The endpoints to the peer on worker i (owned by that worker: use them under its lock).
    Link* link(size_t worker) const { return links_.at(worker); }
    // UCX's description of the endpoints (transports and devices of each lane).
    std::string describe();
    // Fails the peer: its transfers in flight end with why, its endpoints close.
    void fail(const std::string& why);
    void close();

private:
    // Deals rows over worker w's lanes and posts them (local pinned by the caller).
    std::shared_ptr<Transfer> post(size_t w, Op op, const std::shared_ptr<Region>& local, const plan::Row* rows,
                                   size_t n, uint64_t largest, uint64_t remoteId, uint64_t uid, bool notify,
                                   bool remoteGpu, const std::shared_ptr<Transfer>& parent = nullptr);
    // A batch of at least two shares (kSpreadPiece) dealt over several workers (each a thread
    // of its own at both ends), one child transfer each, under one parent; null when the engine
    // has one worker or the batch is smaller.
    std::shared_ptr<Transfer> spread(size_t w, Op op, const std::shared_ptr<Region>& local, const plan::Batch& batch,
                                     uint64_t remoteId, uint64_t uid, bool notify, bool remoteGpu);
    // A transfer failed now with code and why (it was never posted).
    std::shared_ptr<Transfer> failed(size_t w, uint64_t uid, int code, const std::string& why,
                                     const std::shared_ptr<Transfer>& parent = nullptr);
    std::string closed_why() const;  // why a failed or closed peer takes no transfer
    std::shared_ptr<Engine> engine_;
    std::shared_ptr<PeerState> state_;
    std::vector<Link*> links_;                        // per worker
    std::vector<std::shared_ptr<SendQueue>> queues_;  // per worker
    std::shared_ptr<SameHostLink> sameHost_;
    std::string sameHostRefusal_;
    const bool stagesGpu_;  // the peer stages its GPU memory: small staged writes into it go eager
    std::atomic<uint64_t> next_{0};
    std::atomic<bool> closed_{false};
};

// One UCX worker and its progress thread.
class Worker : public std::enable_shared_from_this<Worker> {
public:
    Worker(Engine& engine, int index);
    ~Worker();
    void start();  // creates the UCX worker and its thread
    const std::string& address() const { return address_; }
    int index() const { return index_; }

    // Every UCX call on this worker holds its lock (the worker is created SERIALIZED). A thread
    // other than the progress thread (a caller posting, the device proxy sending) takes it here:
    // announced first, so that the progress thread, which retakes it between its polls, stands
    // aside until this thread has it (a device put's send waited 13 us for it behind the polls);
    // tried a while before sleeping on it, since a sleeper wakes several microseconds late and
    // the lock is seldom held that long.
    std::unique_lock<std::mutex> claim();
    bool alive() const { return w_ != nullptr; }
    // Progresses once and runs what callbacks deferred; lock held. Returns UCX's event count.
    unsigned progress_locked();
    // Progresses on the caller's thread until done() or spinNs pass; false when destroyed.
    template <typename Done>
    bool lead(Done&& done, int64_t spinNs);
    void wake();  // wakes the progress thread if it sleeps

    // Initiator side (lock held).
    Link* connect_locked(const std::shared_ptr<PeerState>& peer, const std::string& address, int lanes);
    void close_link_locked(Link& link, const std::string& why);
    // A UCX operation on link failed: the peer is failed, its parts fail, its endpoints close.
    void link_failed_locked(Link& link, const std::string& why);
    void track_locked(const std::shared_ptr<Transfer>& t);
    Part& add_part_locked(std::unique_ptr<Part> part);
    void retire_part_locked(Part& part);  // its outcome is known and its last UCX operation called back
    Part* find_part_locked(uint64_t id);
    void fail_parts_locked(const Link* link, int code, const std::string& why);
    // The target's description of its region id (one round trip on the caller's thread, then
    // cached on the link); throws std::runtime_error.
    RemoteRegion& remote_region_locked(Link& link, uint64_t id);
    // Staged bytes being copied on the GPU (started with wait false, ucx/gpu.hpp): then runs, under
    // the lock, once the copy ended ("") or failed (why), from a later progress; the progress
    // thread polls while any is pending. Lock held; staged lives until then runs.
    void after_copy_locked(Staged& staged, std::function<void(const std::string& error)> then);

    Engine& engine() { return engine_; }
    api::Worker* handle() { return w_; }
    size_t max_header() const { return maxHeader_; }
    void stop();     // ends the progress thread
    void destroy();  // fails what is in flight, closes every link, destroys the UCX worker

private:
    void run();
    void expire_locked(int64_t now);
    std::string stall_locked(const Transfer& t) const;  // where an expired transfer stopped, for its message
    void reap_links_locked();
    void sweep_parts_locked();        // frees failed parts whose UCX operations all called back
    unsigned finish_copies_locked();  // runs what follows the copies that ended; their count
    static void on_ep_error(void* arg, api::Endpoint* ep, api::Status status);

    Engine& engine_;
    int index_;
    api::Worker* w_ = nullptr;
    std::string address_;
    size_t maxHeader_ = 0;
    int efd_ = -1, wakeFd_ = -1, epollFd_ = -1;
    std::mutex mu_;
    std::thread thread_;
    std::atomic<bool> stop_{false};
    std::atomic<bool> sleeping_{false};
    std::atomic<int> leaders_{0};  // callers progressing this worker now
    std::atomic<int> claims_{0};   // threads about to take mu_ (claim): the progress thread waits
    // While callers lead, the worker's event descriptor is out of the progress thread's epoll set
    // (mute): the events they progress themselves wake no one. Changed under mu_.
    std::atomic<bool> muted_{false};
    void mute_locked(bool mute);
    void hand_back_locked();  // the last leader leaves: the worker armed and unmuted
    std::unordered_map<uint64_t, std::unique_ptr<Part>> parts_;
    uint64_t nextPart_ = 1;
    std::vector<std::unique_ptr<Link>> links_;
    std::vector<std::shared_ptr<Transfer>> inflight_;
    size_t pruneAt_ = 64;  // inflight_'s length at which finished transfers are next dropped
    int64_t nextDeadlineNs_ = INT64_MAX;
    std::vector<Link*> failedLinks_;  // endpoint errors seen in callbacks, closed after progress
    std::vector<void*> closing_;      // endpoint close requests still running
    bool sweep_ = false;              // parts failed: sweep them after progress
    struct CopyWait {
        Staged* staged;
        std::function<void(const std::string&)> then;
    };
    std::deque<CopyWait> copies_;     // in the order started: copies on one stream end in it
    std::atomic<size_t> copying_{0};  // copies_.size(), read by the progress thread unlocked
};

class Engine : public std::enable_shared_from_this<Engine> {
public:
    explicit Engine(EngineOptions opts);
    ~Engine();
    const EngineOptions& options() const { return opts_; }
    std::vector<std::string> addresses() const;
    // Registers [addr, addr + size) as memory id; returns the packed remote key.
    std::string register_region(uint64_t id, uint64_t addr, uint64_t size, bool cuda);
    // Refuses new accesses to id at once, then waits up to the timeout for those in flight (the
    // region table's rule, base/regions.hpp; they end by themselves, failed at the timeout).
    // False when id is unknown; throws when accesses are still running after it.
    bool deregister_region(uint64_t id);
    std::shared_ptr<Region> region(uint64_t id) const { return regions_.find(id); }
    // The region with one more pin (the caller drops it with unpin()), or null; a deregistration
    // that has begun refuses it.
    std::shared_ptr<Region> pin_region(uint64_t id) const { return regions_.pin(id); }
    // The check of an incoming block (RegionTable::acquire): its region pinned, or null with why.
    std::shared_ptr<Region> acquire(const RequestEntry& e, uint32_t& reason) const {
        return regions_.acquire(e.memId, e.offset, e.size, reason);
    }
    // The ticket engine key presents in its requests (one per key, kept until dropped).
    uint64_t admit(const std::string& key) { return tickets_.issue(key); }
    // Where every message's ticket is checked (base/tickets.hpp): admit(ticket) is the key it
    // admits, or "" (counted in stats' badTickets).
    TicketTable<uint64_t>& tickets() { return tickets_; }
    // Endpoints to the engine whose workers have these addresses, presenting its ticket.
    // sameHost: the peer's same_host_address() ("" for none); used when it names this host.
    // stagesGpu: the peer stages its GPU memory (ucx/gpu.hpp), so a write from GPU memory this
    // engine stages, below kRndvWriteBytes, goes to it as host memory would (eager for small
    // ones) instead of by rendezvous, which GPU memory left to UCX needs.
    std::shared_ptr<Peer> connect(const std::string& key, const std::vector<std::string>& addresses, uint64_t ticket,
                                  const std::string& sameHost = "", bool stagesGpu = false);
    // What same-host peers connect with ("" when the path is off).
    std::string same_host_address() const;
    SameHostService* same_host() { return sameHost_.get(); }
    void fail_peer(const std::string& key, const std::string& why);
    std::optional<int> pop_inbound(const std::string& key, uint64_t uid) { return inbound_->pop_code(key, uid); }
    size_t inbound_count() { return inbound_->count(); }
    void record_inbound(const std::string& key, uint64_t uid, int code) { inbound_->record(key, uid, code); }
    EngineStats stats() const;
    void count(uint64_t EngineStats::* field);
    // Transports UCX found for this context (ucp_context_print_info).
    std::string describe() const;
    bool cuda_supported() const { return cuda_; }
    // Host-memory messages smaller than this go eager: a write's request with its bytes, a read's
    // reply; and blocks smaller than this are grouped (ucx/post.cpp). For an engine whose
    // transports would move them by rendezvous over tcp (a handshake, one round trip more than
    // the bytes need); 0 (the default) leaves the choice to UCX. At most kMaxEagerBytes
    // (std::invalid_argument beyond).
    void set_eager_bytes(uint64_t n);
    uint64_t eager_bytes() const { return eagerBytes_.load(std::memory_order_relaxed); }
    // The UCX settings this engine's context was made with: the caller's, then the defaults the
    // engine added (ucx/engine.cpp), as (name, value).
    const std::vector<std::pair<std::string, std::string>>& settings() const { return settings_; }
    // How remote atomics and signal puts reach this engine's GPU regions (ucx/gpu.hpp); without
    // it they are refused (kReasonGpu).
    void set_gpu_words(std::shared_ptr<GpuWords> g) {
        std::lock_guard lk(gpuMu_);
        gpu_ = std::move(g);
        gpuEpoch_.fetch_add(1, std::memory_order_release);
    }
    std::shared_ptr<GpuWords> gpu_words() const {
        std::lock_guard lk(gpuMu_);
        return gpu_;
    }
    // The words this engine's handlers wrote (ucx/store_log.hpp).
    StoreLog& stores() { return stores_; }
    // Makes the CUDA context of set_gpu_words (mori's own, ucx/gpu.hpp) current on the calling
    // thread, once per thread and setting (`seen`: the thread's own record, 0 at its start). The
    // engine's own threads (progress threads, the device proxy) call it before they drive UCX, so
    // that any CUDA call they make is in that context (UCX's CUDA transports, where GPU memory is
    // left to them, act in the calling thread's current context).
    void apply_cuda_context(uint64_t& seen) const;
    bool closed() const { return closed_.load(); }
    Worker& worker(size_t i) { return *workers_[i]; }
    std::shared_ptr<Worker> worker_ptr(size_t i) { return workers_[i]; }
    size_t worker_count() const { return workers_.size(); }
    api::Context* context() { return ctx_; }
    void close();

private:
    // Applies the caller's UCX settings, then the defaults the engine adds where neither the caller
    // nor the environment set them (both kept in settings_); the caller's, as text for messages.
    std::string configure(api::Config* cfg);
    void release_region(Region& r);
    EngineOptions opts_;
    api::Context* ctx_ = nullptr;
    bool cuda_ = false;
    std::atomic<uint64_t> eagerBytes_{0};
    std::vector<std::pair<std::string, std::string>> settings_;
    mutable std::mutex gpuMu_;
    std::shared_ptr<GpuWords> gpu_;
    std::atomic<uint64_t> gpuEpoch_{1};  // changes with every set_gpu_words
    StoreLog stores_;
    std::vector<std::shared_ptr<Worker>> workers_;
    std::unique_ptr<SameHostService> sameHost_;
    RegionTable<Region> regions_;
    TicketTable<uint64_t> tickets_;
    mutable std::mutex peersMu_;
    std::unordered_map<std::string, std::weak_ptr<Peer>> peers_;
    std::shared_ptr<InboundRecords> inbound_;
    mutable std::mutex statsMu_;
    EngineStats stats_;
    std::atomic<bool> closed_{false};
    uint64_t noteFeed_ = 0;  // the same-host notes' feed of inbound_ (0: none)
};

template <typename Done>
bool Worker::lead(Done&& done, int64_t spinNs) {
    // While a caller leads, the progress thread stands aside (see run): two threads polling one
    // worker only take turns on its lock and cores.
    leaders_.fetch_add(1, std::memory_order_acq_rel);
    bool alive;
    {
        std::unique_lock lk = claim();
        alive = w_ != nullptr;
        if (alive) mute_locked(true);
        const int64_t until = now_ns() + spinNs;
        while (alive && !done()) {
            if (progress_locked() != 0) continue;
            if (now_ns() > until) break;
            // Nothing yet: let other threads run (on one host the peer's progress thread may
            // need this core to answer; spinning without yielding made a 4 KiB read wait for
            // the whole spin).
            sched_yield();
        }
        if (alive && leaders_.load(std::memory_order_acquire) == 1) hand_back_locked();
    }
    leaders_.fetch_sub(1, std::memory_order_acq_rel);
    return alive;
}

}  // namespace mori::ucx
