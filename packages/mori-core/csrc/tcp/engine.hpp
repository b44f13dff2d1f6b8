// mori-core's native TCP data plane: a Target serves registered memory to authenticated peers; a
// Peer holds several connections to one Target and runs transfers (batches striped over them).
// Timeout messages name the caller's setting for the I/O timeout (timeoutSetting).
// No Python here: the bindings (tcp/bindings.cpp) release the GIL around every blocking call.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "base/completion.hpp"
#include "base/inbound.hpp"
#include "base/regions.hpp"
#include "base/tickets.hpp"
#include "base/trace.hpp"
#include "batch/batch.hpp"
#include "gpu/staging.hpp"
#include "tcp/staged.hpp"
#include "tcp/wire.hpp"

namespace mori::tcp {

class InitConn;

// Outcome of one transfer (all its blocks, on any connection): the kit's completion slot, whose
// waiter leads its connection's replies.
class Transfer : public CompletionSlot {
public:
    Transfer(int64_t blocks, bool notify, uint64_t uid) : CompletionSlot(blocks), notify_(notify), uid_(uid) {}
    // True when finished. When all blocks went over one connection the waiting thread reads the
    // replies itself (no hand-off from the receiver thread); otherwise it sleeps until woken.
    bool wait(double timeoutSec);
    void set_conn(std::weak_ptr<InitConn> conn) { conn_ = std::move(conn); }
    // Accounts n finished blocks; the first error wins. True when this call finished the last block.
    bool complete_blocks(int64_t n, int code, const std::string& msg) { return account(n, code, msg); }
    // Publishes the final code and wakes waiters (after the notify, if any, is queued).
    void finish() {
        auto [code, msg] = outcome();
        trace::mark('F', code);
        publish(code, msg);
    }
    int final_code() const { return outcome().first; }
    bool notify() const { return notify_; }
    uint64_t uid() const { return uid_; }

private:
    bool notify_;
    uint64_t uid_;
    std::weak_ptr<InitConn> conn_;
};

// Blocks of one transfer assigned to one connection, in send order: rows (local address, offset
// in the remote region, bytes); a notify frame is one row (0, status code, 0).
struct Work {
    std::shared_ptr<Transfer> transfer;
    uint8_t op;
    uint64_t memId;  // notify: uid
    std::vector<plan::Row> rows;
    std::shared_ptr<gpu::Stager> stager;  // local addresses are GPU memory, staged through it (tcp/staged.hpp)
    bool notify = false;                  // the whole transfer: its requests carry the notification (tcp/wire.hpp)
    size_t done = 0;                      // blocks answered (guarded by the connection's mutex)
};

// One initiator-side connection: a sender thread writes request frames; replies (in order) are
// read by whichever thread owns the receive side: a thread waiting in Transfer::wait when it can
// take it (leader/follower), otherwise the receiver thread, which steps in when data arrives.
// The reader's buffer is empty whenever the receive side is free, so polling the socket tells
// whether replies are waiting. The receiver thread sleeps in an epoll set of its own, which a
// leading waiter mutes while it reads: the replies it reads then wake no one (a wake-up per
// transfer costs a small one's latency several microseconds on a shared core).
class InitConn {
public:
    // Reads replies on the caller's thread until t finishes or deadlineNs passes. False when the
    // receive side was taken (or the connection is down): then the caller waits for t instead.
    bool lead(const Transfer& t, int64_t deadlineNs);
    InitConn(int fd, std::string peerName, double ioTimeout, std::string timeoutSetting);
    ~InitConn();
    void enqueue(std::shared_ptr<Work> work);
    void enqueue_notify(uint64_t uid, int code);
    bool broken() const;
    bool idle() const;  // nothing queued, being sent or awaiting a reply
    void close();

private:
    void send_loop();
    // Claims the send side for w (appending it to pending_); false when broken. Holds mu_.
    bool claim_locked(const std::shared_ptr<Work>& w);
    void release_send(const std::string& err);
    void recv_loop();
    // Owning the receive side: read and complete one reply frame; "" or an error text.
    std::string read_reply();
    std::string read_reply_frame();  // read_reply without settling on errors
    bool claim_recv();
    void release_recv(const std::string& err);
    // Holding mu_: stops (mute) or resumes the receiver thread's watch on the socket.
    void mute_locked(bool mute);
    // The receiver thread's sleep until replies may wait unread (or the socket failed); "" or
    // an error text.
    std::string watch_replies(const AbortCheck& check);
    std::string send_work(const Work& w);
    std::string send_staged_work(const Work& w);  // send_work for local GPU memory
    // A read reply's data for row idx of w into local GPU memory: received into staged memory
    // whose copies to the device run while the next replies are read; "" or the socket's error.
    std::string read_staged(const std::shared_ptr<Work>& w, size_t idx, const AbortCheck& check);
    // Completes the blocks of the staged reads received so far once their copies ended (a failed
    // copy fails its block): waiting for them all, or (wait false) those at the front whose
    // copies have ended. Whoever holds the receive side settles before the socket has nothing
    // more to read, so no block waits on a thread that stopped reading.
    void settle_reads(bool wait = true);
    void settle_oldest_read();  // waits for the oldest one's copies
    void mark_broken(const std::string& reason);
    static void fail_rest(std::vector<std::pair<std::shared_ptr<Work>, size_t>>& failed, const std::string& why);
    std::string abort_check(const Reader& rd);

    int fd_;
    std::string peer_;
    double ioTimeout_;
    std::string timeoutSetting_;
    mutable std::mutex mu_;
    std::condition_variable cv_;    // send side and shutdown
    std::condition_variable rxCv_;  // receive side handed back
    std::deque<std::shared_ptr<Work>> sendq_;
    std::deque<std::shared_ptr<Work>> pending_;
    int64_t pendingSinceNs_ = 0;
    std::string broken_;
    bool stop_ = false;
    bool sending_ = false;      // one thread owns the socket's send side at a time
    bool receiving_ = false;    // and one its receive side
    bool recvWaiting_ = false;  // the receiver thread waits for the receive side
    bool muted_ = false;        // a leader reads: the socket is out of watchFd_'s interest
    int watchFd_ = -1;          // the receiver thread's epoll set: the socket
    Reader rd_;
    // Staged reads received, their blocks answered but not completed until their copies ended
    // (settle_reads): owned by whoever holds the receive side.
    struct PendingRead {
        std::shared_ptr<Work> work;
        size_t idx;
        DeviceSink sink;
    };
    LandingRun landing_;  // small staged reads received in a row share a scattered copy
    std::deque<PendingRead> pendingReads_;
    std::thread sender_, receiver_;
};

// Connections from this engine to one target engine.
class Peer {
public:
    // Connects nconn data connections and authenticates with the token and a ticket from the
    // target's control plane; throws std::runtime_error on failure (message starts with
    // "rejected:" when the target refused the token or ticket).
    Peer(const std::string& name, const std::string& host, int port, int nconn, const std::string& myKey,
         const std::string& token, const std::string& ticket, double ioTimeout, const std::string& timeoutSetting);
    ~Peer();
    // Starts moving a batch of rows (local address, offset in region memId, bytes): op is
    // kOpRead or kOpWrite; rows are cut at `stripe` bytes (at least 4096) and dealt over the
    // connections; uid names the transfer at the target, which records it when notify is set.
    // With a stager the local addresses are GPU memory, staged through it (tcp/staged.hpp).
    std::shared_ptr<Transfer> submit(uint8_t op, const plan::Batch& batch, uint64_t memId, uint64_t uid, bool notify,
                                     uint64_t stripe, std::shared_ptr<gpu::Stager> stager = nullptr);
    bool healthy() const;
    void close();

private:
    std::string name_;
    std::vector<std::shared_ptr<InitConn>> conns_;  // shared: a waiting Transfer may lead one
    std::atomic<uint64_t> next_{0};
};

// What one Target lets its peers consume (the transport fills it from its own settings).
struct TargetLimits {
    size_t maxConnections = 1024;  // open data connections, handshaking or serving
    size_t maxHandshakes = 64;     // connections not yet through their hello; the oldest is dropped
    double helloTimeout = 10.0;    // seconds from accept to a complete hello
    size_t maxInbound = 1 << 20;   // completion records kept for pop_inbound (a table of its own); the
    double inboundTtl = 3600.0;    // oldest is dropped; seconds a completion record is kept
    size_t maxTickets = 4096;      // data-plane tickets outstanding (one per key); the oldest is dropped
    double ticketTtl = 60.0;       // seconds a ticket admits connections (renewed when issued again)
    uint32_t ticketUses = 64;      // connections a ticket admits (renewed when issued again)
    size_t maxPerKey = 64;         // admitted connections of one engine key; its oldest is dropped
};

// Counters of what the limits turned away (for logs, tests and benchmarks).
struct TargetStats {
    uint64_t refused = 0;         // connections closed at accept: maxConnections reached
    uint64_t evicted = 0;         // handshaking connections dropped for newer ones
    uint64_t acceptErrors = 0;    // accept() or thread creation failed (fd or thread exhaustion)
    uint64_t inboundDropped = 0;  // completion records dropped (count or age)
    uint64_t badTickets = 0;      // hellos with a wrong token or ticket
    uint64_t idleEvicted = 0;     // admitted connections dropped: over maxPerKey, or idle while fds ran out
    uint64_t cut = 0;             // connections cut because a deregistration outwaited the I/O timeout
};

// The serving side: accepts data connections and answers requests against registered regions.
// A connection is admitted by a hello carrying the auth token and a ticket that the control
// plane issued to the same engine key (issue_ticket, base/tickets.hpp), so a key cannot be
// claimed on the data plane alone.
class Target {
public:
    // inbound: the completion-record table to write (shared with the caller's other channels);
    // null: one of its own, bounded by limits.maxInbound and limits.inboundTtl.
    Target(const std::string& host, int port, std::string token, double ioTimeout, TargetLimits limits,
           std::string timeoutSetting, std::shared_ptr<InboundRecords> inbound = nullptr);
    ~Target();
    int port() const { return port_; }
    // With a stager the region is GPU memory, staged through it (tcp/staged.hpp).
    void register_region(uint64_t id, uint64_t addr, uint64_t size, std::shared_ptr<gpu::Stager> stager = nullptr);
    // Stops serving the region at once (new requests get ERR_NOT_FOUND; other regions are not
    // held up). Waits up to the I/O timeout for requests being served on it, then cuts the
    // connections still touching it (the region table's rule, base/regions.hpp): once it returns
    // no byte of the region is read or written. False when no such region was registered; throws
    // std::runtime_error when a cut request still holds it after the grace.
    bool deregister_region(uint64_t id);
    // Lets key open connections presenting its ticket (ticketUses of them, within ticketTtl
    // seconds of the last issue): the one the caller picked (1..kMaxTicketLen bytes), else the
    // key's own, drawn here when it holds none. Returns the ticket.
    std::string issue_ticket(const std::string& key, const std::optional<std::string>& ticket = std::nullopt);
    std::optional<int> pop_inbound(const std::string& key, uint64_t uid);
    size_t connection_count();
    size_t inbound_count();
    TargetStats stats();
    void close();

private:
    // A registered region; requests being served on it pin it.
    struct Region : mori::Region {
        std::shared_ptr<gpu::Stager> stager;  // GPU memory: staged through it
    };
    enum ConnState : int { kHandshaking = 0, kServing = 1, kEvicted = 2 };
    struct Conn {
        int fd;
        std::thread thread;
        std::atomic<bool> done{false};
        std::atomic<int> state{kHandshaking};
        int64_t acceptNs = 0;
        std::string key;                      // once admitted (set under connsMu_)
        std::atomic<int64_t> idleSinceNs{0};  // waiting for a request since; 0 while serving one
        // The regions its requests hold now (several: staged writes until their copies end, staged
        // reads served ahead), which deregistration cuts it for once the I/O timeout has passed.
        std::mutex usesMu;
        std::vector<const Region*> uses;
        bool holds(const Region* r) {
            std::lock_guard lk(usesMu);
            return std::find(uses.begin(), uses.end(), r) != uses.end();
        }
    };
    // A request's hold on a region: memory stays valid (deregistration waits) while it lives.
    class RegionUse {
    public:
        RegionUse(Target& t, Conn* c) : t_(t), c_(c) {}
        ~RegionUse() { release(); }
        // Checks the block against the region table and holds its region (kSuccess, addr set);
        // the code and reason of the refusal otherwise.
        int acquire(const RequestEntry& block, uint64_t& addr, uint64_t& reason);
        void release();
        gpu::Stager* stager() const { return region_ ? region_->stager.get() : nullptr; }  // GPU memory's

    private:
        Target& t_;
        Conn* c_;
        Pinned<Region> region_;
    };
    void accept_loop();
    // Takes one connection off the listen queue; false when accept failed (fd exhaustion...).
    bool admit();
    // Drops the oldest connection still in its hello; connsMu_ held. False when there is none.
    bool evict_oldest_handshake_locked();
    // Out of descriptors with no handshake to drop: drops the admitted connection idle longest,
    // if it has been idle for helloTimeout at least; connsMu_ held.
    bool evict_idlest_locked();
    // Admits conn under key; past maxPerKey connections of that key its oldest is dropped.
    void bind_key(Conn* conn, const std::string& key);
    void drop_locked(Conn& c);  // shuts a connection down; its thread ends and is reaped
    // Serves conn: its hello, then its requests (a Session) until it ends.
    void serve(Conn* conn);
    class Session;
    bool handshake(Conn* conn, Reader& rd, std::string& peerKey);
    // Cuts the connections whose request touches region r; the count of them.
    size_t cut_users(const Region* r);
    void reap(bool all);
    // Keeps the final status of transfer uid from peerKey for pop_inbound.
    void record_inbound(const std::string& peerKey, uint64_t uid, int code);

    int listenFd_ = -1;
    int port_ = 0;
    std::string token_;
    double ioTimeout_;
    TargetLimits limits_;
    std::string timeoutSetting_;
    std::atomic<bool> stop_{false};
    std::thread acceptThread_;
    RegionTable<Region> regions_;
    std::shared_ptr<InboundRecords> inbound_;
    TicketTable<std::string> tickets_;
    std::mutex connsMu_;
    std::list<Conn> conns_;
    std::mutex statsMu_;
    TargetStats stats_;
};

}  // namespace mori::tcp
