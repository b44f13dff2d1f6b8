// mori.umbp._grpc_native.PeerSsdReads: a node's peer service answering BatchResolveKeys and
// BatchReleaseKeys for pages held on SSD only, in C++ on the gRPC worker that took the call.
//
// Why: in Python such a resolve took about 0.1 ms of the owner's CPU before and after the disk
// read (the request decoded, the keys checked, the store's lock, staging, the lease, the answer
// encoded). Here the worker looks the keys up, reads each page with one aligned pread (preadv
// for neighbouring records) into a slot of a reserve at the end of the node's DRAM buffer,
// checks its XXH3-64 hash, leases the slot and answers, without the GIL. The reader then reads
// the slot with mori-io, as it reads any slot of that buffer; or, when the reader allows it
// (inline_max_bytes) and the pages are small, the answer carries their bytes and the slot is
// free again at once: one round trip where there were two.
//
// The store (Python) stays the owner of every page: it adds a key here when the key comes to be
// on SSD only, and removes it before its SSD record can be freed or its DRAM copy comes back. A
// read that raced a removal is thrown away (the key's serial is checked again after the read),
// so a record's space reused meanwhile is never answered. Anything this path does not take (a
// key not here, a duplicate, a request that does not decode, no room in the reserve, a failed
// or mismatching read) goes to the Python service whole, which answers as it always did.
#pragma once

#include <grpcpp/support/byte_buffer.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace umbp {

class PeerSsdReads {
public:
    // The reserve is [reserve_offset, reserve_offset + reserve_bytes) of the DRAM buffer at
    // buffer_address; each lease lasts lease_ms.
    PeerSsdReads(uintptr_t buffer_address, uint64_t reserve_offset, uint64_t reserve_bytes, uint64_t lease_ms,
                 bool verify_checksum);

    // -- the store's side (Python, under the store's lock) ---------------------------------------
    // `key` is on SSD only: `size` bytes at `offset` of the segment file `fd`, with `checksum`.
    void add(const std::string& key, int fd, uint64_t offset, uint64_t size, uint64_t checksum);
    // `key` leaves this path (its DRAM copy is back, or it is gone); whether it was here.
    bool remove(const std::string& key);
    // Every key leaves; leases run on (their slots are the reserve's, not the store's).
    void clear();
    // Ends the lease `lease_id` on `key`: whether it held to now (false: ran out, or not known).
    bool release(const std::string& key, uint64_t lease_id);
    // The keys read here since the last call (at most kMaxHits): the store's SSD recency.
    std::vector<std::string> take_hits();
    size_t keys() const;
    size_t leases() const;
    uint64_t reserve_used() const;
    // Pages answered with their bytes in the answer (inline_max_bytes), since the start.
    uint64_t inlined() const;

    // -- the gRPC side (a worker, without the GIL) ------------------------------------------------
    // Answers a serialized BatchResolveKeysRequest into `response`; false when it is not taken
    // here (see the top of the file): the caller hands it to Python.
    bool resolve(const grpc::ByteBuffer& request, grpc::ByteBuffer* response);
    // Answers a BatchReleaseKeysRequest whose leases are all this path's; false otherwise.
    bool release(const grpc::ByteBuffer& request, grpc::ByteBuffer* response);

    // Lease ids of this path have this bit set (the store's count from 1 and never reach it).
    static constexpr uint64_t kLeaseBit = uint64_t{1} << 62;
    // The most keys one resolve takes here, and the most distinct hits kept for take_hits.
    static constexpr size_t kMaxKeys = 1024;
    // The most bytes one answer carries inline, whatever the reader allows (a request's
    // inline_max_bytes): pages beyond it are leased and read with mori-io.
    static constexpr uint64_t kMaxInlineBytes = uint64_t{1} << 20;
    static constexpr size_t kMaxHits = 65536;

private:
    using Clock = std::chrono::steady_clock;

    struct Record {
        int fd;
        uint64_t offset;
        uint64_t size;
        uint64_t checksum;
        uint64_t serial;  // a new one on every add: a read is answered only if it is unchanged
    };
    struct Lease {
        std::string key;
        uint64_t slot;    // offset in the DRAM buffer
        uint64_t length;  // aligned
        Clock::time_point until;
    };
    struct Job {
        Record record;
        uint64_t slot = 0;
    };

    // Under mu_.
    bool take_slot(uint64_t length, uint64_t* slot);
    void give_slot(uint64_t slot, uint64_t length);
    void give_slots(const std::vector<Job>& jobs, size_t count);  // the slots of jobs[0, count)
    void reclaim(Clock::time_point now);
    bool end_lease(const std::string& key, uint64_t lease_id, Clock::time_point now);

    // Without mu_: reads the jobs (neighbouring records by one preadv); false on any failure.
    bool read_all(std::vector<Job>& jobs) const;

    const uintptr_t buffer_;
    const uint64_t reserve_offset_;
    const uint64_t reserve_bytes_;
    const Clock::duration lease_;
    const uint64_t lease_ms_;
    const bool verify_;

    mutable std::mutex mu_;
    std::unordered_map<std::string, Record> records_;
    std::map<uint64_t, uint64_t> free_;  // offset -> length, merged with neighbours
    uint64_t used_ = 0;
    std::unordered_map<uint64_t, Lease> leases_;
    std::unordered_set<std::string> hits_;
    uint64_t serial_ = 0;
    uint64_t lease_count_ = 0;
    uint64_t inlined_ = 0;
};

}  // namespace umbp
