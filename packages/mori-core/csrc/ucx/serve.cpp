// The UCX engine's active-message handlers: the target checks every request against its live
// registrations before its memory is touched, then moves the bytes (eager copy, or UCX's
// zero-copy rendezvous); the initiator matches replies to its messages in flight.
// Handlers run inside ucp_worker_progress, with the worker lock held.
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "ucx/wire.hpp"

namespace mori::ucx {

std::string reason_text(uint32_t reason) {
    switch (reason) {
        case kReasonMemory: return "memory is not registered at the target (ERR_NOT_FOUND)";
        case kReasonRange: return "offset/size out of range of the target's region (ERR_INVALID_ARGS)";
        case kReasonShape: return "the message's data does not match its blocks (ERR_INVALID_ARGS)";
        case kReasonGpu:
            return "the target's memory is GPU memory: say so when submitting (remote_gpu) (ERR_INVALID_ARGS)";
        case kReasonFailed: return "UCX failed to move the data (ERR_TRANSPORT)";
        case kReasonChecked:
            return "the target's engine checks every access (rma=False) and serves no one-sided RMA: "
                   "make both engines with rma=True, between trusted peers only (ERR_NOT_FOUND)";
        default: return "the target refused the request";
    }
}

namespace {

int code_of(uint32_t reason) {
    switch (reason) {
        case kReasonNone: return kSuccess;
        case kReasonMemory:
        case kReasonChecked: return kErrNotFound;
        case kReasonFailed: return kErrTransport;
        default: return kErrInvalidArgs;
    }
}

void on_serve_sent(void* request, api::Status status, void* user) {
    fn().request_free(request);
    std::unique_ptr<Serve> s(static_cast<Serve*>(user));  // unpins what the reply read
    if (status == api::kOk) s->record(s->reply.code);    // a read's bytes have left
}

// Sends s's reply (with data: iov or s.body) on its reply endpoint; s is freed when UCX is done.
void send_reply(std::unique_ptr<Serve> s, bool rndv, int memType) {
    const auto& f = fn();
    api::RequestParam p{};
    p.opAttrMask = api::kOpCallback | api::kOpUserData | api::kOpDatatype | api::kOpFlags;
    p.cb = reinterpret_cast<void*>(&on_serve_sent);
    p.userData = s.get();
    p.datatype = api::kDatatypeBytes;
    p.flags = rndv ? api::kAmSendRndv : 0;
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
    } else if (!s->iov.empty()) {
        data = s->iov.data();
        count = s->iov.size();
        p.datatype = api::kDatatypeIov;
        if (!rndv) p.flags = api::kAmSendEager;
    }
    api::StatusPtr r = f.am_send_nbx(s->replyEp, kAmReply, &s->reply, sizeof(s->reply), data, count, &p);
    if (r == nullptr) s->record(s->reply.code);   // sent at once
    else if (!api::is_error_ptr(r)) s.release();  // on_serve_sent frees it
}

// Answers h with a refusal instead of what s (made for h) would have sent; its outcome is
// recorded if h asked.
void refuse(std::unique_ptr<Serve> s, const RequestHeader& h, uint32_t reason, uint32_t entry) {
    s->worker->engine().count(&EngineStats::refused);
    s->drop_blocks();
    s->reply = ReplyHeader{kMagic, code_of(reason), h.ticket, h.part, reason, entry};
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
// to their place on the GPU, a copy that runs while the worker takes the next pieces
// (Worker::after_copy_locked). Worker lock held.
void answer_write(std::unique_ptr<Serve> s) {
    if (s->reply.code == kSuccess && s->stager) {
        try {
            const bool inPlace = s->staged.size() <= kCopyInPlaceBytes;
            s->stager->to_device(reinterpret_cast<uint64_t>(s->iov[0].buffer), s->staged, inPlace);
            if (!inPlace) {
                after_copy(std::move(s), [](std::unique_ptr<Serve> s, const std::string& error) {
                    if (!error.empty()) write_failed(*s, error);
                    reply_written(std::move(s));
                });
                return;
            }
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
// to the part's GPU memory, a copy that runs while the worker takes the next pieces. Lock held.
void land(Part& part) {
    if (part.staged.empty()) {
        part.finish(kSuccess, "");
        return;
    }
    try {
        const std::shared_ptr<GpuWords> stager = part.link->worker->engine().gpu_words();
        if (!stager) throw std::runtime_error("the engine no longer serves GPU memory");
        const bool inPlace = part.staged.size() <= kCopyInPlaceBytes;
        stager->to_device(reinterpret_cast<uint64_t>(part.iov[0].buffer), part.staged, inPlace);
        if (inPlace) {
            part.finish(kSuccess, "");
            return;
        }
        ++part.ops;  // the copy: the part stays until it ended
        Part* p = &part;
        part.link->worker->after_copy_locked(part.staged, [p](const std::string& error) {
            --p->ops;
            if (error.empty()) p->finish(kSuccess, "");
            else p->finish(kErrTransport, "copying what was read into GPU memory: " + error);
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
        w.link_failed_locked(*part->link, "receiving from engine '" + part->link->peer->key + "' failed: " + status_text(status));
    }
    w.retire_part_locked(*part);
}

}  // namespace

api::Status Serve::on_request(Worker& w, const void* header, size_t headerLength, void* data, size_t length,
                              const api::AmRecvParam* param) {
    Engine& eng = w.engine();
    RequestHeader h;
    if (headerLength < sizeof(h) || (param->recvAttr & api::kAmRecvReplyEp) == 0 || param->replyEp == nullptr) {
        eng.count(&EngineStats::malformed);
        return api::kOk;  // dropped (rendezvous data too)
    }
    std::memcpy(&h, header, sizeof(h));
    const size_t n = h.count;
    if (h.magic != kMagic || (h.flags & ~kFlagsKnown) != 0 || headerLength != sizeof(h) + n * sizeof(Entry) || n == 0 ||
        (h.op != kOpRead && h.op != kOpWrite && h.op != kOpRegion)) {
        eng.count(&EngineStats::malformed);
        return api::kOk;
    }
    std::string key = eng.admitted(h.ticket);
    if (key.empty()) {
        eng.count(&EngineStats::badTickets);
        return api::kOk;
    }
    const bool rndv = (param->recvAttr & api::kAmRecvRndv) != 0;
    const auto* entries = reinterpret_cast<const uint8_t*>(header) + sizeof(h);
    auto s = std::make_unique<Serve>();
    s->worker = &w;
    s->replyEp = param->replyEp;
    s->reply = ReplyHeader{kMagic, kSuccess, h.ticket, h.part, kReasonNone, 0};
    if ((h.flags & kFlagNotify) != 0 && h.op != kOpRegion) {
        s->noteKey = std::move(key);
        s->noteUid = h.uid;
    }
    if (h.op == kOpRegion && !eng.options().rma) {  // a checked engine gives no key for one-sided RMA
        refuse(std::move(s), h, kReasonChecked, 0);
        return api::kOk;
    }
    if (h.op == kOpRegion) {
        Entry e;
        std::memcpy(&e, entries, sizeof(e));
        std::shared_ptr<Region> r = eng.region(e.memId);
        if (!r || n != 1 || length != 0) {
            refuse(std::move(s), h, r ? kReasonShape : kReasonMemory, 0);
            return api::kOk;
        }
        RegionInfo info{r->addr, r->size, r->memType, static_cast<uint32_t>(r->rkey.size())};
        s->body.assign(reinterpret_cast<const char*>(&info), sizeof(info));
        s->body += r->rkey;
        send_reply(std::move(s), false, api::kMemoryHost);
        return api::kOk;
    }
    // Every entry is checked against the live registrations before any byte moves; the regions
    // stay pinned (deregistration waits) until UCX has finished with them.
    uint64_t total = 0;
    int memType = api::kMemoryHost;
    // GPU memory this engine stages (ucx/gpu.hpp) is received in host memory: a write into it may
    // come eager as well (its bytes are copied to staged memory, then to the GPU).
    std::shared_ptr<GpuWords> stager = eng.gpu_words();
    if (stager && !stager->stages()) stager = nullptr;
    s->iov.resize(n);
    for (size_t i = 0; i < n; ++i) {
        Entry e;
        std::memcpy(&e, entries + i * sizeof(Entry), sizeof(e));
        std::shared_ptr<Region> r = eng.pin_region(e.memId);
        if (r) s->pins.push_back(r);  // unpinned when s goes
        uint32_t reason = !r ? kReasonMemory : !r->contains(e.offset, e.size) ? kReasonRange : kReasonNone;
        if (reason == kReasonNone && r->memType != api::kMemoryHost) {
            // GPU memory left to UCX moves only by rendezvous (UCX's copy engines): a copy-in
            // message would have the target's CPU write it. Staged, a write may come eager.
            if ((h.op == kOpWrite && !rndv && !stager) || (h.op == kOpRead && !(h.flags & kFlagRndvReply)) || n != 1)
                reason = kReasonGpu;
            memType = r->memType;
        }
        if (reason != kReasonNone) {
            refuse(std::move(s), h, reason, static_cast<uint32_t>(i));
            return api::kOk;
        }
        s->iov[i] = api::Iov{reinterpret_cast<void*>(r->addr + e.offset), e.size};
        total += e.size;
    }
    // GPU memory (one block) through host memory, when the engine stages it.
    if (memType != api::kMemoryHost) s->stager = std::move(stager);
    if (h.op == kOpRead) {
        if (length != 0) {
            refuse(std::move(s), h, kReasonShape, 0);
            return api::kOk;
        }
        const bool rndvReply = (h.flags & kFlagRndvReply) != 0;
        if (s->stager) {  // the bytes leave once copied to host memory, while others are sent
            const bool inPlace = total <= kCopyInPlaceBytes;
            try {
                s->staged = s->stager->to_host(reinterpret_cast<uint64_t>(s->iov[0].buffer), total, inPlace);
            } catch (const std::exception& e) {
                refuse_read(std::move(s), h, e.what());
                return api::kOk;
            }
            s->iov[0].buffer = s->staged.data();
            if (inPlace) {
                send_reply(std::move(s), rndvReply, api::kMemoryHost);
                return api::kOk;
            }
            after_copy(std::move(s), [h, rndvReply](std::unique_ptr<Serve> s, const std::string& error) {
                if (error.empty()) return send_reply(std::move(s), rndvReply, api::kMemoryHost);
                refuse_read(std::move(s), h, error);
            });
            return api::kOk;
        }
        send_reply(std::move(s), rndvReply, memType);
        return api::kOk;
    }
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
    if (!rndv) {  // eager: the bytes are here
        if (s->stager) {
            std::memcpy(s->staged.data(), data, total);
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
    } else if (n == 1) {
        buffer = s->iov[0].buffer;
        count = s->iov[0].length;
        p.datatype = api::kDatatypeBytes;
        std::shared_ptr<Region>& r = s->pins[0];
        if (r->memh != nullptr) {
            p.opAttrMask |= api::kOpMemh;
            p.memh = r->memh;
        }
        if (memType != api::kMemoryHost) {
            p.opAttrMask |= api::kOpMemoryType;
            p.memoryType = memType;
        }
    }
    api::StatusPtr r = fn().am_recv_data_nbx(w.handle(), data, buffer, count, &p);
    if (api::is_error_ptr(r)) {
        s->reply.code = kErrTransport;
        s->reply.reason = kReasonFailed;
        answer_write(std::move(s));
        return api::kOk;
    }
    if (r == nullptr) {  // received at once (no callback)
        answer_write(std::move(s));
        return api::kOk;
    }
    s.release();  // on_written owns it
    return api::kInProgress;
}

api::Status Serve::on_reply(Worker& w, const void* header, size_t headerLength, void* data, size_t length,
                            const api::AmRecvParam* param) {
    Engine& eng = w.engine();
    ReplyHeader h;
    if (headerLength != sizeof(h)) {
        eng.count(&EngineStats::malformed);
        return api::kOk;
    }
    std::memcpy(&h, header, sizeof(h));
    Part* part = h.magic == kMagic ? w.find_part_locked(h.part) : nullptr;
    if (part == nullptr || part->done) {
        eng.count(&EngineStats::lateReplies);
        return api::kOk;
    }
    if (h.ticket != part->ticket) {  // not from the engine we asked
        eng.count(&EngineStats::badTickets);
        return api::kOk;
    }
    const bool rndv = (param->recvAttr & api::kAmRecvRndv) != 0;
    const std::string& peer = part->link->peer->key;
    if (h.code != kSuccess) {
        std::string what = "engine '" + peer + "' refused";
        if (part->op != kOpRegion && h.entry < part->entries()) {
            const Entry& e = part->entry(h.entry);
            what = "block (remote memory id " + std::to_string(e.memId) + ", offset " + std::to_string(e.offset) +
                   ", size " + std::to_string(e.size) + ") at engine '" + peer + "'";
        } else if (part->op == kOpRegion) {
            what = "memory id " + std::to_string(part->entry(0).memId) + " at engine '" + peer + "'";
        }
        part->finish(is_final_code(h.code) && h.code != kSuccess ? h.code : kErrBadState,
                     what + ": " + reason_text(h.reason));
        w.retire_part_locked(*part);
        return api::kOk;
    }
    if (part->op == kOpWrite) {
        part->finish(kSuccess, "");
        w.retire_part_locked(*part);
        return api::kOk;
    }
    if (part->op == kOpRegion) {
        RegionInfo info;
        if (rndv || length < sizeof(info)) {
            eng.count(&EngineStats::malformed);
            return api::kOk;
        }
        std::memcpy(&info, data, sizeof(info));
        if (info.rkeyLen != length - sizeof(info) || info.rkeyLen == 0) {
            part->finish(kErrBadState, "engine '" + peer + "' sent a malformed description of its memory");
        } else if (part->answer != nullptr) {
            part->answer->region.addr = info.addr;
            part->answer->region.size = info.size;
            part->answer->region.memType = info.memType;
            part->answer->rkey.assign(static_cast<const char*>(data) + sizeof(info), info.rkeyLen);
            part->finish(kSuccess, "");
        }
        w.retire_part_locked(*part);
        return api::kOk;
    }
    // A read's bytes: exactly what the part asked for, into its own buffers.
    if (length != part->bytes) {
        part->finish(kErrBadState, "engine '" + peer + "' sent " + std::to_string(length) + " bytes for a read of " +
                                       std::to_string(part->bytes));
        w.retire_part_locked(*part);
        return api::kOk;
    }
    if (!rndv) {
        if (part->memType != api::kMemoryHost) {
            part->finish(kErrBadState, "engine '" + peer + "' copied GPU-bound data in a message");
        } else {
            const auto* src = static_cast<const uint8_t*>(data);
            for (const api::Iov& v : part->iov) {
                std::memcpy(v.buffer, src, v.length);
                src += v.length;
            }
            part->finish(kSuccess, "");
        }
        w.retire_part_locked(*part);
        return api::kOk;
    }
    api::RequestParam p{};
    p.opAttrMask = api::kOpCallback | api::kOpUserData | api::kOpDatatype;
    p.cb = reinterpret_cast<void*>(&on_read_data);
    p.userData = part;
    void* buffer = part->iov.data();
    size_t count = part->iov.size();
    p.datatype = api::kDatatypeIov;
    const std::shared_ptr<GpuWords> stager = part->memType != api::kMemoryHost ? eng.gpu_words() : nullptr;
    if (stager && stager->stages() && part->iov.size() == 1) {  // into host memory, then the GPU (land)
        try {
            part->staged = stager->landing(length);
        } catch (const std::exception& e) {
            part->finish(kErrTransport, std::string("taking host memory for what is read into GPU memory: ") + e.what());
            w.retire_part_locked(*part);
            return api::kOk;
        }
        buffer = part->staged.data();
        count = length;
        p.datatype = api::kDatatypeBytes;
        p.opAttrMask |= api::kOpMemoryType;
        p.memoryType = api::kMemoryHost;
    } else if (part->iov.size() == 1) {
        buffer = part->iov[0].buffer;
        count = part->iov[0].length;
        p.datatype = api::kDatatypeBytes;
        if (part->memh != nullptr) {
            p.opAttrMask |= api::kOpMemh;
            p.memh = part->memh;
        }
        if (part->memType != api::kMemoryHost) {
            p.opAttrMask |= api::kOpMemoryType;
            p.memoryType = part->memType;
        }
    }
    api::StatusPtr r = fn().am_recv_data_nbx(w.handle(), data, buffer, count, &p);
    if (api::is_error_ptr(r)) {
        w.link_failed_locked(*part->link, "receiving from engine '" + peer + "' failed: " + status_text(api::ptr_status(r)));
    } else if (r == nullptr) {
        land(*part);
    } else {
        ++part->ops;
        return api::kInProgress;
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
    std::string key = eng.admitted(h.ticket);
    if (key.empty()) {
        eng.count(&EngineStats::badTickets);
        return;
    }
    eng.record_inbound(key, h.uid, h.code);
}

}  // namespace mori::ucx
