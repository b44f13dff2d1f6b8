// The UCX engine: its context and workers, registered memory, tickets and peers (see
// ucx/engine.hpp).
#include "ucx/engine.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <thread>

#include "same_host/window.hpp"

namespace mori::ucx {

namespace {

// A UCX setting the engine adds when `wanted`, unless the caller sets it (in `settings` or as
// UCX_<name> in the environment). Each one's reason is beside it in Engine::Engine.
struct DefaultSetting {
    const char* name;
    std::string value;
    bool wanted;
};

// The options, once checked (before any member is made from them).
EngineOptions checked(EngineOptions o) {
    if (o.workers < 1 || o.workers > 64) throw std::invalid_argument("workers must be 1..64");
    if (o.lanes < 1 || o.lanes > 64) throw std::invalid_argument("lanes must be 1..64");
    if (!(o.timeout > 0) || o.timeout > 1e6) throw std::invalid_argument("timeout must be > 0 seconds");
    if (o.maxInbound < 1 || !(o.inboundTtl > 0) || o.maxTickets < 1)
        throw std::invalid_argument("max_inbound, inbound_ttl and max_tickets must be positive");
    return o;
}

// Whether the caller's UCX_TLS lets UCX use a shared-memory transport.
bool uses_shared_memory(const EngineOptions& o) {
    std::string tls = "all";
    for (const auto& [k, v] : o.settings)
        if (k == "TLS") tls = v;
    return tls.find("sm") != std::string::npos || tls.find("posix") != std::string::npos ||
           tls.find("sysv") != std::string::npos || tls.find("all") != std::string::npos || tls[0] == '^';
}

}  // namespace

std::string Engine::configure(api::Config* cfg) {
    const auto& f = fn();
    std::string chosen;
    for (const auto& [k, v] : opts_.settings) {
        api::Status s = f.config_modify(cfg, k.c_str(), v.c_str());
        if (s != api::kOk) throw std::invalid_argument("UCX setting " + k + "=" + v + " refused: " + status_text(s));
        chosen += (chosen.empty() ? "" : ", ") + k + "=" + v;
        settings_.emplace_back(k, v);
    }
    char keepalive[32];
    std::snprintf(keepalive, sizeof(keepalive), "%.3fs", std::clamp(opts_.timeout / 3, 1.0, 20.0));
    // UCX 1.13 applies a transport's setting to every transport and warns for each one that lacks it.
    const Library& lib = library();
    const bool takesTransportSettings = lib.major > 1 || lib.minor >= 19;
    const DefaultSetting defaults[] = {
        // Shared-memory transports (posix, sysv) declare peer-failure support, so that endpoints
        // created with peer-failure detection keep using them (without it UCX leaves them out and
        // one host talks over tcp).
        {"MM_ERROR_HANDLING", "y", uses_shared_memory(opts_)},
        // Dead peers are found by keepalive (on shared memory: the peer's pid) every third of the
        // timeout (1 to 20 s; UCX's default is 20 s), so that what a dead peer left in flight (a
        // reply a target was sending it) ends well within the timeout, and with it its pins.
        {"KEEPALIVE_INTERVAL", keepalive, true},
        // tcp carries raw puts to any address a peer names (it has no remote keys): a checked
        // engine's memory is reached only through its own checks.
        {"TCP_PUT_ENABLE", "n", takesTransportSettings && !opts_.rma},
    };
    for (const DefaultSetting& d : defaults) {
        bool skip = !d.wanted || std::getenv(("UCX_" + std::string(d.name)).c_str()) != nullptr;
        for (const auto& kv : opts_.settings) skip = skip || kv.first == d.name;
        if (!skip && f.config_modify(cfg, d.name, d.value.c_str()) == api::kOk) settings_.emplace_back(d.name, d.value);
    }
    return chosen;
}

Engine::Engine(EngineOptions opts)
    : opts_(checked(std::move(opts))),
      regions_([this](Region& r) { release_region(r); }),
      tickets_(TicketRules{opts_.maxTickets}),
      inbound_(inbound_table(opts_.inbound, opts_.maxInbound, opts_.inboundTtl)) {
    const Library& lib = library();
    const auto& f = fn();
    api::Config* cfg = nullptr;
    check("ucp_config_read", f.config_read(nullptr, nullptr, &cfg));
    std::string chosen;
    try {
        chosen = configure(cfg);
    } catch (...) {
        f.config_release(cfg);
        throw;
    }
    api::Params p{};
    p.fieldMask = api::kParamFeatures | api::kParamMtWorkersShared | api::kParamName;
    // Without UCP_FEATURE_RMA UCX installs no handlers for its emulated puts and gets (which
    // write and read any address a peer names over tcp and shared memory): a checked engine is
    // reached only through its own active messages.
    p.features = api::kFeatureAm | api::kFeatureWakeup | (opts_.rma ? api::kFeatureRma : 0);
    p.mtWorkersShared = 1;
    p.name = opts_.name.c_str();
    api::Status s = f.init_version(1, 13, &p, cfg, &ctx_);
    f.config_release(cfg);
    if (s != api::kOk)
        throw std::runtime_error("UCX (" + lib.path + ") found no usable transport or device (" +
                                 (chosen.empty() ? std::string("UCX's defaults") : chosen) + "): " + status_text(s));
    api::ContextAttr attr{};
    attr.fieldMask = api::kAttrMemoryTypes;
    if (f.context_query(ctx_, &attr) == api::kOk) cuda_ = (attr.memoryTypes >> api::kMemoryCuda) & 1;
    try {
        for (int i = 0; i < opts_.workers; ++i) {
            workers_.push_back(std::make_shared<Worker>(*this, i));
            workers_.back()->start();
        }
        if (opts_.sameHost) sameHost_ = std::make_unique<SameHostService>(*this);
        // Same-host initiators note their direct copies in shared memory: recorded before a lookup.
        if (sameHost_ && sameHost_->window()) noteFeed_ = inbound_->add_feed([w = sameHost_->window()] { w->drain(); });
    } catch (...) {
        close();
        throw;
    }
}

Engine::~Engine() { close(); }

void Engine::close() {
    if (closed_.exchange(true)) return;
    if (noteFeed_ != 0) inbound_->remove_feed(noteFeed_);  // the window goes with the service
    if (sameHost_) sameHost_->stop();                      // its links' transfers fail; the connections it served close
    for (auto& w : workers_) w->destroy();
    regions_.clear();
    if (ctx_ != nullptr) fn().cleanup(ctx_);
    ctx_ = nullptr;
}

std::vector<std::string> Engine::addresses() const {
    std::vector<std::string> out;
    for (const auto& w : workers_) out.push_back(w->address());
    return out;
}

std::string Engine::describe() const {
    if (ctx_ == nullptr) return "";
    return print_to_string([this](FILE* f) { fn().context_print_info(ctx_, f); });
}

void Engine::set_eager_bytes(uint64_t n) {
    if (n > kMaxEagerBytes)
        throw std::invalid_argument("eager_bytes must be 0.." + std::to_string(kMaxEagerBytes) + ", got " +
                                    std::to_string(n));
    eagerBytes_.store(n, std::memory_order_relaxed);
}

void Engine::release_region(Region& r) {
    if (r.memh != nullptr && ctx_ != nullptr) fn().mem_unmap(ctx_, r.memh);
    r.memh = nullptr;
}

std::string Engine::register_region(uint64_t id, uint64_t addr, uint64_t size, bool cuda) {
    if (closed_.load()) throw std::runtime_error("the UCX engine is closed");
    uint64_t end;
    if (addr == 0 || size == 0 || __builtin_add_overflow(addr, size, &end))
        throw std::invalid_argument("memory to register must be a non-empty range of addresses");
    // GPU memory the engine stages (ucx/gpu.hpp) is never handed to UCX: not registered with it
    // either (its CUDA support would query the memory in the application's context), nor does it
    // need UCX's CUDA support.
    const std::shared_ptr<GpuWords> stager = cuda ? gpu_words() : nullptr;
    const bool staged = stager && stager->stages();
    if (cuda && !staged && !cuda_)
        throw std::invalid_argument("this UCX (" + library().path +
                                    ") has no CUDA support and the engine does not "
                                    "stage GPU memory: GPU memory cannot be registered");
    const auto& f = fn();
    auto r = std::make_shared<Region>();
    r->id = id;
    r->addr = addr;
    r->size = size;
    r->kind = cuda ? MemoryKind::kGpu : MemoryKind::kHost;
    api::MemMapParams p{};
    p.fieldMask = api::kMemMapAddress | api::kMemMapLength | api::kMemMapMemoryType;
    p.address = reinterpret_cast<void*>(addr);
    p.length = size;
    p.memoryType = r->memType();
    if (!staged) {
        check("ucp_mem_map (" + std::string(cuda ? "GPU" : "host") + " memory at " + std::to_string(addr) + ", " +
                  std::to_string(size) + " bytes)",
              f.mem_map(ctx_, &p, &r->memh));
        void* buf = nullptr;
        size_t len = 0;
        api::Status s = f.rkey_pack(ctx_, r->memh, &buf, &len);
        if (s != api::kOk) {
            release_region(*r);
            throw UcxError("ucp_rkey_pack", s);
        }
        r->rkey.assign(static_cast<const char*>(buf), len);
        f.rkey_buffer_release(buf);
    }
    std::string rkey = r->rkey;
    if (!regions_.add(r)) {
        release_region(*r);
        throw std::invalid_argument("memory id " + std::to_string(id) + " is already registered");
    }
    // Host memory is offered to same-host initiators' direct copies (same_host/window.hpp).
    if (!cuda && sameHost_ && sameHost_->window()) sameHost_->window()->publish(id, addr, size);
    return rkey;
}

bool Engine::deregister_region(uint64_t id) {
    // Accesses in flight end within the timeout (their transfers fail at it, and their
    // endpoints are closed, which ends UCX's operations on them): nothing to cut.
    const int64_t deadline = now_ns() + static_cast<int64_t>((opts_.timeout + 5.0) * 1e9);
    // Same-host initiators' direct copies first: none starts after this, those running end.
    const bool unpinned = !sameHost_ || !sameHost_->window() || sameHost_->window()->withdraw(id, deadline);
    switch (regions_.deregister(id, deadline)) {
        case RegionTable<Region>::Ended::kUnknown: return false;
        case RegionTable<Region>::Ended::kReleased:
            if (unpinned) return true;
            break;
        case RegionTable<Region>::Ended::kStillPinned: break;
    }
    throw std::runtime_error("memory id " + std::to_string(id) + ": transfers still use it after the timeout (" +
                             opts_.timeoutSetting +
                             "); it is no longer served, but stays mapped until they end: do not free it yet");
}

std::string Engine::same_host_address() const {
    return sameHost_ ? same_host::contact(opts_.hostKey, sameHost_->socket_name()) : std::string();
}

std::shared_ptr<Peer> Engine::connect(const std::string& key, const std::vector<std::string>& addresses,
                                      uint64_t ticket, const std::string& sameHost, bool stagesGpu) {
    if (closed_.load()) throw std::runtime_error("the UCX engine is closed");
    if (key.empty()) throw std::invalid_argument("engine key must not be empty");
    if (addresses.empty()) throw std::invalid_argument("the peer engine sent no worker address");
    for (const auto& a : addresses)
        if (a.empty() || a.size() > (1 << 20))
            throw std::invalid_argument("malformed worker address of engine '" + key + "'");
    if (ticket == 0) throw std::invalid_argument("ticket must be non-zero");
    auto state = std::make_shared<PeerState>(key, ticket);
    std::vector<Link*> links;
    try {
        for (size_t i = 0; i < workers_.size(); ++i) {
            Worker& w = *workers_[i];
            auto lk = w.claim();
            links.push_back(w.connect_locked(state, addresses[i % addresses.size()], opts_.lanes));
        }
    } catch (...) {
        for (size_t i = 0; i < links.size(); ++i) {
            auto lk = workers_[i]->claim();
            workers_[i]->close_link_locked(*links[i], "could not connect");
        }
        throw;
    }
    // The same-host path, when the peer offers it and runs on this host: the UCX endpoints stay
    // for what it does not carry (GPU memory, atomics) and for a peer that refuses it.
    std::shared_ptr<SameHostLink> local;
    std::string refusal;
    const std::string socket = sameHost_ ? same_host::reachable_socket(sameHost, opts_.hostKey) : std::string();
    if (!socket.empty()) {
        local = SameHostLink::open(*this, state, socket, refusal);
        if (local) sameHost_->add_link(local);
    }
    auto peer = std::make_shared<Peer>(shared_from_this(), state, std::move(links), local, refusal, stagesGpu);
    std::shared_ptr<Peer> old;
    {
        std::lock_guard lk(peersMu_);
        for (auto it = peers_.begin(); it != peers_.end();)
            it = it->second.expired() ? peers_.erase(it) : std::next(it);
        old = peers_[key].lock();
        peers_[key] = peer;
    }
    if (old) old->close();
    return peer;
}

void Engine::fail_peer(const std::string& key, const std::string& why) {
    std::shared_ptr<Peer> p;
    {
        std::lock_guard lk(peersMu_);
        auto it = peers_.find(key);
        if (it != peers_.end()) p = it->second.lock();
    }
    if (p) p->fail(why);
}

EngineStats Engine::stats() const {
    std::lock_guard lk(statsMu_);
    EngineStats s = stats_;
    s.badTickets = tickets_.bad();
    if (sameHost_ && sameHost_->window()) s.malformed += sameHost_->window()->malformed();
    return s;
}

void Engine::count(uint64_t EngineStats::* field) {
    std::lock_guard lk(statsMu_);
    ++(stats_.*field);
}

// ---- Peer --------------------------------------------------------------------------------------

Peer::Peer(std::shared_ptr<Engine> engine, std::shared_ptr<PeerState> state, std::vector<Link*> links,
           std::shared_ptr<SameHostLink> sameHost, std::string sameHostRefusal, bool stagesGpu)
    : engine_(std::move(engine)),
      state_(std::move(state)),
      links_(std::move(links)),
      sameHost_(std::move(sameHost)),
      sameHostRefusal_(std::move(sameHostRefusal)),
      stagesGpu_(stagesGpu) {
    for (size_t i = 0; i < links_.size(); ++i) queues_.push_back(std::make_shared<SendQueue>());
}

Peer::~Peer() { close(); }

bool Peer::healthy() const { return !closed_.load() && state_->failure().empty(); }

void Peer::fail(const std::string& why) {
    state_->fail(why);
    close();
}

void Peer::close() {
    if (closed_.exchange(true) || engine_->closed()) return;
    if (sameHost_) {
        std::string why = state_->failure();
        sameHost_->fail(why.empty() ? "the peer was closed by this engine" : why);
        engine_->same_host()->remove_link(sameHost_.get());
    }
    for (size_t i = 0; i < links_.size(); ++i) {
        Worker& w = engine_->worker(i);
        auto lk = w.claim();
        if (!w.alive()) continue;
        if (!links_[i]->eps.empty()) {
            std::string why = state_->failure();
            w.close_link_locked(*links_[i], why.empty() ? "the peer was closed by this engine" : why);
        }
        links_[i]->held = false;  // the worker frees it once nothing in flight refers to it
    }
}

std::string Peer::same_host_path() const {
    if (!sameHost_) return "";
    return sameHost_->direct() ? "direct" : "served: " + sameHost_->direct_refusal();
}

std::string Peer::describe() {
    std::string out;
    for (size_t i = 0; i < links_.size(); ++i) {
        Worker& w = engine_->worker(i);
        auto lk = w.claim();
        if (closed_.load() || !w.alive()) break;  // the links may be freed
        for (api::Endpoint* ep : links_[i]->eps) out += print_to_string([ep](FILE* f) { fn().ep_print_info(ep, f); });
    }
    return out;
}

}  // namespace mori::ucx
