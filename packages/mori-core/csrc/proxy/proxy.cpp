// The proxy of device-initiated RMA (see proxy/proxy.hpp).
#include "proxy/proxy.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "mori/device/proxy_ring.cuh"

namespace mori::ucx {

using device::kProxySlots;
using device::ProxyHeader;
using device::ProxySlot;

namespace {

constexpr uint64_t kFirstAdhoc = 1ull << 48;   // memory ids registered for one command
constexpr uint64_t kInlineBytes = 16;          // bounce bytes per slot
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

Proxy::Proxy(std::shared_ptr<Engine> engine, std::vector<std::shared_ptr<Peer>> peers, const ProxyConfig& cfg)
    : engine_(std::move(engine)),
      peers_(std::move(peers)),
      cfg_(cfg),
      header_(reinterpret_cast<ProxyHeader*>(cfg.ring)),
      nextAdhoc_(kFirstAdhoc) {
    if (!engine_ || cfg.ring == 0 || cfg.bounce == 0 || cfg.heapSize == 0)
        throw std::invalid_argument("the proxy needs an engine, a ring, a bounce area and a heap");
    if (cfg.chunk == 0 || cfg.heapSize % cfg.chunk != 0)
        throw std::invalid_argument("the heap's chunk must divide its size");
    if (!(cfg.timeout > 0)) throw std::invalid_argument("timeout must be > 0 seconds");
    engine_->register_region(cfg.bounceId, cfg.bounce, kProxySlots * kInlineBytes, false);
    std::memset(header_, 0, sizeof(ProxyHeader));
    header_->slots = kProxySlots;
    for (uint64_t t = 0; t < kProxySlots; ++t) {
        std::memset(slot(t), 0, sizeof(ProxySlot));
        slot(t)->seq = 4 * t;  // free for ticket t
    }
    thread_ = std::thread([this] { run(); });
}

Proxy::~Proxy() { stop(); }

ProxySlot* Proxy::slot(uint64_t ticket) const {
    return reinterpret_cast<ProxySlot*>(cfg_.ring + sizeof(ProxyHeader)) + (ticket & (kProxySlots - 1));
}

void Proxy::stop() {
    stop_.store(true);
    if (!thread_.joinable()) return;
    thread_.join();
    try {
        engine_->deregister_region(cfg_.bounceId);
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

std::shared_ptr<Peer> Proxy::peer(int pe, const char* what) {
    if (pe < 0 || static_cast<size_t>(pe) >= peers_.size() || !peers_[pe])
        throw std::invalid_argument(std::string(what) + " names PE " + std::to_string(pe) +
                                    ", which is not reached through the proxy");
    return peers_[pe];
}

uint64_t Proxy::heap_id(uint64_t off, uint64_t& inId, uint64_t& left) const {
    const uint64_t k = off / cfg_.chunk;
    inId = off - k * cfg_.chunk;
    left = cfg_.chunk - inId;
    return cfg_.heapId + k;
}

uint64_t Proxy::bounce(uint64_t ticket) const { return cfg_.bounce + (ticket & (kProxySlots - 1)) * kInlineBytes; }

uint64_t Proxy::adhoc(Pending& p, uint64_t local, uint64_t bytes, uint64_t& base) {
    // A kernel's buffer stays the kernel's until its commands are complete (quiet): while one
    // registration of it is in use, later commands in the same range share it.
    for (Adhoc& a : adhoc_) {
        if (local >= a.addr && bytes <= a.bytes && local - a.addr <= a.bytes - bytes) {
            ++a.uses;
            p.adhoc.push_back(a.id);
            base = a.addr;
            return a.id;
        }
    }
    // GPU memory first, the usual buffer of a kernel; host memory if UCX says it is not.
    const uint64_t id = nextAdhoc_++;
    try {
        engine_->register_region(id, local, bytes, cfg_.heapGpu);
    } catch (const std::exception&) {
        engine_->register_region(id, local, bytes, !cfg_.heapGpu);
    }
    adhoc_.push_back(Adhoc{id, local, bytes, 1});
    p.adhoc.push_back(id);
    base = local;
    return id;
}

void Proxy::transfer(Pending& p, Op op, uint64_t local, uint64_t remote, uint64_t bytes) {
    const char* what = op == kOpWrite ? "a put" : "a get";
    std::shared_ptr<Peer> to = peer(p.pe, what);
    if (remote > cfg_.heapSize || bytes > cfg_.heapSize - remote)
        throw std::invalid_argument(std::string(what) + " of " + std::to_string(bytes) + " bytes at heap offset " +
                                    std::to_string(remote) + " runs past the heap");
    // Nothing to move (a put with signal of no rows: its signal still follows): no transfer, and
    // no registration, which UCX refuses for an empty range (the command failed and its signal
    // was lost when its source lay outside the heap).
    if (bytes == 0) return;
    const bool inHeap = local >= cfg_.heapBase && local - cfg_.heapBase < cfg_.heapSize &&
                        bytes <= cfg_.heapSize - (local - cfg_.heapBase);
    const bool inBounce = local >= cfg_.bounce && local + bytes <= cfg_.bounce + kProxySlots * kInlineBytes;
    uint64_t fixedId = cfg_.bounceId, fixedOff = local - cfg_.bounce;
    if (!inHeap && !inBounce) {
        uint64_t base = 0;
        fixedId = adhoc(p, local, bytes, base);
        fixedOff = local - base;
    }
    // One batch per pair of memory ids: the rows split only where a heap chunk ends (the engine
    // moves each row as one message, pipelined with the rest of the batch).
    std::vector<uint64_t> lofs, rofs, sizes;
    uint64_t groupL = 0, groupR = 0;
    auto flush = [&] {
        if (sizes.empty()) return;
        p.transfers.push_back(to->submit(op, groupL, lofs.data(), groupR, rofs.data(), sizes.data(), sizes.size(), 0,
                                         false, cfg_.heapGpu));
        lofs.clear();
        rofs.clear();
        sizes.clear();
    };
    for (uint64_t done = 0; done < bytes;) {
        uint64_t rIn, rLeft, lId, lIn, lLeft = bytes;
        const uint64_t rId = heap_id(remote + done, rIn, rLeft);
        if (inHeap) {
            lId = heap_id(local - cfg_.heapBase + done, lIn, lLeft);
        } else {
            lId = fixedId;
            lIn = fixedOff + done;
        }
        const uint64_t n = std::min({bytes - done, rLeft, lLeft});
        if (!sizes.empty() && (lId != groupL || rId != groupR)) flush();
        groupL = lId;
        groupR = rId;
        lofs.push_back(lIn);
        rofs.push_back(rIn);
        sizes.push_back(n);
        done += n;
    }
    flush();
}

std::unique_ptr<AtomicInFlight> Proxy::start_atomic(int pe, uint8_t op, uint64_t remote, uint64_t value,
                                                    uint64_t compare, int width) {
    std::shared_ptr<Peer> to = peer(pe, "an atomic");
    if (remote >= cfg_.heapSize) throw std::invalid_argument("an atomic at heap offset " + std::to_string(remote) +
                                                             " is past the heap");
    uint64_t inId, left;
    const uint64_t id = heap_id(remote, inId, left);
    return std::make_unique<AtomicInFlight>(*engine_, to, static_cast<AtomicOp>(op), id, inId, value, compare, width,
                                            cfg_.timeout);
}

void Proxy::execute(const ProxySlot& c, uint64_t ticket) {
    const bool reply = (c.flags & device::kProxyFlagReply) != 0;
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
    Pending* started = nullptr;  // the command's entry in pending_, once it has one
    auto track = [&]() -> Pending& {
        pending_.push_back(Pending{});
        started = &pending_.back();
        started->ticket = ticket;
        started->pe = c.pe;
        started->reply = reply;
        return *started;
    };
    try {
        switch (c.command) {
            case device::kProxyPut:
            case device::kProxyGet:
            case device::kProxyPutInline: {
                if (c.command == device::kProxyPutInline) {
                    if (c.bytes == 0 || c.bytes > kInlineBytes) throw std::invalid_argument("an inline put of " +
                                                                   std::to_string(c.bytes) + " bytes");
                    // The bytes wait in the slot's bounce area, which the slot keeps until they are written.
                    const uint64_t words[2] = {c.value, c.compare};
                    std::memcpy(reinterpret_cast<void*>(bounce(ticket)), words, kInlineBytes);
                    Pending& p = track();
                    p.freeSlot = true;
                    transfer(p, kOpWrite, bounce(ticket), c.remote, c.bytes);
                    break;
                }
                make_room(c.bytes);
                Pending& p = track();
                p.bytes = c.bytes;
                bytesInFlight_ += c.bytes;
                if ((c.flags & device::kProxyFlagSignal) != 0) {
                    p.signal = true;
                    p.sigOffset = c.compare;
                    p.sigValue = c.value;
                    p.sigOp = c.op;
                }
                free_slot(ticket);  // the command is copied out; its memory is the kernel's until quiet
                transfer(p, c.command == device::kProxyPut ? kOpWrite : kOpRead, c.local, c.remote, c.bytes);
                break;
            }
            case device::kProxyGetInline: {
                if (c.bytes == 0 || c.bytes > 8) throw std::invalid_argument("an inline get of " +
                                                                            std::to_string(c.bytes) + " bytes");
                Pending& p = track();
                p.inlineGet = c.bytes;  // answered with the bytes once they are in the bounce area
                transfer(p, kOpRead, bounce(ticket), c.remote, c.bytes);
                break;
            }
            case device::kProxyAtomic: {
                Pending& p = track();
                p.atomic = start_atomic(c.pe, c.op, c.remote, c.value, c.compare, c.width);
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
            default:
                throw std::invalid_argument("unknown command " + std::to_string(c.command));
        }
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

void Proxy::finish(Pending& p) {
    for (uint64_t id : p.adhoc) {
        auto a = std::find_if(adhoc_.begin(), adhoc_.end(), [id](const Adhoc& x) { return x.id == id; });
        if (a == adhoc_.end() || --a->uses > 0) continue;
        adhoc_.erase(a);
        try {
            engine_->deregister_region(id);
        } catch (const std::exception& e) {
            fail(p.pe, std::string("releasing a buffer registered for a command: ") + e.what());
        }
    }
    p.adhoc.clear();
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
            p.atomic = start_atomic(p.pe, p.sigOp, p.sigOffset, p.sigValue, 0, 64);
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
            execute(c, tail_);
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
