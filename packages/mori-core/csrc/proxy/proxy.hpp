// The proxy of device-initiated RMA: a native thread that executes the commands a GPU's kernels
// post into a ring in host-mapped memory (mori/device/proxy_ring.cuh) on the UCX engine, and
// publishes their completion there for the kernels' quiet and barrier to wait on.
//
// The ring serves one symmetric heap through its heap window (ucx/heap_window.hpp), which the
// host API calls too: a command names a PE and an offset in that PE's heap, and the window
// checks it, cuts it at the heap's chunks and finds its local side (the local heap and the
// bounce area as they are; other memory, a kernel's buffer, registered while the commands in
// flight that lie in it need it).
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
#include "ucx/heap_window.hpp"

namespace mori::device {
struct ProxySlot;
struct ProxyHeader;
}  // namespace mori::device

namespace mori::ucx {

class Proxy {
public:
    // ring: host address of the ProxyHeader (the slots follow it); bounce: host memory of
    // kProxySlots * 16 bytes, which the proxy registers with the window for good. The window's
    // peers are the PEs the ring may name. Starts the thread.
    Proxy(std::shared_ptr<HeapWindow> window, uintptr_t ring, uintptr_t bounce);
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
    struct Pending {
        uint64_t ticket = 0;
        int pe = -1;
        std::vector<std::shared_ptr<Transfer>> transfers;
        std::shared_ptr<Lease> lease;            // memory registered for this command's transfer, if any
        std::unique_ptr<AtomicInFlight> atomic;  // an atomic, or a put's signal once sent
        bool signal = false;                     // a put with signal: its atomic follows the bytes
        uint64_t sigOffset = 0, sigValue = 0;
        uint8_t sigOp = 0;
        bool reply = false;      // answered in its slot on completion (the atomic's old value, or g's bytes)
        uint64_t inlineGet = 0;  // g: bytes read into the slot's bounce area
        bool freeSlot = false;   // the slot (an inline put's bytes) is freed on completion
        uint64_t bytes = 0;      // a put's or get's, counted in bytesInFlight_ until it completes
        bool done = false;
    };
    void run();
    void execute(const device::ProxySlot& c, uint64_t ticket);
    void wait_for_order(const device::ProxySlot& c);  // an ordered command's drain, a fenced PE's
    // Starts command c: its entry in pending_ (started, once made) and what it posts; throws for a
    // bad command. start_transfer: a put or get, inline or not.
    void start(const device::ProxySlot& c, uint64_t ticket, Pending*& started);
    void start_transfer(const device::ProxySlot& c, uint64_t ticket, Pending*& started);
    // A put with signal whose bytes the command carries (kProxyFlagInline): one message, or where
    // it spans two chunks of the target's heap, the put from the slot's bounce area, then the signal.
    void start_inline_signal_put(const device::ProxySlot& c, uint64_t ticket, Pending*& started);
    Pending& track(const device::ProxySlot& c, uint64_t ticket, Pending*& started);
    // Whether c is a put with signal that goes as one message (HeapWindow::one_message).
    bool one_message(const device::ProxySlot& c) const;
    bool reap();  // finishes what completed; true when something did
    template <class Busy>
    void reap_while(Busy busy);      // reaps (publishing progress) while busy() holds
    bool advance(Pending& p);        // moves p on; true once it is complete
    void drain();                    // waits until nothing is in flight
    void drain_pe(int pe);           // waits until nothing to pe is in flight
    void make_room(uint64_t bytes);  // waits until bytes more fit in kBytesInFlight (or none are in flight)
    void publish();
    void finish(Pending& p);
    void fail(int pe, const std::string& why);
    void free_slot(uint64_t ticket);
    void answer(uint64_t ticket, uint64_t value);
    device::ProxySlot* slot(uint64_t ticket) const;
    uint64_t bounce(uint64_t ticket) const;
    // Posts the window's transfer of bytes between local address `local` and heap offset `remote` of p.pe.
    void post(Pending& p, Op op, uint64_t local, uint64_t remote, uint64_t bytes);

    std::shared_ptr<HeapWindow> window_;
    std::shared_ptr<Engine> engine_;
    uintptr_t ring_, bounce_;
    device::ProxyHeader* header_;
    std::deque<Pending> pending_;
    std::vector<int> fenced_;  // PEs whose next command waits for their commands in flight (a fence)
    uint64_t tail_ = 0;
    uint64_t bytesInFlight_ = 0;  // of the puts and gets in pending_
    std::atomic<uint64_t> executed_{0};
    std::atomic<uint64_t> published_{0};
    std::atomic<bool> stop_{false};
    mutable std::mutex failMu_;
    std::string failure_;
    std::thread thread_;
};

}  // namespace mori::ucx
