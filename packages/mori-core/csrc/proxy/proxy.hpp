// The proxy of device-initiated RMA: a native thread that executes the commands a GPU's kernels
// post into a ring in host-mapped memory (mori/device/proxy_ring.cuh) on the UCX engine, and
// publishes their completion there for the kernels' quiet and barrier to wait on.
//
// The ring serves one symmetric heap: a command names a PE and an offset in that PE's heap, which
// every PE registered with its engine as memory ids heapId, heapId + 1, ... (one per `chunk`
// bytes; one id when chunk is the whole heap). The local side of a put or get is an address: in
// the local heap it travels as is; elsewhere it is registered (as GPU memory, else as host
// memory) once for the commands in flight that lie in it, and released when the last of them is
// complete.
//
// Commands are taken in ticket order. Puts, gets, g and atomics (fetching or not) are posted and
// complete in the background (completed advances past a ticket once it and every earlier one
// are complete; a command with a reply is answered in its slot when its answer arrives); a put
// with signal sends its signal's atomic once its bytes are written. A fence makes the next
// command to each PE that has commands in flight wait until those are complete; an ordered
// command (the barrier's arrival) waits until every earlier command is. Failures (a dead or hung
// PE, a refusal) are recorded: `failed` names the first PE in the ring's header, failure() says
// why, and the commands still complete, so no kernel waits forever; the kernels report it. No
// Python is called: the thread runs free of the GIL.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ucx/atomic.hpp"
#include "ucx/engine.hpp"

namespace mori::device {
struct ProxySlot;
struct ProxyHeader;
}  // namespace mori::device

namespace mori::ucx {

struct ProxyConfig {
    uintptr_t ring = 0;  // host address of the ProxyHeader (the slots follow it)
    uint64_t heapId = 0, heapBase = 0, heapSize = 0, chunk = 0;
    bool heapGpu = false;  // every PE's heap is GPU memory
    uintptr_t bounce = 0;  // host memory of kProxySlots * 16 bytes, which the proxy registers as bounceId
    uint64_t bounceId = 0;
    double timeout = 30.0;  // seconds an operation may take (the engine's timeout too)
    std::string timeoutSetting = "timeout";
};

class Proxy {
public:
    // peers[pe]: the endpoints to PE pe (null for PEs the ring must not name). Starts the thread.
    Proxy(std::shared_ptr<Engine> engine, std::vector<std::shared_ptr<Peer>> peers, const ProxyConfig& cfg);
    ~Proxy();
    // True once every command posted so far is complete (after the kernels that post have
    // ended); false after timeout seconds.
    bool wait_idle(double timeout);
    // Why the first failed command failed ("" when none did).
    std::string failure() const;
    uint64_t executed() const { return executed_.load(); }
    // Ends the thread after the commands already posted (each still bounded by the timeout).
    void stop();

private:
    // Memory outside the heap registered for the commands in flight that lie in it.
    struct Adhoc {
        uint64_t id, addr, bytes;
        int uses;
    };
    struct Pending {
        uint64_t ticket = 0;
        int pe = -1;
        std::vector<std::shared_ptr<Transfer>> transfers;
        std::vector<uint64_t> adhoc;  // ids of the Adhoc registrations this command uses
        std::unique_ptr<AtomicInFlight> atomic;  // an atomic, or a put's signal once sent
        bool signal = false;  // a put with signal: its atomic follows the bytes
        uint64_t sigOffset = 0, sigValue = 0;
        uint8_t sigOp = 0;
        bool reply = false;       // answered in its slot on completion (the atomic's old value, or g's bytes)
        uint64_t inlineGet = 0;   // g: bytes read into the slot's bounce area
        bool freeSlot = false;  // the slot (an inline put's bytes) is freed on completion
        uint64_t bytes = 0;     // a put's or get's, counted in bytesInFlight_ until it completes
        bool done = false;
    };
    void run();
    void execute(const device::ProxySlot& c, uint64_t ticket);
    bool reap();                // finishes what completed; true when something did
    template <class Busy>
    void reap_while(Busy busy);  // reaps (publishing progress) while busy() holds
    bool advance(Pending& p);   // moves p on; true once it is complete
    void drain();               // waits until nothing is in flight
    void drain_pe(int pe);      // waits until nothing to pe is in flight
    void make_room(uint64_t bytes);  // waits until bytes more fit in kBytesInFlight (or none are in flight)
    void publish();
    void finish(Pending& p);
    void fail(int pe, const std::string& why);
    void free_slot(uint64_t ticket);
    void answer(uint64_t ticket, uint64_t value);
    device::ProxySlot* slot(uint64_t ticket) const;
    uint64_t bounce(uint64_t ticket) const;
    std::shared_ptr<Peer> peer(int pe, const char* what);
    // The memory id and offset in it of heap offset off (and bytes to the end of its chunk).
    uint64_t heap_id(uint64_t off, uint64_t& inId, uint64_t& left) const;
    // Posts an engine transfer of bytes between local address `local` and heap offset `remote` of pe.
    void transfer(Pending& p, Op op, uint64_t local, uint64_t remote, uint64_t bytes);
    // The memory id of [local, local + bytes) outside the heap (registered at base), shared while in flight.
    uint64_t adhoc(Pending& p, uint64_t local, uint64_t bytes, uint64_t& base);
    std::unique_ptr<AtomicInFlight> start_atomic(int pe, uint8_t op, uint64_t remote, uint64_t value,
                                                 uint64_t compare, int width);

    std::shared_ptr<Engine> engine_;
    std::vector<std::shared_ptr<Peer>> peers_;
    ProxyConfig cfg_;
    device::ProxyHeader* header_;
    std::deque<Pending> pending_;
    std::vector<Adhoc> adhoc_;
    std::vector<int> fenced_;  // PEs whose next command waits for their commands in flight (a fence)
    uint64_t tail_ = 0;
    uint64_t bytesInFlight_ = 0;  // of the puts and gets in pending_
    uint64_t nextAdhoc_;
    std::atomic<uint64_t> executed_{0};
    std::atomic<uint64_t> published_{0};
    std::atomic<bool> stop_{false};
    mutable std::mutex failMu_;
    std::string failure_;
    std::thread thread_;
};

}  // namespace mori::ucx
