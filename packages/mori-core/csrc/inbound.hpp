// Completion records of inbound transfers (MORI's notifications): the final status (code and
// message) of transfer uid from engine key, kept until the owner pops it. Bounded in count and
// age: the oldest go first, and the first drop is logged once, naming the caller's settings for
// the bounds. One table may be shared: the native TCP target and the UCX engine write into the
// table they were given, and so does Python (mori.core.inbound); thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>

#include "transfer.hpp"

namespace mori {

class InboundRecords {
public:
    // settings: how the caller names the two bounds, for the message logged at the first drop.
    InboundRecords(size_t maxRecords, double ttlSeconds, std::string settings = "max_inbound and inbound_ttl")
        : max_(maxRecords), ttl_(ttlSeconds), ttlNs_(static_cast<int64_t>(ttlSeconds * 1e9)),
          settings_(std::move(settings)) {
        if (maxRecords < 1 || !(ttlSeconds > 0))
            throw std::invalid_argument("completion records: the count and the age kept must be positive");
    }

    // Keeps (code, message) for (key, uid); a repeated uid replaces its record. Returns how many
    // records were dropped to make room (count or age).
    size_t record(const std::string& key, uint64_t uid, int code, std::string message = "") {
        const int64_t now = now_ns();
        size_t dropped;
        {
            std::lock_guard lk(mu_);
            dropped = expire_locked(now);
            auto id = std::make_pair(key, uid);
            auto it = index_.find(id);
            if (it != index_.end()) {
                order_.erase(it->second);
                index_.erase(it);
            }
            while (!order_.empty() && index_.size() >= max_) {
                index_.erase({order_.front().key, order_.front().uid});
                order_.pop_front();
                ++dropped;
            }
            order_.push_back(Record{key, uid, code, std::move(message), now});
            index_.emplace(std::move(id), std::prev(order_.end()));
            dropped_ += dropped;
        }
        if (dropped != 0 && !warned_.exchange(true))
            std::fprintf(stderr,
                         "mori: completion records: at most %zu are kept, each for at most %g s (%s); dropping the "
                         "oldest (logged once; popping a record removes it)\n",
                         max_, ttl_, settings_.c_str());
        return dropped;
    }

    // The (code, message) recorded for (key, uid), removing the record; nullopt when there is none.
    std::optional<std::pair<int, std::string>> pop(const std::string& key, uint64_t uid) {
        std::lock_guard lk(mu_);
        auto it = index_.find({key, uid});
        if (it == index_.end()) return std::nullopt;
        std::pair<int, std::string> out{it->second->code, std::move(it->second->message)};
        order_.erase(it->second);
        index_.erase(it);
        return out;
    }

    // The code alone (the data planes' own pop_inbound).
    std::optional<int> pop_code(const std::string& key, uint64_t uid) {
        auto r = pop(key, uid);
        return r ? std::optional<int>(r->first) : std::nullopt;
    }

    size_t count() {
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
    struct Record {
        std::string key;
        uint64_t uid;
        int code;
        std::string message;
        int64_t atNs;
    };
    struct KeyHash {
        size_t operator()(const std::pair<std::string, uint64_t>& k) const {
            return std::hash<std::string>()(k.first) ^ (std::hash<uint64_t>()(k.second) * 0x9e3779b97f4a7c15ull);
        }
    };
    size_t expire_locked(int64_t nowNs) {
        size_t n = 0;
        while (!order_.empty() && nowNs - order_.front().atNs > ttlNs_) {
            index_.erase({order_.front().key, order_.front().uid});
            order_.pop_front();
            ++n;
        }
        return n;
    }

    size_t max_;
    double ttl_;
    int64_t ttlNs_;
    std::string settings_;
    std::mutex mu_;
    std::list<Record> order_;  // oldest first
    std::unordered_map<std::pair<std::string, uint64_t>, std::list<Record>::iterator, KeyHash> index_;
    uint64_t dropped_ = 0;
    std::atomic<bool> warned_{false};
};

// The table a data plane writes: the one it was given, else one of its own with these bounds.
inline std::shared_ptr<InboundRecords> inbound_table(std::shared_ptr<InboundRecords> given, size_t maxRecords,
                                                     double ttlSeconds) {
    return given ? std::move(given) : std::make_shared<InboundRecords>(maxRecords, ttlSeconds);
}

}  // namespace mori
