// The UCX engine's same-host path: between two engines of one host (one kernel, one network
// namespace, one PID namespace) host memory moves with process_vm_readv/process_vm_writev:
// small transfers copied by the initiator itself, checked against the target's window of its
// registrations (same_host/window.hpp), the others by the target after it checked every block
// against its live registrations (this file).
//
// Each engine listens on an abstract Unix socket (SOCK_SEQPACKET: one message per send). An
// initiator's link connects, presents the ticket the target issued to it with its request ring
// (a sealed memfd passed with SCM_RIGHTS), and proves the path works: the target reads a nonce
// from the initiator's memory with process_vm_readv (the kernel names the initiator's pid:
// SO_PEERCRED). A refused probe (EPERM: ptrace rules, another user) leaves the peer on the UCX path.
//
// Requests travel through the ring, not the socket: the initiator writes a slot (per block the
// target's memory id, offset and size, and its own address) and marks it posted; the target
// copies the slot out of the shared memory, pins the regions, refuses anything outside a live
// registration before a byte moves, copies, writes the reply into the slot and marks it done.
// Neither side makes a system call for a request while the other polls: the socket carries only
// doorbells (a request for a target that went to sleep, completions for an initiator that is not
// polling), the notes of empty transfers, and the end of the connection. A peer that dies closes
// its socket: the other side sees it at once, at no cost to the copies.
//
// One thread per engine (SameHostService) serves the rings of its connections and reads its own
// links' doorbells, polling after activity; a caller waiting on its transfer polls its link's ring
// itself first. Nothing blocks on a peer that does not read: doorbells that find its socket full
// wait in an outbox that the service thread flushes. Nothing here calls Python.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "base/ops.hpp"
#include "base/request.hpp"
#include "batch/plan.hpp"

namespace mori::ucx {

class Engine;
class Transfer;
struct Region;
struct PeerState;
struct Link;

namespace same_host {

class Window;
class DirectPath;

constexpr uint32_t kMagic = 0x4d534830;  // "0HSM"
// kRequest/kReply name what a ring slot holds (and kNote a direct copy's notification, see window.hpp); kBell is a
// doorbell (either way).
enum Type : uint8_t { kHello = 1, kHelloReply = 2, kRequest = 3, kReply = 4, kNote = 5, kBell = 6 };
constexpr size_t kMaxEntries = 1024;  // IOV_MAX: one process_vm call per request
constexpr size_t kRingSlots = 32;     // requests in flight per link; a full ring makes the poster wait

#pragma pack(push, 1)
struct Hello {  // initiator -> target, first message, with the ring's memfd (SCM_RIGHTS)
    uint32_t magic;
    uint8_t type, pad[3];
    uint64_t ticket;
    uint64_t probe;     // address of nonce in the initiator's memory
    uint8_t nonce[16];  // what the target must read there
};
struct HelloReply {
    uint32_t magic;
    uint8_t type, pad[3];
    int32_t err;  // 0: the path works; else the errno of the target's probe
};
struct Request {  // in a ring slot, followed by count Entries
    uint32_t magic;
    uint8_t type, op;
    uint16_t count;
    uint32_t flags;  // kNotify, kLast
    uint64_t id;     // the initiator's, echoed in the reply
    uint64_t uid;    // the transfer's, for its notification
};
// Request::flags. A transfer that notifies marks each of its requests kNotify and its last one
// kLast: the target records the transfer's outcome (its first refusal, else success) once it has
// served that one, after every byte of the transfer (a connection's requests are served in order).
constexpr uint32_t kNotify = 1, kLast = 2;
constexpr size_t kMaxOpenNotes = 1 << 16;  // notifying transfers of one connection not finished yet
struct Entry {
    RequestEntry block;  // the target's memory: the one request entry, checked as every plane's
    uint64_t addr;       // the initiator's memory
};
struct Reply {
    uint32_t magic;
    uint8_t type, pad[3];
    int32_t code;
    uint32_t reason, entry;  // why a block was refused (base/reasons.hpp) and which
    int32_t err;             // errno of a failed copy
    uint32_t pad2;
    uint64_t id;
};
struct Note {  // the notification of a transfer that moved nothing (no request carried it)
    uint32_t magic;
    uint8_t type, pad[3];
    int32_t code;
    uint32_t pad2;
    uint64_t uid;
};
struct Bell {  // a doorbell: "look at the ring"
    uint32_t magic;
    uint8_t type, pad[3];
};
#pragma pack(pop)
static_assert(sizeof(Hello) == 40 && sizeof(HelloReply) == 12 && sizeof(Request) == 28 && sizeof(Entry) == 32 &&
                  sizeof(Reply) == 36 && sizeof(Note) == 24 && sizeof(Bell) == 8,
              "same-host wire layout");
constexpr size_t kMaxMessage = sizeof(Hello);  // the largest message on the socket

// The ring, in memory both processes map. Each side treats what the other wrote as untrusted:
// the target copies a slot out before it checks it, the initiator takes nothing from a reply but
// its code, reason, entry and errno.
// The initiator posts a free slot; the target claims it (kServing) before it copies, then marks it
// done; the initiator frees it. An initiator that gives up takes back what is not claimed yet
// (kPosted -> kFree): nothing of a transfer it failed moves after that.
enum SlotState : uint32_t { kFree = 0, kPosted = 1, kDone = 2, kServing = 3 };
struct Slot {
    std::atomic<uint32_t> state;  // SlotState
    uint32_t pad;
    Reply reply;  // the target's
    uint8_t pad2[4];
    Request request;  // the initiator's
    uint8_t pad3[4];
    Entry entries[kMaxEntries];
};
struct RingHeader {
    std::atomic<uint32_t> targetAsleep;  // the target sleeps: a poster rings the socket (and clears it)
    uint8_t pad[60];
    std::atomic<uint32_t> spinning;  // initiator threads polling the ring: no completion doorbell needed
    uint8_t pad2[60];
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "the ring's words are shared between processes");
static_assert(offsetof(Slot, reply) == 8 && offsetof(Slot, request) == 48 && offsetof(Slot, entries) == 80 &&
                  sizeof(Slot) == 80 + kMaxEntries * sizeof(Entry) && sizeof(RingHeader) == 128,
              "same-host ring layout");
constexpr size_t kRingBytes = sizeof(RingHeader) + kRingSlots * sizeof(Slot);

// A ring mapped into this process (either side). Unmapped when destroyed.
class Ring {
public:
    Ring() = default;
    ~Ring();
    Ring(const Ring&) = delete;
    Ring& operator=(const Ring&) = delete;
    // The initiator's: a new sealed memfd (its fd, to send, in fd; closed by the caller). False
    // with errno set when the kernel refused.
    bool create(int& fd);
    // The target's: maps fd when it is a memfd of the ring's size that can no longer shrink. False
    // otherwise (the fd is not closed here).
    bool attach(int fd);
    RingHeader& header() const { return *reinterpret_cast<RingHeader*>(base_); }
    Slot& slot(uint64_t seq) const { return reinterpret_cast<Slot*>(base_ + sizeof(RingHeader))[seq % kRingSlots]; }

private:
    uint8_t* base_ = nullptr;
};

// One empty poll of a ring: a pause, and every kPollPauses polls a yield of the CPU. Yielding
// often matters on a busy host: when initiator and target share a core, each waits for the
// other's yield (measured on a 2-core VM: a 4 KiB round trip of 10 µs with a yield every 64
// polls, 8 every 8, 3 when they run on two cores).
constexpr int kPollPauses = 8;
void relax(int& polls);

// What an engine publishes for same-host peers: "mori-same-host/1 <host key> <pid ns> <socket>".
std::string contact(const std::string& hostKey, const std::string& socketName);
// The socket name of contact when it names this host and PID namespace, else "".
std::string reachable_socket(const std::string& contact, const std::string& hostKey);

}  // namespace same_host

// Messages that found a socket's send buffer full, sent in order once it drains. Owner's lock.
struct Outbox {
    std::deque<std::string> queued;
    // Sends msg now if nothing waits before it and the socket takes it; else queues it. False
    // when the socket failed (errno kept in err).
    bool send(int fd, const void* msg, size_t len, int& err);
    // Sends what waits; false on failure. Empty afterwards when everything went.
    bool flush(int fd, int& err);
};

// An initiator's channel to one same-host peer engine: its socket and its request ring. Shared by
// its Peer, its transfers in flight and the service thread, which harvests completions when no
// caller does.
class SameHostLink : public std::enable_shared_from_this<SameHostLink> {
public:
    SameHostLink(Engine& engine, std::shared_ptr<PeerState> peer, int fd);
    ~SameHostLink();
    // Connects to the target's socket, hands it the ring and runs the probe (within the engine's
    // timeout). Null with why set when the path cannot be used.
    static std::shared_ptr<SameHostLink> open(Engine& engine, const std::shared_ptr<PeerState>& peer,
                                              const std::string& socketName, std::string& why);
    // Posts rows (local address, remote offset, bytes) of local memory to remote memory id. With
    // the ring full it waits for room until the deadline (the transfer then fails).
    std::shared_ptr<Transfer> post(Op op, const std::shared_ptr<Region>& local, const plan::Row* rows, size_t n,
                                   uint64_t remoteId, uint64_t uid, bool notify, int64_t deadlineNs, Link* ucxLink);
    // Polls the ring on the caller's thread for up to spinNs (until t finished or the link
    // failed); the caller then sleeps on t, which the service thread finishes when the target
    // rings.
    void lead(const Transfer& t, int64_t deadlineNs, int64_t spinNs);
    bool usable() const { return !failed_.load(std::memory_order_acquire); }
    int fd() const { return fd_; }
    // Whether small transfers are copied by this process (same_host/window.hpp); else why not.
    bool direct() const { return direct_ != nullptr; }
    const std::string& direct_refusal() const { return directWhy_; }
    // Fails what is in flight with why and shuts the socket (the peer sees it closed).
    void fail(const std::string& why);

    // Service thread.
    void on_readable();
    void on_writable();
    void expire(int64_t now);

private:
    void open_direct(const int (&fds)[2]);  // the window and pins the hello's reply passed (-1: none)
    // A transfer of one request copied by this thread, finished; null when the target's thread
    // must serve it (see same_host/window.hpp).
    std::shared_ptr<Transfer> copy_direct(Op op, const plan::Row* rows, size_t n, uint64_t remoteId, uint64_t uid,
                                          bool notify, int64_t deadlineNs, Link* ucxLink);
    // A direct copy's notification, through the ring (with it full, waits for room until the
    // deadline, then fails the link).
    void post_note(uint64_t uid, int64_t deadlineNs);
    size_t read_locked();  // readMu_ held: drains the doorbells, harvests the ring; returns replies handled
    size_t harvest();      // readMu_ held: the completions the target marked done, in order
    // Waits (polling, then asleep on the socket) until the slot of sequence seq is free; false at
    // the deadline or when the link failed.
    bool wait_for_room(uint64_t seq, int64_t deadlineNs);
    std::string ring_full_why() const;  // why a transfer failed waiting for room
    void handle(uint64_t seq, const same_host::Reply& r);
    void send(const void* msg, size_t len);
    struct Pending {  // both null for a note
        std::shared_ptr<Transfer> transfer;
        std::shared_ptr<Region> local;  // pinned until the reply
    };
    Engine& engine_;
    std::shared_ptr<PeerState> peer_;
    int fd_;
    same_host::Ring ring_;
    std::atomic<bool> failed_{false};
    std::mutex mu_;                                  // pending_, head_, failure_
    std::unordered_map<uint64_t, Pending> pending_;  // by ring sequence
    uint64_t head_ = 0;                              // the next sequence to post
    uint64_t done_ = 0;                              // the next sequence to harvest (readMu_)
    int64_t nextDeadlineNs_ = INT64_MAX;
    std::string failure_;
    std::mutex readMu_;  // one harvester of the ring and reader of the socket at a time
    std::mutex sendMu_;  // outbox_
    Outbox outbox_;
    std::unique_ptr<same_host::DirectPath> direct_;
    std::string directWhy_;
};

// The engine's same-host service: its listening socket, the connections it serves, and the
// replies of its own links (see the top of this file).
class SameHostService {
public:
    explicit SameHostService(Engine& engine);
    ~SameHostService();
    const std::string& socket_name() const { return name_; }
    void add_link(const std::shared_ptr<SameHostLink>& link);
    void remove_link(const SameHostLink* link);
    void want_write(int fd);  // a link's outbox holds messages: flush when writable
    // Where this engine publishes its host regions for initiators' direct copies (window.hpp);
    // null when the kernel refused it.
    same_host::Window* window() const { return window_.get(); }
    void stop();  // ends the thread, closes every connection, fails every link

private:
    struct Conn;
    void run();
    void resume_listening(int64_t now);           // the listening socket, once its pause (fd exhaustion) ended
    void on_link_event(int fd, uint32_t events);  // one of this engine's links: doorbells, its outbox
    // A connection served: its messages, its outbox; false when it brought only notes.
    bool on_conn_event(int fd, uint32_t events);
    void spin_on_rings(int64_t& lastBusy);  // polls the rings alone for kRingsOnlyNs
    void expire_links(int64_t now);         // fails the transfers of own links past their deadline
    void accept_all();
    void serve(Conn& c, const uint8_t* msg, size_t len, int passedFd);
    void hello(Conn& c, const same_host::Hello& h, int ringFd);
    // Sends a proven hello's reply with the window and the connection's pins (SCM_RIGHTS);
    // false, nothing sent, when there is none to offer (then the plain reply goes).
    bool offer_window(Conn& c, const void* msg, size_t len);
    // Serves the posted slots of c's ring, in order (a few per call: one peer cannot hold the
    // thread); true when it served any.
    bool serve_ring(Conn& c);
    void copy(Conn& c, const same_host::Request& h, const same_host::Entry* entries, same_host::Reply& r);
    bool poll_rings();  // serve_ring on every proven connection; true when any was served
    bool any_posted();  // after telling every ring's initiator that the thread goes to sleep
    void reply(Conn& c, const void* msg, size_t len);
    void ring_bell(Conn& c);  // tells c's initiator that completions wait in its ring
    // Rings the bells held back whose time came (all of them with `all`), drops those whose
    // completions were reaped meanwhile.
    void ring_bells(bool all);
    ssize_t receive(int fd, bool hello, int& passedFd);
    void drop(int fd);
    void watch(int fd, uint32_t events, bool add);

    Engine& engine_;
    std::string name_;
    int listenFd_ = -1, epollFd_ = -1, wakeFd_ = -1;
    std::atomic<bool> stop_{false};
    std::thread thread_;
    std::unordered_map<int, std::unique_ptr<Conn>> conns_;  // service thread only
    std::mutex linksMu_;
    std::unordered_map<int, std::shared_ptr<SameHostLink>> links_;  // by socket
    std::vector<uint8_t> buf_;
    std::vector<same_host::Entry> entries_;  // a request copied out of its ring before it is checked
    std::vector<int> ready_;                 // poll_rings' list of connections
    std::vector<int> bells_;                 // connections with a bell held back (Conn::bellAt)
    int64_t listenPausedUntil_ = 0;
    std::unique_ptr<same_host::Window> window_;
};

}  // namespace mori::ucx
