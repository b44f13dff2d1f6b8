// The initiator side of the UCX engine: a transfer's blocks planned by mori-core's batch planner
// (batch/plan.hpp), dealt over the lanes of one worker and posted in one call by the calling
// thread; their completions (send and flush callbacks, the target's replies) fill the transfer's
// completion slot (see ucx/engine.hpp).
#include <algorithm>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <thread>

#include "base/trace.hpp"
#include "batch/plan.hpp"
#include "gpu/disjoint_ranges.hpp"
#include "ucx/wire.hpp"

namespace mori::ucx {

namespace {

// Blocks of host memory of at least this size (or the engine's eager_bytes, when larger: blocks
// that would go eager anyway) travel in a message of their own (UCX picks eager or zero-copy
// rendezvous); smaller ones are grouped, up to kGroupBytes (ucx/wire.hpp), into one eager message
// (256 KiB rather than 64: batches of 4 KiB blocks 20-30 % faster between namespaces on the 2-core
// VM, and no slower on one host, in alternating runs of ci/ucx_bench.py). Blocks of GPU memory
// staged at either end are grouped under kRndvWriteBytes (below): they are copied between the GPU
// and pinned memory and sent eager anyway, and a group costs one copy at each end where blocks
// of their own cost one each. (One H200, two namespaces, UCX tcp, 64 blocks, against 16 KiB for
// host memory and 64 KiB for staged GPU memory: host memory's 16, 64 and 128 KiB blocks written
// 2.4x, 1.2x and 1.1x as fast, read 2.7x, 1.5x and 1.2x; GPU memory's 64 KiB blocks read 1.5x.)
constexpr uint64_t kOwnMessageBytes = 16 << 10;
constexpr size_t kMaxEntries = 256;
// With several lanes, a transfer of fewer blocks than lanes is cut into pieces of at least this.
constexpr uint64_t kMinLanePiece = 256 << 10;
// Transfers this large wake the progress thread at once: their later steps need progress while
// the caller is away.
constexpr uint64_t kWakeBytes = 256 << 10;
// A write of at least this many bytes goes by rendezvous: UCX then moves it as data of its own
// instead of one message in fragments put back together at the target, and writes spread over
// several workers scale with them (2-4 times the bandwidth on 2-4 workers between namespaces
// on a 16-core machine, where eager writes stayed at one worker's, ci/ucx_bench.py --workers).
constexpr uint64_t kRndvWriteBytes = 256 << 10;
// A batch of at least twice this many bytes is spread over the engine's workers (Peer::spread),
// each worker's share at least this large.
constexpr uint64_t kSpreadPiece = 256 << 10;
// GPU memory that the engine stages (ucx/gpu.hpp) travels in pieces, each a message of its own,
// so that at each end the copy of one piece between the GPU and host memory runs while the
// network moves the others: a block's first piece is 1 MiB (its copy all that a send waits for), each
// next twice the one before, up to 4 MiB. One copy of a whole block, then its send, then its
// copy at the target had left mori.shmem's GPU heap at 27-75 % of host memory's bandwidth
// between namespaces on the H200 machine; pieces of 256 KiB were slower still (a message each),
// 1 and 4 MiB alike at 16 MiB, 4 MiB ahead at 64 MiB (ci/device/netns_bench.sh, 2026-11-28).
constexpr uint64_t kStageFirstPiece = 1 << 20;
constexpr uint64_t kStagePiece = 4 << 20;
// A transfer waiting for room in a full send queue looks again this often (finishing transfers
// do not signal it: the wait is rare and bounded).
constexpr auto kSendQueueLook = std::chrono::microseconds(200);

void on_send(void* request, api::Status status, void* user) {
    auto* part = static_cast<Part*>(user);
    fn().request_free(request);
    --part->ops;
    Worker& w = *part->link->worker;
    // A message's outcome is the target's reply; only a failed send decides it here.
    if (status != api::kOk)
        w.link_failed_locked(*part->link,
                             "sending to engine '" + part->link->peer->key + "' failed: " + status_text(status));
    w.retire_part_locked(*part);
}

void on_flush(void* request, api::Status status, void* user) {
    auto* part = static_cast<Part*>(user);
    fn().request_free(request);
    --part->ops;
    Worker& w = *part->link->worker;
    if (status == api::kOk)
        part->finish(kSuccess, "");
    else
        w.link_failed_locked(*part->link, std::string(part->op == kOpWrite ? "put" : "get") + " to engine '" +
                                              part->link->peer->key + "' failed: " + status_text(status));
    w.retire_part_locked(*part);
}

}  // namespace

RemoteRegion& Worker::remote_region_locked(Link& link, uint64_t id) {
    auto found = link.regions.find(id);
    if (found != link.regions.end()) return found->second;
    const auto& f = fn();
    Part::Answer answer;
    auto owned = std::make_unique<Part>();
    owned->op = kOpRegion;
    owned->link = &link;
    owned->ticket = link.peer->ticket;
    owned->header.resize(sizeof(RequestHeader) + sizeof(Entry));
    owned->answer = &answer;
    Part& part = add_part_locked(std::move(owned));
    const uint64_t partId = part.id;
    RequestHeader h{kMagic, kOpRegion, 0, 1, part.ticket, part.id, 0};
    Entry e{id, 0, 0};
    std::memcpy(part.header.data(), &h, sizeof(h));
    std::memcpy(part.header.data() + sizeof(h), &e, sizeof(e));
    api::RequestParam p{};
    p.opAttrMask = api::kOpCallback | api::kOpUserData | api::kOpFlags;
    p.flags = api::kAmSendReply | api::kAmSendEager;
    p.cb = reinterpret_cast<void*>(&on_send);
    p.userData = &part;
    api::StatusPtr r = f.am_send_nbx(link.eps[0], kAmRequest, part.header.data(), part.header.size(), nullptr, 0, &p);
    if (api::is_error_ptr(r))
        link_failed_locked(
            link, "asking engine '" + link.peer->key + "' about its memory failed: " + status_text(api::ptr_status(r)));
    else if (r != nullptr)
        ++part.ops;
    const int64_t deadline = now_ns() + static_cast<int64_t>(engine_.options().timeout * 1e9);
    while (answer.code == kInProgress && now_ns() < deadline) progress_locked();
    if (answer.code == kInProgress) {  // no answer in time: the part stays until its send ends
        if (Part* still = find_part_locked(partId)) {
            still->answer = nullptr;
            still->done = true;
            retire_part_locked(*still);
        }
        throw std::runtime_error("engine '" + link.peer->key + "' did not describe its memory id " +
                                 std::to_string(id) + " within " + seconds_text(engine_.options().timeout) + " s (" +
                                 engine_.options().timeoutSetting + ")");
    }
    if (answer.code != kSuccess) throw std::invalid_argument(answer.message);
    RemoteRegion& rr = link.regions[id];
    rr = answer.region;
    rr.keys.assign(link.eps.size(), nullptr);
    for (size_t lane = 0; lane < link.eps.size(); ++lane) {
        // The key comes from the target itself (its reply on our endpoint, to our ticket), never
        // from a descriptor: a malformed key cannot reach UCX's parser.
        api::Status s = f.ep_rkey_unpack(link.eps[lane], answer.rkey.data(), &rr.keys[lane]);
        if (s != api::kOk) {
            for (api::RemoteKey* k : rr.keys)
                if (k != nullptr) f.rkey_destroy(k);
            link.regions.erase(id);
            throw UcxError(
                "ucp_ep_rkey_unpack (memory id " + std::to_string(id) + " of engine '" + link.peer->key + "')", s);
        }
    }
    return rr;
}

namespace {

// Posts the puts or gets of one lane and the flush that completes them.
void post_rma(Part& part, api::Endpoint* ep, api::RemoteKey* key, uint64_t remoteBase, const plan::Row* rows,
              size_t n) {
    const auto& f = fn();
    api::RequestParam p{};
    p.opAttrMask = api::kOpMemh;
    p.memh = part.memh;
    for (size_t i = 0; i < n; ++i) {
        void* local = reinterpret_cast<void*>(rows[i].src);
        api::StatusPtr r = part.op == kOpWrite ? f.put_nbx(ep, local, rows[i].bytes, remoteBase + rows[i].dst, key, &p)
                                               : f.get_nbx(ep, local, rows[i].bytes, remoteBase + rows[i].dst, key, &p);
        if (api::is_error_ptr(r)) {
            part.link->worker->link_failed_locked(*part.link, std::string(part.op == kOpWrite ? "put" : "get") +
                                                                  " to engine '" + part.link->peer->key +
                                                                  "' failed: " + status_text(api::ptr_status(r)));
            break;  // what was posted still drains through the flush below
        }
        if (r != nullptr) f.request_free(r);  // released by UCX when done; the flush waits for it
    }
    api::RequestParam fp{};
    fp.opAttrMask = api::kOpCallback | api::kOpUserData;
    fp.cb = reinterpret_cast<void*>(&on_flush);
    fp.userData = &part;
    api::StatusPtr r = f.ep_flush_nbx(ep, &fp);
    if (r == nullptr)
        part.finish(kSuccess, "");
    else if (api::is_error_ptr(r))
        part.link->worker->link_failed_locked(
            *part.link, "flush to engine '" + part.link->peer->key + "' failed: " + status_text(api::ptr_status(r)));
    else
        ++part.ops;
}

// Posts one checked message: a write carries its blocks, a read asks for them. gpu: GPU memory
// left to UCX at either end; toStaging: the target receives the bytes in memory it stages.
void post_message(Part& part, api::Endpoint* ep, bool gpu, bool grouped, bool toStaging) {
    const auto& f = fn();
    api::RequestParam p{};
    p.opAttrMask = api::kOpCallback | api::kOpUserData | api::kOpFlags | api::kOpDatatype;
    // A grouped message is eager (its blocks are copied in); a write of one block goes by
    // rendezvous when it is GPU memory left to UCX or large (kRndvWriteBytes); a smaller one into
    // staged memory goes eager, and so does one of host memory under the engine's eager_bytes: UCX
    // would pick a rendezvous over tcp even for a few KiB, another round trip.
    const bool rndv = part.op == kOpWrite && !grouped && (gpu || part.bytes >= kRndvWriteBytes);
    const bool eager = grouped || (part.op == kOpWrite && !rndv &&
                                   (toStaging || (!gpu && part.bytes < part.link->worker->engine().eager_bytes())));
    p.flags = api::kAmSendReply | (eager ? api::kAmSendEager : 0) | (rndv ? api::kAmSendRndv : 0);
    p.cb = reinterpret_cast<void*>(&on_send);
    p.userData = &part;
    const void* data = nullptr;
    size_t count = 0;
    p.datatype = api::kDatatypeBytes;
    if (part.op == kOpWrite) {
        if (part.iov.size() == 1) {
            data = part.iov[0].buffer;
            count = part.iov[0].length;
            if (part.memh != nullptr) {
                p.opAttrMask |= api::kOpMemh;
                p.memh = part.memh;
            }
            // A staged part's bytes are host memory: said so, UCX does not ask the driver (whose
            // application context must not be needed, ucx/gpu.hpp).
            if (part.memType != api::kMemoryHost || !part.staged.empty()) {
                p.opAttrMask |= api::kOpMemoryType;
                p.memoryType = part.memType;
            }
        } else {
            data = part.iov.data();
            count = part.iov.size();
            p.datatype = api::kDatatypeIov;
        }
    }
    trace::mark('m', part.op);
    api::StatusPtr r = f.am_send_nbx(ep, kAmRequest, part.header.data(), part.header.size(), data, count, &p);
    trace::mark('M', part.op);
    if (api::is_error_ptr(r))
        part.link->worker->link_failed_locked(
            *part.link, "sending to engine '" + part.link->peer->key + "' failed: " + status_text(api::ptr_status(r)));
    else if (r != nullptr)
        ++part.ops;
}

// A transfer's local region, pinned while its parts are made (each part takes a pin of its own):
// a deregistration waits. Throws for a bad op or an unregistered id.
struct PinnedLocal {
    PinnedLocal(Engine& engine, Op op, uint64_t localId) {
        if (op != kOpRead && op != kOpWrite) throw std::invalid_argument("op must be read (1) or write (2)");
        region = engine.pin_region(localId);
        if (!region)
            throw std::invalid_argument("local memory id " + std::to_string(localId) +
                                        " is not registered with this engine");
    }
    PinnedLocal(const PinnedLocal&) = delete;
    PinnedLocal& operator=(const PinnedLocal&) = delete;
    ~PinnedLocal() { --region->pins; }
    std::shared_ptr<Region> region;
};

// Rows dealt into at most `runs` contiguous runs of about equal bytes, each at least minBytes
// (plan::deal_rows). Rows fewer than the runs are cut first (into `pieces`, at least minBytes
// each), so that every run gets a share. A worker's lanes and a spread transfer's workers are
// dealt this way.
struct Dealt {
    const plan::Row* rows;
    size_t count;
    std::vector<size_t> bounds;
};

Dealt deal(const plan::Row* rows, size_t n, uint64_t largest, size_t runs, uint64_t minBytes,
           std::vector<plan::Row>& pieces) {
    if (runs > 1 && n < runs && n > 0) {
        const uint64_t piece = std::max(minBytes, (largest + runs - 1) / runs);
        pieces.resize(plan::count_pieces(rows, n, piece));
        plan::stripe_rows(rows, n, piece, pieces.data());
        rows = pieces.data();
        n = pieces.size();
    }
    return Dealt{rows, n, plan::deal_rows(rows, n, runs, minBytes)};
}

// Each row of each run of d cut into pieces (into `pieces`), the runs kept: the first of a row
// `first` bytes, each next twice the one before up to `most`.
void cut_runs(Dealt& d, uint64_t first, uint64_t most, std::vector<plan::Row>& pieces) {
    pieces.clear();
    std::vector<size_t> bounds{0};
    for (size_t r = 0; r + 1 < d.bounds.size(); ++r) {
        for (size_t i = d.bounds[r]; i < d.bounds[r + 1]; ++i) {
            const plan::Row& row = d.rows[i];
            uint64_t piece = first;
            for (uint64_t done = 0; done < row.bytes; piece = std::min(2 * piece, most)) {
                const uint64_t n = std::min(piece, row.bytes - done);
                pieces.push_back(plan::Row{row.src + done, row.dst + done, n});
                done += n;
            }
        }
        bounds.push_back(pieces.size());
    }
    d = Dealt{pieces.data(), pieces.size(), std::move(bounds)};
}

}  // namespace

std::shared_ptr<Transfer> Peer::submit(Op op, uint64_t localId, const uint64_t* localOffs, uint64_t remoteId,
                                       const uint64_t* remoteOffs, const uint64_t* sizes, size_t n, uint64_t uid,
                                       bool notify, bool remoteGpu) {
    std::shared_ptr<Region> local = engine_->region(localId);
    if (!local)
        throw std::invalid_argument("local memory id " + std::to_string(localId) +
                                    " is not registered with this engine");
    // Offsets of 2^63 or more are refused by the merge; the rows are checked against the region
    // (pinned) by the batch form.
    auto i64 = [](const uint64_t* p) { return reinterpret_cast<const int64_t*>(p); };
    return submit(op, localId, plan::Batch::merge(local->addr, 0, i64(localOffs), i64(remoteOffs), i64(sizes), n),
                  remoteId, uid, notify, remoteGpu);
}

std::shared_ptr<Transfer> Peer::submit(Op op, uint64_t localId, const plan::Batch& batch, uint64_t remoteId,
                                       uint64_t uid, bool notify, bool remoteGpu) {
    const PinnedLocal pinned(*engine_, op, localId);
    const std::shared_ptr<Region>& local = pinned.region;
    // The rows are merged already (the batch is built once); each must lie in the local region.
    for (size_t i = 0; i < batch.size(); ++i) {
        const plan::Row& r = batch[i];
        if (r.src < local->addr || !local->contains(r.src - local->addr, r.bytes))
            throw std::invalid_argument("row " + std::to_string(i) + ": local address " + std::to_string(r.src) +
                                        " + size " + std::to_string(r.bytes) + " is outside local memory id " +
                                        std::to_string(localId) + " (" + std::to_string(local->size) + " bytes)");
        if (r.dst >= (uint64_t{1} << 63))
            throw std::invalid_argument("row " + std::to_string(i) + ": remote offset " + std::to_string(r.dst) +
                                        " is 2^63 or more");
    }
    // Transfers take the workers in turn, or all start on the first (round_robin off: the others
    // then carry shares of spread transfers only, and a small transfer wakes no second thread).
    const size_t w = engine_->options().roundRobin
                         ? static_cast<size_t>(next_.fetch_add(1, std::memory_order_relaxed) % links_.size())
                         : 0;
    // MORI's send queue (none when its depth is 0): one operation per row, a transfer larger than
    // the queue takes all of it.
    const uint64_t depth = engine_->options().sendQueue;
    SendQueue& queue = *queues_[w];
    const uint64_t need = depth == 0 ? 0 : std::min<uint64_t>(std::max<size_t>(batch.size(), 1), depth);
    if (need != 0 && !queue.take(need, depth)) {
        const int64_t until = now_ns() + static_cast<int64_t>(engine_->options().sendQueueWait * 1e9);
        while (!queue.take(need, depth)) {
            if (now_ns() >= until || closed_.load())
                return failed(w, uid, kErrTransport,
                              std::string("SQ full (") + (op == kOpWrite ? "write" : "read") + "): engine=" + key() +
                                  " worker=" + std::to_string(w) + " depth=" + std::to_string(queue.used.load()) +
                                  " requested=" + std::to_string(need) + " max=" + std::to_string(depth));
            std::this_thread::sleep_for(kSendQueueLook);
        }
    }
    std::shared_ptr<Transfer> t;
    try {
        t = spread(w, op, local, batch, remoteId, uid, notify, remoteGpu);
        if (!t) t = post(w, op, local, batch.begin(), batch.size(), batch.largest(), remoteId, uid, notify, remoteGpu);
    } catch (...) {
        queue.give(need);
        throw;
    }
    if (need != 0) t->holds(queues_[w], need);
    return t;
}

std::string Peer::closed_why() const {
    std::string why = state_->failure();
    return why.empty() ? "the peer engine '" + key() + "' was closed by this engine" : why;
}

std::shared_ptr<Transfer> Peer::failed(size_t w, uint64_t uid, int code, const std::string& why,
                                       const std::shared_ptr<Transfer>& parent) {
    auto t = std::make_shared<Transfer>(nullptr, links_[w], 1, now_ns(), false, uid);
    if (parent) t->reports_to(parent);
    t->fail(code, why);
    return t;
}

std::shared_ptr<Transfer> Peer::spread(size_t w, Op op, const std::shared_ptr<Region>& local, const plan::Batch& batch,
                                       uint64_t remoteId, uint64_t uid, bool notify, bool remoteGpu) {
    // Not on the RMA path (its rows are checked per worker as they are posted: a bad one would
    // leave the others posted) nor the same-host path (one copy per transfer at the target).
    const bool gpu = remoteGpu || local->gpu();
    if (links_.size() < 2 || engine_->options().rma || (sameHost_ && !gpu)) return nullptr;
    const size_t k = static_cast<size_t>(std::min<uint64_t>(links_.size(), batch.total_bytes() / kSpreadPiece));
    if (k < 2) return nullptr;
    std::vector<plan::Row> pieces;
    const auto [use, count, bounds] = deal(batch.begin(), batch.size(), batch.largest(), k, kSpreadPiece, pieces);
    if (bounds.size() < 3) return nullptr;
    const int64_t deadline = now_ns() + static_cast<int64_t>(engine_->options().timeout * 1e9);
    auto parent =
        std::make_shared<Transfer>(nullptr, nullptr, static_cast<int64_t>(bounds.size() - 1), deadline, notify, uid);
    std::vector<std::weak_ptr<Transfer>> children;
    for (size_t r = 0; r + 1 < bounds.size(); ++r) {
        uint64_t largest = 0;
        for (size_t i = bounds[r]; i < bounds[r + 1]; ++i) largest = std::max(largest, use[i].bytes);
        children.push_back(post((w + r) % links_.size(), op, local, use + bounds[r], bounds[r + 1] - bounds[r], largest,
                                remoteId, uid, false, remoteGpu, parent));
    }
    parent->spread_over(std::move(children));
    engine_->count(&EngineStats::spread);
    return parent;
}

namespace {

// One part of a transfer as planned: its rows [first, last) of the dealt rows, on a lane.
struct Planned {
    std::unique_ptr<Part> part;
    size_t lane;
    size_t first, last;
    uint64_t bytes;  // of its rows
    bool grouped;    // several small blocks in one message
};

// A small staged part whose copy was queued: posted once the copies of all were queued, so that
// the copies run back to back instead of one wait each (kCopyInPlaceBytes).
struct CopiedOut {
    Part* part;
    bool asHost;
    bool grouped;
};

// What a transfer's parts share while they are made and posted (worker lock held).
struct PartContext {
    Worker& worker;
    Link& link;
    Op op;
    const std::shared_ptr<Region>& local;
    const std::shared_ptr<Transfer>& transfer;
    uint64_t ticket, remoteId, uid;
    bool gpu, rma, targetNotes;
    bool remoteGpu;      // the remote memory is GPU memory
    bool peerStagesGpu;  // small staged writes go to it as host memory (eager)
    // GPU memory at either end is left to UCX: local GPU memory this engine does not stage, or
    // remote GPU memory the peer does not stage.
    bool gpuToUcx;
    std::shared_ptr<GpuWords> copyOut;  // a write's local GPU memory is copied out through it
    size_t parts;
};

// Check (RMA path): every row inside the remote region the target described.
void check_remote_rows(const RemoteRegion& rr, const Dealt& d, uint64_t remoteId, const std::string& key) {
    for (size_t i = 0; i < d.count; ++i)
        if (d.rows[i].dst > rr.size || d.rows[i].bytes > rr.size - d.rows[i].dst)
            throw std::invalid_argument("remote offset " + std::to_string(d.rows[i].dst) + " + size " +
                                        std::to_string(d.rows[i].bytes) + " is outside memory id " +
                                        std::to_string(remoteId) + " of engine '" + key + "' (" +
                                        std::to_string(rr.size) + " bytes)");
}

// Plan: the parts, one per lane (RMA), or one per message (checked path: blocks under ownBytes of
// a lane grouped, up to maxEntries and kGroupBytes, each other block a message of its own; 0:
// none grouped). A group scattered into staged GPU memory (`scatter`: the rows' field that
// addresses it, null for none) holds no two blocks landing on the same bytes.
std::vector<Planned> plan_parts(const Dealt& d, size_t firstLane, size_t lanes, bool rma, uint64_t ownBytes,
                                uint64_t plan::Row::* scatter, size_t maxEntries) {
    std::vector<Planned> planned;
    gpu::DisjointRanges landing;
    auto lands_apart = [&](const plan::Row& row) { return scatter == nullptr || landing.add(row.*scatter, row.bytes); };
    for (size_t r = 0; r + 1 < d.bounds.size(); ++r) {
        const size_t lane = (firstLane + r) % lanes;
        const size_t end = d.bounds[r + 1];
        for (size_t i = d.bounds[r]; i < end;) {
            size_t j = i + 1;
            uint64_t bytes = d.rows[i].bytes;
            if (rma) {
                for (; j < end; ++j) bytes += d.rows[j].bytes;
            } else if (d.rows[i].bytes < ownBytes) {
                landing.clear();
                lands_apart(d.rows[i]);
                while (j < end && j - i < maxEntries && d.rows[j].bytes < ownBytes &&
                       bytes + d.rows[j].bytes <= kGroupBytes && lands_apart(d.rows[j]))
                    bytes += d.rows[j++].bytes;
            }
            planned.push_back(Planned{std::make_unique<Part>(), lane, i, j, bytes, !rma && j - i > 1});
            i = j;
        }
    }
    return planned;
}

// A planned part handed to its worker, holding its own pin of the local region.
Part& open_part(PartContext& c, Planned& pl) {
    Part& part = c.worker.add_part_locked(std::move(pl.part));
    part.op = c.op;
    part.transfer = c.transfer;
    part.link = &c.link;
    part.lane = pl.lane;
    part.ticket = c.ticket;
    part.pins.push_back(c.local);
    part.memType = c.local->memType();
    if (c.rma || pl.last - pl.first == 1) part.memh = c.local->memh;
    ++c.local->pins;
    return part;
}

// Whether a read's reply must come by rendezvous: GPU memory left to UCX at either end (UCX's
// copy engines move it), or a large block. Staged at both ends (or host memory), a small reply
// or a group's comes eager: UCX would pick a rendezvous over tcp even for a few KiB, another
// round trip (a group's reply by rendezvous read 64 KiB blocks of GPU memory at two thirds of
// the rate, on the H200 machine).
bool reply_by_rndv(const PartContext& c, const Part& part, bool grouped) {
    return c.gpu && (c.gpuToUcx || (!grouped && part.bytes >= kRndvWriteBytes));
}

// The part's message: its header and entries (the one request entry), its local pieces.
void fill_message(PartContext& c, Part& part, const Planned& pl, const plan::Row* rows) {
    const size_t m = pl.last - pl.first;
    part.header.resize(sizeof(RequestHeader) + m * sizeof(Entry));
    auto* entries = reinterpret_cast<Entry*>(part.header.data() + sizeof(RequestHeader));
    part.iov.resize(m);
    for (size_t i = 0; i < m; ++i) {
        const plan::Row& row = rows[pl.first + i];
        entries[i] = Entry{c.remoteId, row.dst, row.bytes};
        part.iov[i] = api::Iov{reinterpret_cast<void*>(row.src), row.bytes};
    }
    part.bytes = pl.bytes;
    const uint8_t flags = (reply_by_rndv(c, part, m > 1) ? kFlagRndvReply : 0) | (c.targetNotes ? kFlagNotify : 0);
    const RequestHeader h{
        kMagic, c.op, flags, static_cast<uint16_t>(m), part.ticket, part.id, c.targetNotes ? c.uid : 0};
    std::memcpy(part.header.data(), &h, sizeof(h));
}

// A part from local GPU memory (one block, or a group of small ones gathered by one copy): its
// bytes copied to host memory (in the staging's CUDA context, ucx/gpu.hpp) and sent once there:
// in a transfer of small parts only (inPlace), its copy waited for with the others'
// (copiedOut), else while the network moves the parts before it. Either way the parts are sent
// in their order (the progress loop ends copies in the order queued), so that on one lane a
// later block lands after an earlier one.
void stage_out(PartContext& c, Part& part, bool grouped, bool inPlace, std::vector<CopiedOut>& copiedOut) {
    try {
        part.staged = c.copyOut->to_host(part.iov, inPlace && c.parts == 1);
        trace::mark('O', inPlace && c.parts == 1);
    } catch (const std::exception& e) {
        part.finish(kErrTransport, std::string("copying GPU memory to send it: ") + e.what());
        c.worker.retire_part_locked(part);
        return;
    }
    part.iov.assign(1, api::Iov{part.staged.data(), part.bytes});
    part.memType = api::kMemoryHost;
    part.memh = nullptr;
    // Into host memory, or a peer that stages its GPU memory, a small one goes as host memory
    // would (eager).
    const bool asHost = (!c.remoteGpu || c.peerStagesGpu) && part.bytes < kRndvWriteBytes;
    if (inPlace) {
        copiedOut.push_back(CopiedOut{&part, asHost, grouped});
        return;
    }
    ++part.ops;  // the copy: the part stays until it ended
    Part* p = &part;
    c.worker.after_copy_locked(part.staged, [p, gpu = c.gpu, asHost, grouped](const std::string& error) {
        Worker& on = *p->link->worker;
        --p->ops;
        if (!error.empty())
            p->finish(kErrTransport, "copying GPU memory to send it: " + error);
        else if (!p->done && p->link->failed.empty())
            post_message(*p, p->link->eps[p->lane], gpu && !asHost, grouped, asHost);
        on.retire_part_locked(*p);
    });
}

// Post: every planned part (RMA: its puts or gets and flush; checked: its message, staged ones
// once their copies ended); the bytes they carry.
uint64_t post_parts(PartContext& c, std::vector<Planned>& planned, const plan::Row* rows, RemoteRegion* rr) {
    uint64_t total = 0;
    std::vector<CopiedOut> copiedOut;
    const bool inPlace = c.copyOut && std::all_of(planned.begin(), planned.end(),
                                                  [](const Planned& pl) { return pl.bytes <= kCopyInPlaceBytes; });
    std::optional<gpu::Current> current;  // once for the transfer's copies, not per copy
    if (c.copyOut) current.emplace(c.copyOut->staging_config());
    for (Planned& pl : planned) {
        Part& part = open_part(c, pl);
        if (!c.link.failed.empty()) {  // an earlier part found the link broken
            part.finish(kErrTransport, c.link.failed);
        } else if (c.rma) {
            part.bytes = pl.bytes;
            total += part.bytes;
            post_rma(part, c.link.eps[pl.lane], rr->keys[pl.lane], rr->addr, rows + pl.first, pl.last - pl.first);
        } else {
            fill_message(c, part, pl, rows);
            total += part.bytes;
            if (c.copyOut) {
                stage_out(c, part, pl.grouped, inPlace, copiedOut);
                continue;  // retired there, or once posted
            }
            post_message(part, c.link.eps[pl.lane], c.gpuToUcx, pl.grouped, c.remoteGpu && c.peerStagesGpu);
        }
        c.worker.retire_part_locked(part);  // finished at once: the link broken, a flush or send done or failed
    }
    for (const CopiedOut& co : copiedOut) {
        Part& part = *co.part;
        try {
            part.staged.wait();
            post_message(part, c.link.eps[part.lane], c.gpu && !co.asHost, co.grouped, co.asHost);
        } catch (const std::exception& e) {
            part.finish(kErrTransport, std::string("copying GPU memory to send it: ") + e.what());
        }
        c.worker.retire_part_locked(part);
    }
    return total;
}

}  // namespace

std::shared_ptr<Transfer> Peer::post(size_t w, Op op, const std::shared_ptr<Region>& local, const plan::Row* rows,
                                     size_t nrows, uint64_t largest, uint64_t remoteId, uint64_t uid, bool notify,
                                     bool remoteGpu, const std::shared_ptr<Transfer>& parent) {
    trace::mark('T', op);
    Worker& worker = engine_->worker(w);
    Link& link = *links_[w];
    const bool gpu = remoteGpu || local->gpu();
    const bool rma = engine_->options().rma;
    const int64_t deadline = now_ns() + static_cast<int64_t>(engine_->options().timeout * 1e9);
    if (sameHost_ && !gpu) {
        if (engine_->closed()) throw std::runtime_error("the UCX engine is closed");
        if (closed_.load() || !state_->failure().empty()) return failed(w, uid, kErrTransport, closed_why(), parent);
        return sameHost_->post(op, local, rows, nrows, remoteId, uid, notify, deadline, &link);
    }
    std::unique_lock lk = worker.claim();
    if (!worker.alive()) throw std::runtime_error("the UCX engine is closed");
    // Closed: its links may be freed (checked under the worker's lock, which close takes too).
    if (closed_.load() || link.eps.empty() || !state_->failure().empty())
        return failed(w, uid, kErrTransport, closed_why(), parent);
    const size_t lanes = std::max<size_t>(1, link.eps.size());
    // The rows dealt over the lanes (a transfer of few blocks cut so that every lane gets a share).
    std::vector<plan::Row> pieces, stagePieces;
    Dealt dealt = deal(rows, nrows, largest, lanes, kMinLanePiece, pieces);
    // GPU memory this engine stages goes in pieces (kStagePiece); a write's from local GPU memory
    // are copied out as they are posted.
    std::shared_ptr<GpuWords> stager = gpu && !rma ? engine_->gpu_words() : nullptr;
    if (stager && !stager->stages()) stager = nullptr;
    if (stager) cut_runs(dealt, kStageFirstPiece, kStagePiece, stagePieces);
    RemoteRegion* rr = nullptr;
    if (rma && dealt.count > 0) {
        try {
            rr = &worker.remote_region_locked(link, remoteId);
        } catch (const std::invalid_argument& e) {
            return failed(w, uid, kErrNotFound, e.what(), parent);
        }
        check_remote_rows(*rr, dealt, remoteId, key());
    }
    const size_t maxEntries =
        std::max<size_t>(1, std::min(kMaxEntries, (worker.max_header() - sizeof(RequestHeader)) / sizeof(Entry)));
    // Small blocks are grouped unless GPU memory at either end is left to UCX; a group lands in
    // staged GPU memory by one scattered copy: the target's for a write, this engine's for a read.
    const bool gpuToUcx = (local->gpu() && !stager) || (remoteGpu && !stagesGpu_);
    uint64_t plan::Row::* scatter = nullptr;
    if (op == kOpWrite && remoteGpu && stagesGpu_) scatter = &plan::Row::dst;
    if (op == kOpRead && local->gpu() && stager) scatter = &plan::Row::src;
    const uint64_t ownBytes = gpuToUcx ? 0 : gpu ? kRndvWriteBytes : std::max(kOwnMessageBytes, engine_->eager_bytes());
    std::vector<Planned> planned =
        plan_parts(dealt, static_cast<size_t>(link.next++ % lanes), lanes, rma, ownBytes, scatter, maxEntries);
    // A transfer of one message asks its target to record the outcome (kFlagNotify): no note follows.
    const bool targetNotes = notify && !rma && planned.size() == 1;
    auto t = std::make_shared<Transfer>(engine_->worker_ptr(w), &link,
                                        std::max<int64_t>(1, static_cast<int64_t>(planned.size())), deadline,
                                        notify && !targetNotes, uid);
    if (parent) t->reports_to(parent);
    if (planned.empty()) {
        t->part_done(kSuccess, "");  // nothing to move; the notification still goes
        return t;
    }
    PartContext c{worker,         link,      op,         local,    t,
                  state_->ticket, remoteId,  uid,        gpu,      rma,
                  targetNotes,    remoteGpu, stagesGpu_, gpuToUcx, op == kOpWrite && local->gpu() ? stager : nullptr,
                  planned.size()};
    const uint64_t total = post_parts(c, planned, dealt.rows, rr);
    worker.track_locked(t);
    lk.unlock();
    if (total >= kWakeBytes) worker.wake();
    return t;
}

}  // namespace mori::ucx
