// The proxy of device-initiated RMA (see proxy/proxy.hpp).
#include "proxy/proxy.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "base/thread_name.hpp"
#include "base/trace.hpp"
#include "mori/device/proxy_ring.cuh"

namespace mori::ucx {

using device::kProxySlots;
using device::ProxyHeader;
using device::ProxySlot;

namespace {

constexpr uint64_t kInlineBytes = 16;  // bounce bytes per slot
// Bytes of puts and gets in flight before the next one waits for earlier ones to complete. A
// staged transfer holds its bytes in pinned host memory until it completes (ucx/gpu.hpp), so a
// kernel's burst of large nbi puts would otherwise hold all of them at once, more than the staging
// pool keeps between transfers, and every further one paid for pinning fresh memory.
constexpr uint64_t kBytesInFlight = uint64_t{128} << 20;

template <class T>
T load(const T* p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
template <class T>
void store(T* p, T v) {
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
}

void pause(int idle) {
    // Busy while commands keep coming, then short sleeps: a kernel's next command is usually
    // microseconds behind, and a proxy that sleeps long adds that to every put.
    if (idle < 2000) {
        std::this_thread::yield();
    } else {
        std::this_thread::sleep_for(std::chrono::microseconds(idle < 20000 ? 5 : 50));
    }
}

}  // namespace

Proxy::Proxy(std::shared_ptr<HeapWindow> window, uintptr_t ring, uintptr_t bounce)
    : window_(std::move(window)), ring_(ring), bounce_(bounce), header_(reinterpret_cast<ProxyHeader*>(ring)) {
    if (!window_ || ring == 0 || bounce == 0)
        throw std::invalid_argument("the proxy needs a heap window, a ring and a bounce area");
    engine_ = window_->engine();
    window_->register_buffer(bounce_, kProxySlots * kInlineBytes, false);
    std::memset(header_, 0, sizeof(ProxyHeader));
    header_->slots = kProxySlots;
    for (uint64_t t = 0; t < kProxySlots; ++t) {
        std::memset(slot(t), 0, sizeof(ProxySlot));
        slot(t)->seq = 4 * t;  // free for ticket t
    }
    thread_ = std::thread([this] {
        name_this_thread("mori-proxy");
        run();
    });
}

Proxy::~Proxy() { stop(); }

ProxySlot* Proxy::slot(uint64_t ticket) const {
    return reinterpret_cast<ProxySlot*>(ring_ + sizeof(ProxyHeader)) + (ticket & (kProxySlots - 1));
}

void Proxy::stop() {
    stop_.store(true);
    if (!thread_.joinable()) return;
    thread_.join();
    try {
        window_->deregister_buffer(bounce_);
    } catch (const std::exception&) {
        // the engine was closed first: its registrations went with it
    }
}

std::string Proxy::failure() const {
    std::lock_guard lk(failMu_);
    return failure_;
}

bool Proxy::wait_idle(double timeout) {
    const int64_t deadline = now_ns() + static_cast<int64_t>(timeout * 1e9);
    int idle = 0;
    for (;;) {
        const uint64_t taken = load(&header_->taken);
        const bool posted = load(&slot(taken)->seq) == 4 * taken + 1;
        if (!posted && load(&header_->completed) == taken) return true;
        if (!thread_.joinable() || now_ns() >= deadline) return false;
        pause(idle += 100);
    }
}

void Proxy::fail(int pe, const std::string& why) {
    std::lock_guard lk(failMu_);
    if (!failure_.empty()) return;
    failure_ = "PE " + std::to_string(pe) + ": " + why;
    store(&header_->failed, static_cast<unsigned long long>(pe + 1));
    std::fprintf(stderr, "mori proxy: a device-initiated operation to %s\n", failure_.c_str());
}

void Proxy::free_slot(uint64_t ticket) {
    store(&slot(ticket)->seq, static_cast<unsigned long long>(4 * (ticket + kProxySlots)));
}

void Proxy::answer(uint64_t ticket, uint64_t value) {
    ProxySlot* s = slot(ticket);
    s->value = value;
    store(&s->seq, static_cast<unsigned long long>(4 * ticket + 2));
}

uint64_t Proxy::bounce(uint64_t ticket) const { return bounce_ + (ticket & (kProxySlots - 1)) * kInlineBytes; }

void Proxy::post(Pending& p, Op op, uint64_t local, uint64_t remote, uint64_t bytes) {
    HeapWindow::Posted posted = window_->post(op, p.pe, remote, local, bytes);
    p.transfers = std::move(posted.parts);
    p.lease = std::move(posted.lease);
}

void Proxy::execute(const ProxySlot& c, uint64_t ticket) {
    const bool reply = (c.flags & device::kProxyFlagReply) != 0;
    wait_for_order(c);
    Pending* started = nullptr;  // the command's entry in pending_, once it has one
    try {
        start(c, ticket, started);
    } catch (const std::exception& e) {
        fail(c.pe, e.what());
        // A command that failed before anything of it started completes at once (its transfers,
        // if any started, still finish on their own deadline).
        if (started != nullptr && started->transfers.empty() && !started->atomic) {
            started->signal = false;
            finish(*started);
            started = nullptr;
        }
    }
    const bool freedEarly = c.command == device::kProxyPut || c.command == device::kProxyGet;
    if (reply && started == nullptr) {
        answer(ticket, 0);  // failed at once; the kernel finds `failed` set
    } else if (!reply && !freedEarly && c.command != device::kProxyPutInline) {
        free_slot(ticket);  // (an inline put's slot is freed when its bytes are written)
    }
    executed_.fetch_add(1);
}

void Proxy::wait_for_order(const ProxySlot& c) {
    if ((c.flags & device::kProxyFlagOrdered) != 0) {
        drain();
        fenced_.clear();  // nothing is in flight
    } else if (c.command != device::kProxyFence) {
        auto f = std::find(fenced_.begin(), fenced_.end(), c.pe);
        if (f != fenced_.end()) {  // a fence came after this PE's commands in flight
            fenced_.erase(f);
            drain_pe(c.pe);
        }
    }
}

Proxy::Pending& Proxy::track(const ProxySlot& c, uint64_t ticket, Pending*& started) {
    pending_.push_back(Pending{});
    started = &pending_.back();
    started->ticket = ticket;
    started->pe = c.pe;
    started->reply = (c.flags & device::kProxyFlagReply) != 0;
    return *started;
}

void Proxy::start(const ProxySlot& c, uint64_t ticket, Pending*& started) {
    switch (c.command) {
        case device::kProxyPut:
        case device::kProxyGet:
        case device::kProxyPutInline: start_transfer(c, ticket, started); break;
        case device::kProxyGetInline: {
            if (c.bytes == 0 || c.bytes > 8)
                throw std::invalid_argument("an inline get of " + std::to_string(c.bytes) + " bytes");
            Pending& p = track(c, ticket, started);
            p.inlineGet = c.bytes;  // answered with the bytes once they are in the bounce area
            post(p, kOpRead, bounce(ticket), c.remote, c.bytes);
            break;
        }
        case device::kProxyAtomic: {
            Pending& p = track(c, ticket, started);
            p.atomic = window_->start_atomic(c.pe, static_cast<AtomicOp>(c.op), c.remote, c.value, c.compare, c.width);
            break;
        }
        case device::kProxyFence:
            // Ordering per PE: the next command to each PE (value - 1 alone when value != 0)
            // with commands in flight waits for them; nothing waits now.
            for (const Pending& p : pending_)
                if (!p.done && (c.value == 0 || static_cast<uint64_t>(p.pe) + 1 == c.value) &&
                    std::find(fenced_.begin(), fenced_.end(), p.pe) == fenced_.end())
                    fenced_.push_back(p.pe);
            break;
        default: throw std::invalid_argument("unknown command " + std::to_string(c.command));
    }
}

void Proxy::start_transfer(const ProxySlot& c, uint64_t ticket, Pending*& started) {
    if (c.command == device::kProxyPutInline) {
        if (c.bytes == 0 || c.bytes > kInlineBytes)
            throw std::invalid_argument("an inline put of " + std::to_string(c.bytes) + " bytes");
        // The bytes wait in the slot's bounce area, which the slot keeps until they are written.
        const uint64_t words[2] = {c.value, c.compare};
        std::memcpy(reinterpret_cast<void*>(bounce(ticket)), words, kInlineBytes);
        Pending& p = track(c, ticket, started);
        p.freeSlot = true;
        post(p, kOpWrite, bounce(ticket), c.remote, c.bytes);
        return;
    }
    if ((c.flags & device::kProxyFlagInline) != 0) {
        start_inline_signal_put(c, ticket, started);
        return;
    }
    if (one_message(c)) {
        // The bytes travel in the signal's own message: one trip to the target, not the put's round
        // trip and then the atomic's.
        Pending& p = track(c, ticket, started);
        free_slot(ticket);
        p.atomic = window_->start_signal_put(c.pe, c.remote, c.local, c.bytes, c.compare, static_cast<AtomicOp>(c.op),
                                             c.value);
        return;
    }
    make_room(c.bytes);
    Pending& p = track(c, ticket, started);
    p.bytes = c.bytes;
    bytesInFlight_ += c.bytes;
    if ((c.flags & device::kProxyFlagSignal) != 0) {
        p.signal = true;
        p.sigOffset = c.compare;
        p.sigValue = c.value;
        p.sigOp = c.op;
    }
    free_slot(ticket);  // the command is copied out; its memory is the kernel's until quiet
    post(p, c.command == device::kProxyPut ? kOpWrite : kOpRead, c.local, c.remote, c.bytes);
}

void Proxy::start_inline_signal_put(const ProxySlot& c, uint64_t ticket, Pending*& started) {
    // Tracked first: the slot of a refused command is freed as the command completes.
    Pending& p = track(c, ticket, started);
    p.freeSlot = true;
    if (c.command != device::kProxyPut || (c.flags & device::kProxyFlagSignal) == 0 || c.bytes == 0 || c.bytes > 8)
        throw std::invalid_argument("inline bytes come with a put with signal of 1 to 8 bytes, not command " +
                                    std::to_string(c.command) + " of " + std::to_string(c.bytes) + " bytes");
    const uint64_t word = c.local;  // the bytes, little-endian, as the kernel packed them
    if (window_->fits_one_message(c.remote, c.bytes)) {
        p.freeSlot = false;
        free_slot(ticket);  // the bytes are copied out of it
        p.atomic = window_->start_signal_put_bytes(c.pe, c.remote, &word, c.bytes, c.compare,
                                                   static_cast<AtomicOp>(c.op), c.value);
        return;
    }
    // Across two chunks of the target's heap: the put from the slot's bounce area, then the signal.
    std::memcpy(reinterpret_cast<void*>(bounce(ticket)), &word, sizeof(word));
    p.signal = true;
    p.sigOffset = c.compare;
    p.sigValue = c.value;
    p.sigOp = c.op;
    post(p, kOpWrite, bounce(ticket), c.remote, c.bytes);
}

bool Proxy::one_message(const ProxySlot& c) const {
    return c.command == device::kProxyPut && (c.flags & device::kProxyFlagSignal) != 0 &&
           window_->one_message(c.remote, c.local, c.bytes);
}

void Proxy::finish(Pending& p) {
    p.lease.reset();  // the last command using it deregisters it
    p.atomic.reset();
    if (p.freeSlot) free_slot(p.ticket);
    bytesInFlight_ -= p.bytes;
    p.bytes = 0;
    p.done = true;
}

bool Proxy::advance(Pending& p) {
    for (const auto& t : p.transfers)
        if (!t->finished()) return false;
    if (!p.transfers.empty()) {
        for (const auto& t : p.transfers) {
            if (t->code() != kSuccess) {
                fail(p.pe, t->message());
                p.signal = false;
                break;
            }
        }
        p.transfers.clear();
    }
    if (p.signal) {  // the bytes are written: now the signal, in flight like any atomic
        p.signal = false;
        try {
            p.atomic = window_->start_atomic(p.pe, static_cast<AtomicOp>(p.sigOp), p.sigOffset, p.sigValue, 0, 64);
        } catch (const std::exception& e) {
            fail(p.pe, std::string("the signal of a put with signal: ") + e.what());
        }
    }
    uint64_t value = 0;
    if (p.atomic) {
        if (!p.atomic->poll()) return false;
        if (!p.atomic->error().empty()) fail(p.pe, p.atomic->error());
        value = p.atomic->old();
    } else if (p.inlineGet != 0) {
        std::memcpy(&value, reinterpret_cast<const void*>(bounce(p.ticket)), p.inlineGet);
    }
    if (p.reply) answer(p.ticket, value);
    finish(p);
    return true;
}

bool Proxy::reap() {
    bool any = false;
    for (Pending& p : pending_)
        if (!p.done) any = advance(p) || any;
    while (!pending_.empty() && pending_.front().done) pending_.pop_front();
    return any;
}

template <class Busy>
void Proxy::reap_while(Busy busy) {
    int idle = 0;
    while (busy()) {
        if (reap()) {
            idle = 0;
            publish();
        } else {
            pause(++idle);
        }
    }
}

void Proxy::drain() {
    reap_while([this] { return !pending_.empty(); });
    publish();
}

void Proxy::make_room(uint64_t bytes) {
    reap_while([&] { return bytesInFlight_ > 0 && bytesInFlight_ + bytes > kBytesInFlight; });
}

void Proxy::drain_pe(int pe) {
    reap_while([&] {
        for (const Pending& p : pending_)
            if (!p.done && p.pe == pe) return true;
        return false;
    });
}

void Proxy::publish() {
    const uint64_t completed = pending_.empty() ? tail_ : pending_.front().ticket;
    const uint64_t waiting = pending_.empty() ? 0 : static_cast<uint64_t>(pending_.front().pe + 1);
    store(&header_->waitingPe, static_cast<unsigned long long>(waiting));
    store(&header_->completed, static_cast<unsigned long long>(completed));
    published_.store(completed);
}

void Proxy::run() {
    int idle = 0;
    uint64_t cudaSeen = 0;
    for (;;) {
        // This thread posts the transfers and atomics: the engine's GPU copies and UCX's CUDA
        // calls for them run here, in the engine's context.
        engine_->apply_cuda_context(cudaSeen);
        bool work = false;
        for (int n = 0; n < 256; ++n) {
            ProxySlot* s = slot(tail_);
            if (load(&s->seq) != 4 * tail_ + 1) break;
            ProxySlot c;
            std::memcpy(&c, s, sizeof(c));
            // Taken before it runs: execute frees a put's slot early, and wait_idle, seeing that
            // slot free while `taken` still named it and every earlier ticket complete, returned
            // with the put in flight (host quiet passed a put to a dead PE once staging made
            // execute take microseconds).
            store(&header_->taken, static_cast<unsigned long long>(tail_ + 1));
            trace::mark('P', c.command);
            execute(c, tail_);
            trace::mark('S', c.command);
            ++tail_;
            work = true;
        }
        work = reap() || work;
        publish();
        if (work) {
            idle = 0;
            continue;
        }
        if (stop_.load() && pending_.empty()) break;
        pause(++idle);
    }
}

}  // namespace mori::ucx
