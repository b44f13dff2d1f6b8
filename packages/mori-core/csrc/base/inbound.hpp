// Completion records of inbound transfers (MORI's notifications): the final status (code and
// message) of transfer uid from engine key, kept until the owner pops it. Bounded in count and
// age: the oldest go first, and the first drop is logged once, naming the caller's settings for
// the bounds. One table may be shared: the native TCP target and the UCX engine write into the
// table they were given, and so does Python (mori.core.inbound); thread-safe.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/transfer.hpp"

namespace mori {

class InboundRecords {
public:
    // settings: how the caller names the two bounds, for the message logged at the first drop.
    InboundRecords(size_t maxRecords, double ttlSeconds, std::string settings = "max_inbound and inbound_ttl")
        : max_(maxRecords),
          ttl_(ttlSeconds),
          ttlNs_(static_cast<int64_t>(ttlSeconds * 1e9)),
          settings_(std::move(settings)) {
        if (maxRecords < 1 || !(ttlSeconds > 0))
            throw std::invalid_argument("completion records: the count and the age kept must be positive");
    }

    // Keeps (code, message) for (key, uid); a repeated uid replaces its record. Returns how many
    // records were dropped to make room (count or age). A target calls this for every transfer
    // (for a write before it answers), so it allocates nothing in the common case: keys are
    // interned, records sit in a deque, and only the index takes a node.
    size_t record(const std::string& key, uint64_t uid, int code, std::string message = "") {
        const int64_t now = now_ns();
        size_t dropped;
        {
            std::lock_guard lk(mu_);
            dropped = expire_locked(now);
            const Id id{uid, intern_locked(key)};
            auto it = index_.find(id);
            if (it != index_.end()) {
                bury_locked(it->second);
                index_.erase(it);
                trim_locked();
            }
            while (index_.size() >= max_) {
                drop_oldest_locked();
                ++dropped;
            }
            index_.emplace(id, first_ + records_.size());
            records_.push_back(Record{id, code, now, std::move(message)});
            dropped_ += dropped;
        }
        if (dropped != 0 && !warned_.exchange(true))
            std::fprintf(stderr,
                         "mori: completion records: at most %zu are kept, each for at most %g s (%s); dropping the "
                         "oldest (logged once; popping a record removes it)\n",
                         max_, ttl_, settings_.c_str());
        return dropped;
    }

    // Records that wait outside the table (the same-host path's notes, written by initiators into
    // shared memory) are moved in by their feed (it calls record) before every lookup: a record
    // written there before its writer reported success is found once the writer saw it. The
    // handle is for remove_feed, which returns once no call of that feed runs.
    uint64_t add_feed(std::function<void()> feed) {
        std::lock_guard lk(feedsMu_);
        feeds_.emplace_back(++nextFeed_, std::move(feed));
        hasFeeds_.store(true, std::memory_order_release);
        return nextFeed_;
    }
    void remove_feed(uint64_t id) {
        std::lock_guard lk(feedsMu_);
        feeds_.erase(std::remove_if(feeds_.begin(), feeds_.end(), [id](auto& f) { return f.first == id; }),
                     feeds_.end());
        hasFeeds_.store(!feeds_.empty(), std::memory_order_release);
    }

    // The (code, message) recorded for (key, uid), removing the record; nullopt when there is none.
    std::optional<std::pair<int, std::string>> pop(const std::string& key, uint64_t uid) {
        feed();
        std::lock_guard lk(mu_);
        auto k = keyIds_.find(key);
        if (k == keyIds_.end()) return std::nullopt;
        auto it = index_.find(Id{uid, k->second});
        if (it == index_.end()) return std::nullopt;
        Record& r = records_[it->second - first_];
        std::pair<int, std::string> out{r.code, std::move(r.message)};
        bury_locked(it->second);
        index_.erase(it);
        trim_locked();
        return out;
    }

    // The code alone (the data planes' own pop_inbound).
    std::optional<int> pop_code(const std::string& key, uint64_t uid) {
        auto r = pop(key, uid);
        return r ? std::optional<int>(r->first) : std::nullopt;
    }

    size_t count() {
        feed();
        std::lock_guard lk(mu_);
        dropped_ += expire_locked(now_ns());
        return index_.size();
    }

    // Records dropped so far (count or age).
    uint64_t dropped() {
        std::lock_guard lk(mu_);
        return dropped_;
    }

private:
    void feed() {
        if (!hasFeeds_.load(std::memory_order_acquire)) return;
        std::lock_guard lk(feedsMu_);
        for (auto& [id, f] : feeds_) f();
    }
    static constexpr uint32_t kBuried = UINT32_MAX;  // a record popped or replaced, still in the deque
    static constexpr size_t kPackAfter = 4096;       // buried records tolerated before packing
    struct Id {
        uint64_t uid;
        uint32_t key;  // interned (keyNames_)
        bool operator==(const Id& o) const { return uid == o.uid && key == o.key; }
    };
    struct IdHash {
        size_t operator()(const Id& id) const { return (id.uid ^ (uint64_t{id.key} << 40)) * 0x9e3779b97f4a7c15ull; }
    };
    struct Record {
        Id id;
        int code;
        int64_t atNs;
        std::string message;  // "" unless a failure says why (no allocation)
    };

    // The key's number; a key no record refers to any more is forgotten (trim_locked), so the
    // table stays as small as the records it keeps.
    uint32_t intern_locked(const std::string& key) {
        auto it = keyIds_.find(key);
        uint32_t id;
        if (it != keyIds_.end()) {
            id = it->second;
        } else if (!freeKeys_.empty()) {
            id = freeKeys_.back();
            freeKeys_.pop_back();
            keyNames_[id] = key;
            keyIds_.emplace(key, id);
        } else {
            id = static_cast<uint32_t>(keyNames_.size());
            keyNames_.push_back(key);
            keyUses_.push_back(0);
            keyIds_.emplace(key, id);
        }
        ++keyUses_[id];
        return id;
    }
    void release_key_locked(uint32_t id) {
        if (--keyUses_[id] != 0) return;
        keyIds_.erase(keyNames_[id]);
        keyNames_[id].clear();
        freeKeys_.push_back(id);
    }
    // Marks record seq gone (its index entry is the caller's to erase).
    void bury_locked(uint64_t seq) {
        Record& r = records_[seq - first_];
        release_key_locked(r.id.key);
        r.id.key = kBuried;
        r.message.clear();
        ++buried_;
    }
    // Drops buried records from the front; when more are buried behind a live one than there
    // are live ones (records popped out of order behind one never popped), packs the deque so
    // that it stays within twice the records kept.
    void trim_locked() {
        while (!records_.empty() && records_.front().id.key == kBuried) {
            records_.pop_front();
            ++first_;
            --buried_;
        }
        if (buried_ <= kPackAfter || buried_ <= index_.size()) return;
        std::deque<Record> live;
        for (Record& r : records_) {
            if (r.id.key == kBuried) continue;
            index_[r.id] = first_ + live.size();
            live.push_back(std::move(r));
        }
        records_.swap(live);
        buried_ = 0;
    }
    void drop_oldest_locked() {
        trim_locked();
        if (records_.empty()) return;
        Record& r = records_.front();
        index_.erase(r.id);
        bury_locked(first_);
        trim_locked();
    }
    size_t expire_locked(int64_t nowNs) {
        size_t n = 0;
        trim_locked();
        while (!records_.empty() && nowNs - records_.front().atNs > ttlNs_) {
            drop_oldest_locked();
            ++n;
        }
        return n;
    }

    size_t max_;
    double ttl_;
    int64_t ttlNs_;
    std::string settings_;
    std::mutex mu_;
    std::mutex feedsMu_;  // feeds_; taken before mu_ (a feed records)
    std::vector<std::pair<uint64_t, std::function<void()>>> feeds_;
    uint64_t nextFeed_ = 0;
    std::atomic<bool> hasFeeds_{false};
    std::deque<Record> records_;                      // oldest first; record seq is at records_[seq - first_]
    uint64_t first_ = 0;                              // seq of records_.front()
    size_t buried_ = 0;                               // buried records still in the deque
    std::unordered_map<Id, uint64_t, IdHash> index_;  // live records -> seq
    std::unordered_map<std::string, uint32_t> keyIds_;
    std::vector<std::string> keyNames_;
    std::vector<uint32_t> keyUses_;  // live records per key
    std::vector<uint32_t> freeKeys_;
    uint64_t dropped_ = 0;
    std::atomic<bool> warned_{false};
};

// The table a data plane writes: the one it was given, else one of its own with these bounds.
inline std::shared_ptr<InboundRecords> inbound_table(std::shared_ptr<InboundRecords> given, size_t maxRecords,
                                                     double ttlSeconds) {
    return given ? std::move(given) : std::make_shared<InboundRecords>(maxRecords, ttlSeconds);
}

}  // namespace mori
