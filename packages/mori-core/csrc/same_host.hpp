// The UCX engine's same-host path: between two engines of one host (one kernel, one network
// namespace, one PID namespace) host memory moves with process_vm_readv/process_vm_writev,
// done by the target after it checked every block against its live registrations.
//
// Each engine listens on an abstract Unix socket (SOCK_SEQPACKET: one message per send). An
// initiator's link connects, presents the ticket the target issued to it, and proves the path
// works: the target reads a nonce from the initiator's memory with process_vm_readv (the kernel
// names the initiator's pid: SO_PEERCRED). A refused probe (EPERM: ptrace rules, another user)
// leaves the peer on the UCX path. A request names, per block, the target's (memory id, offset,
// size) and the initiator's address; the target pins the regions, refuses anything outside a live
// registration before a byte moves, copies, and replies. A peer that dies closes its socket: the
// other side sees it at once, at no cost to the copies.
//
// One thread per engine (SameHostService) serves requests and reads its own links' replies, with
// a short spin after activity; a caller waiting on its transfer reads its link's replies itself
// first. Nothing blocks on a peer that does not read: messages that find its socket full wait in
// an outbox that the service thread flushes. Nothing here calls Python.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "batch_plan.hpp"

namespace mori::ucx {

class Engine;
class Transfer;
struct Region;
struct PeerState;
struct Link;
enum Op : uint8_t;

namespace same_host {

constexpr uint32_t kMagic = 0x4d534830;  // "0HSM"
enum Type : uint8_t { kHello = 1, kHelloReply = 2, kRequest = 3, kReply = 4, kNote = 5 };
constexpr size_t kMaxEntries = 1024;  // IOV_MAX: one process_vm call per request

#pragma pack(push, 1)
struct Hello {  // initiator -> target, first message
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
struct Request {  // followed by count Entries
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
    uint64_t memId, offset, size;  // the target's memory
    uint64_t addr;                 // the initiator's memory
};
struct Reply {
    uint32_t magic;
    uint8_t type, pad[3];
    int32_t code;
    uint32_t reason, entry;  // why a block was refused (ucx_wire.hpp's Reason) and which
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
#pragma pack(pop)
static_assert(sizeof(Hello) == 40 && sizeof(HelloReply) == 12 && sizeof(Request) == 28 && sizeof(Entry) == 32 &&
                  sizeof(Reply) == 36 && sizeof(Note) == 24,
              "same-host wire layout");
constexpr size_t kMaxMessage = sizeof(Request) + kMaxEntries * sizeof(Entry);

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

// An initiator's channel to one same-host peer engine. Shared by its Peer, its transfers in flight
// and the service thread, which reads its replies when no caller does.
class SameHostLink : public std::enable_shared_from_this<SameHostLink> {
public:
    SameHostLink(Engine& engine, std::shared_ptr<PeerState> peer, int fd);
    ~SameHostLink();
    // Connects to the target's socket and runs the probe (within the engine's timeout). Null with
    // why set when the path cannot be used.
    static std::shared_ptr<SameHostLink> open(Engine& engine, const std::shared_ptr<PeerState>& peer,
                                              const std::string& socketName, std::string& why);
    // Posts rows (local address, remote offset, bytes) of local memory to remote memory id.
    std::shared_ptr<Transfer> post(Op op, const std::shared_ptr<Region>& local, const plan::Row* rows, size_t n,
                                   uint64_t remoteId, uint64_t uid, bool notify, int64_t deadlineNs, Link* ucxLink);
    // Reads replies on the caller's thread until t finished or the deadline passes: polling for
    // spinNs, then asleep on the socket.
    void lead(const Transfer& t, int64_t deadlineNs, int64_t spinNs);
    bool usable() const { return !failed_.load(std::memory_order_acquire); }
    int fd() const { return fd_; }
    // Fails what is in flight with why and shuts the socket (the peer sees it closed).
    void fail(const std::string& why);

    // Service thread.
    void on_readable();
    void on_writable();
    void expire(int64_t now);

private:
    size_t read_locked();  // readMu_ held; returns replies handled
    void handle(const same_host::Reply& r);
    void send(const void* msg, size_t len);
    struct Pending {
        std::shared_ptr<Transfer> transfer;
        std::shared_ptr<Region> local;  // pinned until the reply
        std::string request;            // for naming a refused block
    };
    Engine& engine_;
    std::shared_ptr<PeerState> peer_;
    int fd_;
    std::atomic<bool> failed_{false};
    std::mutex mu_;  // pending_, next_, failure_
    std::unordered_map<uint64_t, Pending> pending_;
    uint64_t next_ = 1;
    int64_t nextDeadlineNs_ = INT64_MAX;
    std::string failure_;
    std::mutex readMu_;  // one reader of the socket at a time
    std::mutex sendMu_;  // outbox_
    Outbox outbox_;
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
    void stop();              // ends the thread, closes every connection, fails every link

private:
    struct Conn;
    void run();
    void accept_all();
    void serve(Conn& c, const uint8_t* msg, size_t len);
    void hello(Conn& c, const same_host::Hello& h);
    void copy(Conn& c, const same_host::Request& h, const uint8_t* entries);
    void reply(Conn& c, const void* msg, size_t len);
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
    int64_t listenPausedUntil_ = 0;
};

}  // namespace mori::ucx
