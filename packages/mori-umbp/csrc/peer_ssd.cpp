// The owner's SSD reads for its peers (see peer_ssd.h).
#include "peer_ssd.h"

#include <sys/uio.h>
#include <xxhash.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <stdexcept>
#include <string_view>

namespace umbp {

namespace {

constexpr uint64_t kAlign = 4096;  // mori.umbp._extents.ALIGN: slots and records are in these units
constexpr int kTierDram = 2;       // umbp.TierType TIER_DRAM: the page is answered from a DRAM slot
constexpr size_t kMaxIov = 1024;   // Linux's IOV_MAX

uint64_t aligned(uint64_t size) { return (size + kAlign - 1) / kAlign * kAlign; }

// -- the protobuf wire format, as far as these two messages need it ---------------------------------

class Reader {
public:
    Reader(const char* at, size_t size) : at_(at), end_(at + size) {}
    bool done() const { return at_ == end_; }

    bool varint(uint64_t* out) {
        uint64_t value = 0;
        for (int shift = 0; shift < 64 && at_ < end_; shift += 7) {
            const uint8_t byte = static_cast<uint8_t>(*at_++);
            value |= static_cast<uint64_t>(byte & 0x7f) << shift;
            if ((byte & 0x80) == 0) {
                *out = value;
                return true;
            }
        }
        return false;
    }

    bool bytes(std::string_view* out) {
        uint64_t length = 0;
        if (!varint(&length) || length > static_cast<uint64_t>(end_ - at_)) return false;
        *out = std::string_view(at_, static_cast<size_t>(length));
        at_ += length;
        return true;
    }

private:
    const char* at_;
    const char* end_;
};

class Writer {
public:
    void varint(uint64_t value) {
        while (value >= 0x80) {
            out_.push_back(static_cast<char>((value & 0x7f) | 0x80));
            value >>= 7;
        }
        out_.push_back(static_cast<char>(value));
    }
    void tag(uint32_t field, uint32_t wire_type) { varint((field << 3) | wire_type); }
    void varint_field(uint32_t field, uint64_t value) {
        tag(field, 0);
        varint(value);
    }
    void packed(uint32_t field, const std::vector<uint64_t>& values) {
        Writer body;
        for (uint64_t v : values) body.varint(v);
        tag(field, 2);
        varint(body.out_.size());
        out_ += body.out_;
    }
    // Room for `size` more bytes, written by the caller at the pointer returned.
    char* bytes_field(uint32_t field, size_t size) {
        tag(field, 2);
        varint(size);
        out_.resize(out_.size() + size);
        return out_.data() + out_.size() - size;
    }
    grpc::ByteBuffer buffer() const {
        grpc::Slice slice(out_.data(), out_.size());
        return grpc::ByteBuffer(&slice, 1);
    }

private:
    std::string out_;
};

// The request's bytes in one piece (a small message usually is one slice already).
bool flatten(const grpc::ByteBuffer& buffer, std::string* out) {
    std::vector<grpc::Slice> slices;
    if (!buffer.Dump(&slices).ok()) return false;
    out->clear();
    out->reserve(buffer.Length());
    for (const grpc::Slice& s : slices) out->append(reinterpret_cast<const char*>(s.begin()), s.size());
    return true;
}

// BatchResolveKeysRequest { repeated string keys = 1; uint64 inline_max_bytes = 20; }: its keys
// and inline bound, or false for anything else.
bool parse_resolve(const std::string& body, std::vector<std::string_view>* keys, uint64_t* inline_max) {
    Reader in(body.data(), body.size());
    while (!in.done()) {
        uint64_t tag = 0;
        std::string_view key;
        if (!in.varint(&tag)) return false;
        if (tag == ((20 << 3) | 0)) {
            if (!in.varint(inline_max)) return false;
            continue;
        }
        if (tag != ((1 << 3) | 2) || !in.bytes(&key)) return false;
        keys->push_back(key);
    }
    return true;
}

// BatchReleaseKeysRequest { repeated string keys = 1; repeated uint64 lease_id = 2; } (lease_id
// packed or not, as proto3 readers take it).
bool parse_release(const std::string& body, std::vector<std::string_view>* keys, std::vector<uint64_t>* ids) {
    Reader in(body.data(), body.size());
    while (!in.done()) {
        uint64_t tag = 0;
        if (!in.varint(&tag)) return false;
        std::string_view field;
        uint64_t id = 0;
        if (tag == ((1 << 3) | 2)) {
            if (!in.bytes(&field)) return false;
            keys->push_back(field);
        } else if (tag == ((2 << 3) | 0)) {
            if (!in.varint(&id)) return false;
            ids->push_back(id);
        } else if (tag == ((2 << 3) | 2)) {
            if (!in.bytes(&field)) return false;
            Reader packed(field.data(), field.size());
            while (!packed.done()) {
                if (!packed.varint(&id)) return false;
                ids->push_back(id);
            }
        } else {
            return false;
        }
    }
    return true;
}

}  // namespace

PeerSsdReads::PeerSsdReads(uintptr_t buffer_address, uint64_t reserve_offset, uint64_t reserve_bytes, uint64_t lease_ms,
                           bool verify_checksum)
    : buffer_(buffer_address),
      reserve_offset_(reserve_offset),
      reserve_bytes_(reserve_bytes),
      lease_(std::chrono::milliseconds(lease_ms)),
      lease_ms_(lease_ms),
      verify_(verify_checksum) {
    if (buffer_address % kAlign || reserve_offset % kAlign || reserve_bytes % kAlign || reserve_bytes == 0)
        throw std::invalid_argument("the reserve's address, offset and size must be positive multiples of 4096");
    if (lease_ms == 0) throw std::invalid_argument("lease_ms must be at least 1");
    free_[reserve_offset] = reserve_bytes;
}

// -- the store's side -------------------------------------------------------------------------------

void PeerSsdReads::add(const std::string& key, int fd, uint64_t offset, uint64_t size, uint64_t checksum) {
    if (fd < 0 || size == 0 || offset % kAlign)
        throw std::invalid_argument("add: a record needs an fd, a size and an aligned offset");
    std::lock_guard<std::mutex> hold(mu_);
    records_[key] = Record{fd, offset, size, checksum, ++serial_};
}

bool PeerSsdReads::remove(const std::string& key) {
    std::lock_guard<std::mutex> hold(mu_);
    return records_.erase(key) > 0;
}

void PeerSsdReads::clear() {
    std::lock_guard<std::mutex> hold(mu_);
    records_.clear();
    hits_.clear();
}

bool PeerSsdReads::release(const std::string& key, uint64_t lease_id) {
    std::lock_guard<std::mutex> hold(mu_);
    return end_lease(key, lease_id, Clock::now());
}

std::vector<std::string> PeerSsdReads::take_hits() {
    std::lock_guard<std::mutex> hold(mu_);
    std::vector<std::string> out(hits_.begin(), hits_.end());
    hits_.clear();
    return out;
}

size_t PeerSsdReads::keys() const {
    std::lock_guard<std::mutex> hold(mu_);
    return records_.size();
}

size_t PeerSsdReads::leases() const {
    std::lock_guard<std::mutex> hold(mu_);
    return leases_.size();
}

uint64_t PeerSsdReads::reserve_used() const {
    std::lock_guard<std::mutex> hold(mu_);
    return used_;
}

uint64_t PeerSsdReads::inlined() const {
    std::lock_guard<std::mutex> hold(mu_);
    return inlined_;
}

// -- slots and leases (under mu_) -------------------------------------------------------------------

bool PeerSsdReads::take_slot(uint64_t length, uint64_t* slot) {
    for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->second < length) continue;
        *slot = it->first;
        const uint64_t rest = it->second - length;
        free_.erase(it);
        if (rest) free_[*slot + length] = rest;
        used_ += length;
        return true;
    }
    return false;
}

void PeerSsdReads::give_slot(uint64_t slot, uint64_t length) {
    used_ -= length;
    auto next = free_.lower_bound(slot);
    if (next != free_.end() && slot + length == next->first) {
        length += next->second;
        next = free_.erase(next);
    }
    if (next != free_.begin()) {
        auto prev = std::prev(next);
        if (prev->first + prev->second == slot) {
            prev->second += length;
            return;
        }
    }
    free_[slot] = length;
}

void PeerSsdReads::give_slots(const std::vector<Job>& jobs, size_t count) {
    for (size_t k = 0; k < count; ++k) give_slot(jobs[k].slot, aligned(jobs[k].record.size));
}

void PeerSsdReads::reclaim(Clock::time_point now) {
    for (auto it = leases_.begin(); it != leases_.end();) {
        if (it->second.until <= now) {
            give_slot(it->second.slot, it->second.length);
            it = leases_.erase(it);
        } else {
            ++it;
        }
    }
}

bool PeerSsdReads::end_lease(const std::string& key, uint64_t lease_id, Clock::time_point now) {
    auto it = leases_.find(lease_id);
    if (it == leases_.end() || it->second.key != key) return false;
    const bool held = it->second.until >= now;
    give_slot(it->second.slot, it->second.length);
    leases_.erase(it);
    return held;
}

// -- the gRPC side ------------------------------------------------------------------------------------

bool PeerSsdReads::read_all(std::vector<Job>& jobs) const {
    std::vector<size_t> order(jobs.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
        const Record& x = jobs[a].record;
        const Record& y = jobs[b].record;
        return x.fd != y.fd ? x.fd < y.fd : x.offset < y.offset;
    });
    std::vector<iovec> iov;
    for (size_t i = 0; i < order.size();) {
        const Record& first = jobs[order[i]].record;
        uint64_t end = first.offset;
        iov.clear();
        size_t j = i;
        while (j < order.size() && iov.size() < kMaxIov) {
            const Job& job = jobs[order[j]];
            if (job.record.fd != first.fd || job.record.offset != end) break;
            const uint64_t length = aligned(job.record.size);
            iov.push_back(iovec{reinterpret_cast<void*>(buffer_ + job.slot), static_cast<size_t>(length)});
            end += length;
            ++j;
        }
        const ssize_t got =
            preadv(first.fd, iov.data(), static_cast<int>(iov.size()), static_cast<off_t>(first.offset));
        if (got < 0 || static_cast<uint64_t>(got) != end - first.offset) return false;
        i = j;
    }
    if (verify_) {
        for (const Job& job : jobs) {
            const void* at = reinterpret_cast<const void*>(buffer_ + job.slot);
            if (XXH3_64bits(at, static_cast<size_t>(job.record.size)) != job.record.checksum) return false;
        }
    }
    return true;
}

bool PeerSsdReads::resolve(const grpc::ByteBuffer& request, grpc::ByteBuffer* response) {
    std::string body;
    std::vector<std::string_view> keys;
    uint64_t inline_max = 0;
    if (!flatten(request, &body) || !parse_resolve(body, &keys, &inline_max) || keys.empty() || keys.size() > kMaxKeys)
        return false;
    {
        std::vector<std::string_view> sorted(keys);
        std::sort(sorted.begin(), sorted.end());
        if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) return false;  // Python: one lease a key
    }
    std::vector<Job> jobs(keys.size());
    {
        std::lock_guard<std::mutex> hold(mu_);
        bool reclaimed = false;
        for (size_t i = 0; i < keys.size(); ++i) {
            auto it = records_.find(std::string(keys[i]));
            bool ok = it != records_.end();
            if (ok) {
                jobs[i].record = it->second;
                const uint64_t length = aligned(it->second.size);
                ok = take_slot(length, &jobs[i].slot);
                if (!ok && !reclaimed) {
                    reclaim(Clock::now());
                    reclaimed = true;
                    ok = take_slot(length, &jobs[i].slot);
                }
            }
            if (!ok) {
                give_slots(jobs, i);
                return false;
            }
        }
    }
    const bool read = read_all(jobs);
    uint64_t total = 0;
    for (const Job& job : jobs) total += job.record.size;
    const bool inline_pages = inline_max > 0 && total <= std::min(inline_max, kMaxInlineBytes);  // 0: not asked
    std::vector<uint64_t> ids(keys.size());
    {
        std::lock_guard<std::mutex> hold(mu_);
        bool current = read;
        for (size_t i = 0; current && i < keys.size(); ++i) {
            auto it = records_.find(std::string(keys[i]));
            current = it != records_.end() && it->second.serial == jobs[i].record.serial;
        }
        if (!current) {  // failed, or a key left meanwhile (its record's space may be another's now)
            give_slots(jobs, jobs.size());
            return false;
        }
        const Clock::time_point until = Clock::now() + lease_;
        for (size_t i = 0; i < keys.size(); ++i) {
            if (hits_.size() < kMaxHits) hits_.emplace(keys[i]);
            if (inline_pages) continue;  // the slots stay this call's until their bytes are in the answer
            ids[i] = kLeaseBit | ++lease_count_;
            leases_[ids[i]] = Lease{std::string(keys[i]), jobs[i].slot, aligned(jobs[i].record.size), until};
        }
    }
    // BatchResolveKeysResponse: page_size 2, found 3, tier 4, size 5, offset 10, lease_id 11, lease_ms 12,
    // inline_pages 20 (then offset and lease_id are 0).
    std::vector<uint64_t> found(keys.size(), 1), tier(keys.size(), kTierDram), size(keys.size()), offset(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
        size[i] = jobs[i].record.size;
        offset[i] = inline_pages ? 0 : jobs[i].slot;
    }
    Writer out;
    out.varint_field(2, kAlign);
    out.packed(3, found);
    out.packed(4, tier);
    out.packed(5, size);
    out.packed(10, offset);
    out.packed(11, ids);
    out.varint_field(12, lease_ms_);
    if (inline_pages) {
        char* at = out.bytes_field(20, total);
        for (const Job& job : jobs) {
            std::memcpy(at, reinterpret_cast<const void*>(buffer_ + job.slot), job.record.size);
            at += job.record.size;
        }
        std::lock_guard<std::mutex> hold(mu_);
        give_slots(jobs, jobs.size());
        inlined_ += jobs.size();
    }
    *response = out.buffer();
    return true;
}

bool PeerSsdReads::release(const grpc::ByteBuffer& request, grpc::ByteBuffer* response) {
    std::string body;
    std::vector<std::string_view> keys;
    std::vector<uint64_t> ids;
    if (!flatten(request, &body) || !parse_release(body, &keys, &ids) || keys.empty() || keys.size() != ids.size() ||
        keys.size() > kMaxKeys)
        return false;
    for (uint64_t id : ids)
        if ((id & kLeaseBit) == 0) return false;  // the store's leases: Python's
    std::vector<uint64_t> held(keys.size());
    {
        std::lock_guard<std::mutex> hold(mu_);
        // A key that is not its lease's goes to Python whole: it checks keys and says what is wrong.
        for (size_t i = 0; i < keys.size(); ++i) {
            auto it = leases_.find(ids[i]);
            if (it == leases_.end() || it->second.key != keys[i]) return false;
        }
        const Clock::time_point now = Clock::now();
        for (size_t i = 0; i < keys.size(); ++i) held[i] = end_lease(std::string(keys[i]), ids[i], now);
    }
    Writer out;  // BatchReleaseKeysResponse { repeated bool held = 1; }
    out.packed(1, held);
    *response = out.buffer();
    return true;
}

}  // namespace umbp
