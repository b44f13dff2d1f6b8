// The UCX engine's active-message handlers: the target checks every request against its live
// registrations before its memory is touched, then moves the bytes (eager copy, or UCX's
// zero-copy rendezvous); the initiator matches replies to its messages in flight.
// Handlers run inside ucp_worker_progress, with the worker lock held.
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "base/copy_for_device.hpp"
#include "base/trace.hpp"
#include "gpu/disjoint_ranges.hpp"
#include "ucx/wire.hpp"

namespace mori::ucx {

namespace {

void on_serve_sent(void* request, api::Status status, void* user) {
    fn().request_free(request);
    std::unique_ptr<Serve> s(static_cast<Serve*>(user));  // unpins what the reply read
    if (status == api::kOk) s->record(s->reply.code);     // a read's bytes have left
}

// Sends s's reply (with data: iov or s.body) on its reply endpoint; s is freed when UCX is done.
void send_reply(std::unique_ptr<Serve> s, bool rndv, int memType) {
    const auto& f = fn();
    api::RequestParam p{};
    p.opAttrMask = api::kOpCallback | api::kOpUserData | api::kOpDatatype | api::kOpFlags;
    p.cb = reinterpret_cast<void*>(&on_serve_sent);
    p.userData = s.get();
    p.datatype = api::kDatatypeBytes;
    // Staged bytes the initiator did not ask to receive by rendezvous go eager, and so do host
    // bytes under the engine's eager_bytes (UCX would pick a rendezvous over tcp even for a few
    // KiB: another round trip).
    p.flags = rndv ? api::kAmSendRndv : (s->stager ? api::kAmSendEager : 0);
    const void* data = nullptr;
    size_t count = 0;
    if (!s->body.empty()) {
        data = s->body.data();
        count = s->body.size();
        p.flags = api::kAmSendEager;
    } else if (s->iov.size() == 1) {
        data = s->iov[0].buffer;
        count = s->iov[0].length;
        // The registration's own handle. Without one UCX takes a handle from its registration
        // cache, which for registered memory is the registration's own: a rendezvous send whose
        // peer fails before it answers then completes only once that handle is released (UCX
        // invalidates it first), i.e. when the memory is unmapped. The reply, and its pin, never
        // ended, and at close UCX completed it on the destroyed worker (heap corruption).
        if (!s->stager && s->pins[0]->memh != nullptr) {
            p.opAttrMask |= api::kOpMemh;
            p.memh = s->pins[0]->memh;
        }
        if (memType != api::kMemoryHost || s->stager) {  // staged bytes: host, said so (ucx/gpu.hpp)
            p.opAttrMask |= api::kOpMemoryType;
            p.memoryType = memType;
        }
        if (!rndv && memType == api::kMemoryHost && count < s->worker->engine().eager_bytes())
            p.flags = api::kAmSendEager;
    } else if (!s->iov.empty()) {
        data = s->iov.data();
        count = s->iov.size();
        p.datatype = api::kDatatypeIov;
        if (!rndv) p.flags = api::kAmSendEager;
    }
    trace::mark('n');
    api::StatusPtr r = f.am_send_nbx(s->replyEp, kAmReply, &s->reply, sizeof(s->reply), data, count, &p);
    trace::mark('N');
    if (r == nullptr)
        s->record(s->reply.code);  // sent at once
    else if (!api::is_error_ptr(r))
        s.release();  // on_serve_sent frees it
}

// Answers h with a refusal instead of what s (made for h) would have sent; its outcome is
// recorded if h asked.
void refuse(std::unique_ptr<Serve> s, const RequestHeader& h, uint32_t reason, uint32_t entry) {
    s->worker->engine().count(&EngineStats::refused);
    s->drop_blocks();
    s->reply = ReplyHeader{kMagic, reason_code(reason), h.ticket, h.part, reason, entry};
    s->record(s->reply.code);
    send_reply(std::move(s), false, api::kMemoryHost);
}

// Runs then(s, error) once the copy into or out of s's staged memory ended ("") or failed (why),
// from a later progress of s's worker (Worker::after_copy_locked). Worker lock held.
template <class Then>
void after_copy(std::unique_ptr<Serve> s, Then then) {
    Worker& w = *s->worker;
    Staged& staged = s->staged;
    auto held = std::make_shared<std::unique_ptr<Serve>>(std::move(s));  // std::function copies
    w.after_copy_locked(staged, [held, then](const std::string& error) { then(std::move(*held), error); });
}

// Refuses a read of GPU memory whose copy to host memory failed (why).
void refuse_read(std::unique_ptr<Serve> s, const RequestHeader& h, const std::string& why) {
    std::fprintf(stderr, "mori UCX engine: a read of GPU memory failed: %s\n", why.c_str());
    refuse(std::move(s), h, kReasonFailed, 0);
}

// Answers a write (its outcome recorded first) once its bytes are in. The answer carries no
// data: the blocks are dropped from it first (send_reply would send them back).
void reply_written(std::unique_ptr<Serve> s) {
    s->record(s->reply.code);
    s->drop_blocks();  // the bytes are in: the regions are free before the initiator hears so
    send_reply(std::move(s), false, api::kMemoryHost);
}

void say_write_failed(const std::string& why) {
    std::fprintf(stderr, "mori UCX engine: a write into GPU memory failed: %s\n", why.c_str());
}

void write_failed(Serve& s, const std::string& why) {
    say_write_failed(why);
    s.reply.code = kErrTransport;
    s.reply.reason = kReasonFailed;
}

// Answers a write once its bytes are in: a staged write's, received in host memory, once copied
// to their place on the GPU, a copy that runs while the worker takes the next messages
// (Worker::after_copy_locked: however small, so that the copies of a batch's blocks overlap
// instead of one wait each on the worker's thread). Worker lock held.
void answer_write(std::unique_ptr<Serve> s) {
    if (s->reply.code == kSuccess && s->stager) {
        try {
            s->stager->to_device(s->iov, s->staged, false);
            trace::mark('K');
            after_copy(std::move(s), [](std::unique_ptr<Serve> s, const std::string& error) {
                if (!error.empty()) write_failed(*s, error);
                reply_written(std::move(s));
            });
            return;
        } catch (const std::exception& e) {
            write_failed(*s, e.what());
        }
    }
    reply_written(std::move(s));
}

void on_written(void* request, api::Status status, size_t, void* user) {
    fn().request_free(request);
    std::unique_ptr<Serve> s(static_cast<Serve*>(user));
    if (status != api::kOk) return;  // the initiator's endpoint failed: it has failed the part
    answer_write(std::move(s));
}

// A read's bytes are in: the part ends, a staged read's once they are copied from host memory
// to the part's GPU memory, a copy that runs while the worker takes the next replies (however
// small: a batch's copies overlap). Lock held.
void land(Part& part) {
    if (part.staged.empty()) {
        part.finish(kSuccess, "");
        return;
    }
    try {
        const std::shared_ptr<GpuWords> stager = part.link->worker->engine().gpu_words();
        if (!stager) throw std::runtime_error("the engine no longer serves GPU memory");
        stager->to_device(part.iov, part.staged, false);
        trace::mark('L');
        ++part.ops;  // the copy: the part stays until it ended
        Part* p = &part;
        part.link->worker->after_copy_locked(part.staged, [p](const std::string& error) {
            --p->ops;
            if (error.empty())
                p->finish(kSuccess, "");
            else
                p->finish(kErrTransport, "copying what was read into GPU memory: " + error);
            p->link->worker->retire_part_locked(*p);
        });
    } catch (const std::exception& e) {
        part.finish(kErrTransport, std::string("copying what was read into GPU memory: ") + e.what());
    }
}

void on_read_data(void* request, api::Status status, size_t, void* user) {
    fn().request_free(request);
    auto* part = static_cast<Part*>(user);
    --part->ops;
    Worker& w = *part->link->worker;
    if (status == api::kOk) {
        land(*part);
    } else {
        w.link_failed_locked(*part->link,
                             "receiving from engine '" + part->link->peer->key + "' failed: " + status_text(status));
    }
    w.retire_part_locked(*part);
}

}  // namespace

namespace {

// Check: a request's shape and ticket. Its header into h and its initiator's key, or "" when it
// is dropped (counted; rendezvous data too).
std::string admit_request(Engine& eng, const void* header, size_t headerLength, const api::AmRecvParam* param,
                          RequestHeader& h) {
    if (headerLength < sizeof(h) || (param->recvAttr & api::kAmRecvReplyEp) == 0 || param->replyEp == nullptr) {
        eng.count(&EngineStats::malformed);
        return "";
    }
    std::memcpy(&h, header, sizeof(h));
    const size_t n = h.count;
    if (h.magic != kMagic || (h.flags & ~kFlagsKnown) != 0 || headerLength != sizeof(h) + n * sizeof(Entry) || n == 0 ||
        (h.op != kOpRead && h.op != kOpWrite && h.op != kOpRegion)) {
        eng.count(&EngineStats::malformed);
        return "";
    }
    return eng.tickets().admit(h.ticket);  // "" (counted) for no valid ticket
}

// A region request (the RMA path): what the target tells of one of its regions.
void serve_region(std::unique_ptr<Serve> s, const RequestHeader& h, const uint8_t* entries, size_t length) {
    Engine& eng = s->worker->engine();
    if (!eng.options().rma) return refuse(std::move(s), h, kReasonChecked, 0);  // no key for one-sided RMA
    Entry e;
    std::memcpy(&e, entries, sizeof(e));
    std::shared_ptr<Region> r = eng.region(e.memId);
    if (!r || h.count != 1 || length != 0) return refuse(std::move(s), h, r ? kReasonShape : kReasonMemory, 0);
    RegionInfo info{r->addr, r->size, r->memType(), static_cast<uint32_t>(r->rkey.size())};
    s->body.assign(reinterpret_cast<const char*>(&info), sizeof(info));
    s->body += r->rkey;
    send_reply(std::move(s), false, api::kMemoryHost);
}

// Check: every block against the region table (Engine::acquire: the regions stay pinned in s,
// deregistration waiting, until UCX has finished with them), then the engine's rule for GPU
// memory: left to UCX, one block a message, moved only by rendezvous (UCX's copy engines; a
// copy-in message would have the target's CPU write it); staged (stager), a write may come eager
// and a read's reply may go eager, and small blocks may come grouped (every block GPU memory, at
// most kGroupBytes: one gathered or scattered copy). The blocks' bytes and memory type; false
// when s was refused (and answered).
bool check_blocks(std::unique_ptr<Serve>& s, const RequestHeader& h, const uint8_t* entries, bool rndv, bool staged,
                  uint64_t& total, int& memType) {
    Engine& eng = s->worker->engine();
    const size_t n = h.count;
    s->iov.resize(n);
    size_t gpuBlocks = 0;
    gpu::DisjointRanges landing;  // a staged group's blocks (writes)
    for (size_t i = 0; i < n; ++i) {
        Entry e;
        std::memcpy(&e, entries + i * sizeof(Entry), sizeof(e));
        uint32_t reason = kReasonNone;
        std::shared_ptr<Region> r = eng.acquire(e, reason);
        if (r) s->pins.push_back(r);  // unpinned when s goes
        if (r && r->gpu()) {
            const bool byMessage = (h.op == kOpWrite && !rndv) || (h.op == kOpRead && !(h.flags & kFlagRndvReply));
            if (staged ? gpuBlocks != i : (n != 1 || byMessage)) reason = kReasonGpu;
            memType = r->memType();
            ++gpuBlocks;
        } else if (r && gpuBlocks != 0) {
            reason = kReasonGpu;  // host memory grouped with GPU memory
        }
        if (reason == kReasonNone && gpuBlocks != 0 && n > 1) {
            if (total + e.size > kGroupBytes)
                reason = kReasonShape;
            else if (h.op == kOpWrite && !landing.add(r->addr + e.offset, e.size))
                reason = kReasonGpu;  // blocks landing on the same bytes: one scattered copy cannot order them
        }
        if (reason != kReasonNone) {
            refuse(std::move(s), h, reason, static_cast<uint32_t>(i));
            return false;
        }
        s->iov[i] = api::Iov{reinterpret_cast<void*>(r->addr + e.offset), e.size};
        total += e.size;
    }
    return true;
}

// Post: a read's reply with its bytes; GPU memory the engine stages once copied to host memory
// (however small: a batch's copies overlap), while others are sent.
void serve_read(std::unique_ptr<Serve> s, const RequestHeader& h, size_t length, uint64_t total, int memType) {
    if (length != 0) return refuse(std::move(s), h, kReasonShape, 0);
    const bool rndvReply = (h.flags & kFlagRndvReply) != 0;
    if (!s->stager) return send_reply(std::move(s), rndvReply, memType);
    try {
        s->staged = s->stager->to_host(s->iov, false);
        trace::mark('K');
    } catch (const std::exception& e) {
        return refuse_read(std::move(s), h, e.what());
    }
    s->iov.assign(1, api::Iov{s->staged.data(), total});
    after_copy(std::move(s), [h, rndvReply](std::unique_ptr<Serve> s, const std::string& error) {
        if (error.empty()) return send_reply(std::move(s), rndvReply, api::kMemoryHost);
        refuse_read(std::move(s), h, error);
    });
}

// Post: a rendezvous write's bytes received by UCX into their blocks (staged: into host memory),
// answered once they are in (on_written). What the handler returns to UCX.
api::Status receive_write(std::unique_ptr<Serve> s, void* data, int memType) {
    api::RequestParam p{};
    p.opAttrMask = api::kOpCallback | api::kOpUserData | api::kOpDatatype;
    p.cb = reinterpret_cast<void*>(&on_written);
    p.userData = s.get();
    void* buffer = s->iov.data();
    size_t count = s->iov.size();
    p.datatype = api::kDatatypeIov;
    if (s->stager) {
        buffer = s->staged.data();
        count = s->staged.size();
        p.datatype = api::kDatatypeBytes;
        p.opAttrMask |= api::kOpMemoryType;
        p.memoryType = api::kMemoryHost;
    } else if (s->iov.size() == 1) {
        buffer = s->iov[0].buffer;
        count = s->iov[0].length;
        p.datatype = api::kDatatypeBytes;
        if (s->pins[0]->memh != nullptr) {
            p.opAttrMask |= api::kOpMemh;
            p.memh = s->pins[0]->memh;
        }
        if (memType != api::kMemoryHost) {
            p.opAttrMask |= api::kOpMemoryType;
            p.memoryType = memType;
        }
    }
    api::StatusPtr r = fn().am_recv_data_nbx(s->worker->handle(), data, buffer, count, &p);
    if (api::is_error_ptr(r)) {
        s->reply.code = kErrTransport;
        s->reply.reason = kReasonFailed;
    } else if (r != nullptr) {
        s.release();  // on_written owns it
        return api::kInProgress;
    }
    answer_write(std::move(s));  // received at once (no callback), or failed
    return api::kOk;
}

// Post: a write's bytes into their blocks (eager: they are here; rendezvous: receive_write),
// then its answer.
api::Status serve_write(std::unique_ptr<Serve> s, const RequestHeader& h, void* data, size_t length, uint64_t total,
                        bool rndv, int memType) {
    if (length != total) {
        refuse(std::move(s), h, kReasonShape, 0);
        return api::kOk;
    }
    if (s->stager) {  // staged: received in host memory, copied to the GPU before the answer
        try {
            s->staged = s->stager->landing(total);
        } catch (const std::exception& e) {
            say_write_failed(e.what());
            refuse(std::move(s), h, kReasonFailed, 0);
            return api::kOk;
        }
    }
    if (rndv) return receive_write(std::move(s), data, memType);
    if (s->stager) {
        copy_for_device(s->staged.data(), data, total);
    } else {
        const auto* src = static_cast<const uint8_t*>(data);
        for (const api::Iov& v : s->iov) {
            std::memcpy(v.buffer, src, v.length);
            src += v.length;
        }
    }
    answer_write(std::move(s));
    return api::kOk;
}

}  // namespace

api::Status Serve::on_request(Worker& w, const void* header, size_t headerLength, void* data, size_t length,
                              const api::AmRecvParam* param) {
    Engine& eng = w.engine();
    RequestHeader h;
    std::string key = admit_request(eng, header, headerLength, param, h);
    if (key.empty()) return api::kOk;
    trace::mark('G', h.op);
    const auto* entries = reinterpret_cast<const uint8_t*>(header) + sizeof(h);
    auto s = std::make_unique<Serve>();
    s->worker = &w;
    s->replyEp = param->replyEp;
    s->reply = ReplyHeader{kMagic, kSuccess, h.ticket, h.part, kReasonNone, 0};
    if (h.op == kOpRegion) {
        serve_region(std::move(s), h, entries, length);
        return api::kOk;
    }
    if ((h.flags & kFlagNotify) != 0) {
        s->noteKey = std::move(key);
        s->noteUid = h.uid;
    }
    // GPU memory this engine stages (ucx/gpu.hpp) is received in host memory: a write into it may
    // come eager as well (its bytes are copied to staged memory, then to the GPU).
    std::shared_ptr<GpuWords> stager = eng.gpu_words();
    if (stager && !stager->stages()) stager = nullptr;
    const bool rndv = (param->recvAttr & api::kAmRecvRndv) != 0;
    uint64_t total = 0;
    int memType = api::kMemoryHost;
    if (!check_blocks(s, h, entries, rndv, stager != nullptr, total, memType)) return api::kOk;
    if (memType != api::kMemoryHost) s->stager = std::move(stager);  // GPU memory through host memory
    if (h.op == kOpRead) {
        serve_read(std::move(s), h, length, total, memType);
        return api::kOk;
    }
    return serve_write(std::move(s), h, data, length, total, rndv, memType);
}

namespace {

// Check: a reply's shape, the part in flight it answers and the ticket of the engine asked; that
// part, or null when the reply is dropped (counted).
Part* match_reply(Worker& w, const void* header, size_t headerLength, ReplyHeader& h) {
    Engine& eng = w.engine();
    if (headerLength != sizeof(h)) {
        eng.count(&EngineStats::malformed);
        return nullptr;
    }
    std::memcpy(&h, header, sizeof(h));
    Part* part = h.magic == kMagic ? w.find_part_locked(h.part) : nullptr;
    if (part == nullptr || part->done) {
        eng.count(&EngineStats::lateReplies);
        return nullptr;
    }
    if (h.ticket != part->ticket) {  // not from the engine we asked
        eng.tickets().count_bad();
        return nullptr;
    }
    return part;
}

// The target refused part: it fails, naming the refused block and why.
void refused(Part& part, const ReplyHeader& h) {
    const std::string& peer = part.link->peer->key;
    std::string what = "engine '" + peer + "' refused";
    if (part.op != kOpRegion && h.entry < part.entries()) {
        const Entry& e = part.entry(h.entry);
        what = "block (remote memory id " + std::to_string(e.memId) + ", offset " + std::to_string(e.offset) +
               ", size " + std::to_string(e.size) + ") at engine '" + peer + "'";
    } else if (part.op == kOpRegion) {
        what = "memory id " + std::to_string(part.entry(0).memId) + " at engine '" + peer + "'";
    }
    part.finish(is_final_code(h.code) && h.code != kSuccess ? h.code : kErrBadState,
                what + ": " + reason_text(h.reason));
}

// A region request's answer (RegionInfo and the packed key) for its waiting caller; false when
// the message is malformed (dropped, the part left to its deadline).
bool region_described(Part& part, const void* data, size_t length, bool rndv) {
    RegionInfo info;
    if (rndv || length < sizeof(info)) return false;
    std::memcpy(&info, data, sizeof(info));
    if (info.rkeyLen != length - sizeof(info) || info.rkeyLen == 0) {
        part.finish(kErrBadState, "engine '" + part.link->peer->key + "' sent a malformed description of its memory");
    } else if (part.answer != nullptr) {
        part.answer->region.addr = info.addr;
        part.answer->region.size = info.size;
        part.answer->region.memType = info.memType;
        part.answer->rkey.assign(static_cast<const char*>(data) + sizeof(info), info.rkeyLen);
        part.finish(kSuccess, "");
    }
    return true;
}

// Staged host memory for `length` bytes read into the part's GPU memory (part.staged); false,
// with the part failed, when none could be had.
bool take_landing(Part& part, GpuWords& stager, size_t length) {
    try {
        part.staged = stager.landing(length);
        return true;
    } catch (const std::exception& e) {
        part.finish(kErrTransport, std::string("taking host memory for what is read into GPU memory: ") + e.what());
        return false;
    }
}

// A read's bytes that came in the message itself: copied into the part's buffers, or, for GPU
// memory this engine stages, into staged memory and then to the GPU (land). GPU memory left to
// UCX is read by rendezvous only.
void read_eager(Worker& w, Part& part, const void* data, size_t length) {
    if (part.memType != api::kMemoryHost) {
        const std::shared_ptr<GpuWords> stager = w.engine().gpu_words();
        if (!stager || !stager->stages()) {
            part.finish(kErrBadState, "engine '" + part.link->peer->key + "' copied GPU-bound data in a message");
            return;
        }
        if (!take_landing(part, *stager, length)) return;
        copy_for_device(part.staged.data(), data, length);
        land(part);
        return;
    }
    const auto* src = static_cast<const uint8_t*>(data);
    for (const api::Iov& v : part.iov) {
        std::memcpy(v.buffer, src, v.length);
        src += v.length;
    }
    part.finish(kSuccess, "");
}

// A read's bytes by rendezvous: UCX receives them into the part's buffers (GPU memory the engine
// stages: into host memory, landed on the GPU after). What the handler returns to UCX.
api::Status receive_read(Worker& w, Part& part, void* data, size_t length) {
    api::RequestParam p{};
    p.opAttrMask = api::kOpCallback | api::kOpUserData | api::kOpDatatype;
    p.cb = reinterpret_cast<void*>(&on_read_data);
    p.userData = &part;
    void* buffer = part.iov.data();
    size_t count = part.iov.size();
    p.datatype = api::kDatatypeIov;
    const std::shared_ptr<GpuWords> stager = part.memType != api::kMemoryHost ? w.engine().gpu_words() : nullptr;
    if (stager && stager->stages()) {  // into host memory, then the GPU (land)
        if (!take_landing(part, *stager, length)) {
            w.retire_part_locked(part);
            return api::kOk;
        }
        buffer = part.staged.data();
        count = length;
        p.datatype = api::kDatatypeBytes;
        p.opAttrMask |= api::kOpMemoryType;
        p.memoryType = api::kMemoryHost;
    } else if (part.iov.size() == 1) {
        buffer = part.iov[0].buffer;
        count = part.iov[0].length;
        p.datatype = api::kDatatypeBytes;
        if (part.memh != nullptr) {
            p.opAttrMask |= api::kOpMemh;
            p.memh = part.memh;
        }
        if (part.memType != api::kMemoryHost) {
            p.opAttrMask |= api::kOpMemoryType;
            p.memoryType = part.memType;
        }
    }
    api::StatusPtr r = fn().am_recv_data_nbx(w.handle(), data, buffer, count, &p);
    if (api::is_error_ptr(r)) {
        w.link_failed_locked(*part.link, "receiving from engine '" + part.link->peer->key +
                                             "' failed: " + status_text(api::ptr_status(r)));
    } else if (r == nullptr) {
        land(part);
    } else {
        ++part.ops;
        return api::kInProgress;
    }
    w.retire_part_locked(part);
    return api::kOk;
}

}  // namespace

api::Status Serve::on_reply(Worker& w, const void* header, size_t headerLength, void* data, size_t length,
                            const api::AmRecvParam* param) {
    trace::mark('Q');
    ReplyHeader h;
    Part* part = match_reply(w, header, headerLength, h);
    if (part == nullptr) return api::kOk;
    const bool rndv = (param->recvAttr & api::kAmRecvRndv) != 0;
    if (h.code != kSuccess) {
        refused(*part, h);
    } else if (part->op == kOpWrite) {
        part->finish(kSuccess, "");
    } else if (part->op == kOpRegion) {
        if (!region_described(*part, data, length, rndv)) {
            w.engine().count(&EngineStats::malformed);
            return api::kOk;
        }
    } else if (length != part->bytes) {  // a read's bytes: exactly what the part asked for
        part->finish(kErrBadState, "engine '" + part->link->peer->key + "' sent " + std::to_string(length) +
                                       " bytes for a read of " + std::to_string(part->bytes));
    } else if (rndv) {
        return receive_read(w, *part, data, length);
    } else {
        read_eager(w, *part, data, length);
    }
    w.retire_part_locked(*part);
    return api::kOk;
}

void Serve::record(int code) {
    if (noteKey.empty()) return;
    if (recorded_outcome(code)) worker->engine().record_inbound(noteKey, noteUid, code);
    noteKey.clear();
}

void Serve::on_note(Worker& w, const void* header, size_t headerLength) {
    Engine& eng = w.engine();
    NoteHeader h;
    if (headerLength != sizeof(h)) {
        eng.count(&EngineStats::malformed);
        return;
    }
    std::memcpy(&h, header, sizeof(h));
    if (h.magic != kMagic || !is_final_code(h.code)) {
        eng.count(&EngineStats::malformed);
        return;
    }
    std::string key = eng.tickets().admit(h.ticket);
    if (key.empty()) return;  // no valid ticket (counted)
    eng.record_inbound(key, h.uid, h.code);
}

}  // namespace mori::ucx
