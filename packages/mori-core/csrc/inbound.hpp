// Completion records of inbound transfers (MORI's notifications): the final status of transfer
// uid from engine key, kept until the owner pops it. Bounded in count and age: the oldest go first.
// Shared by the native TCP and UCX data planes; thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>

#include "transfer.hpp"

namespace mori {

class InboundRecords {
public:
    InboundRecords(size_t maxRecords, double ttlSeconds) : max_(maxRecords), ttlNs_(static_cast<int64_t>(ttlSeconds * 1e9)) {}

    // Keeps code for (key, uid); a repeated uid replaces its record. Returns how many records
    // were dropped to make room (count or age).
    size_t record(const std::string& key, uint64_t uid, int code) {
        const int64_t now = now_ns();
        std::lock_guard lk(mu_);
        size_t dropped = expire_locked(now);
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
        order_.push_back(Record{key, uid, code, now});
        index_.emplace(std::move(id), std::prev(order_.end()));
        dropped_ += dropped;
        return dropped;
    }

    // The code recorded for (key, uid), removing the record; nullopt when there is none.
    std::optional<int> pop(const std::string& key, uint64_t uid) {
        std::lock_guard lk(mu_);
        auto it = index_.find({key, uid});
        if (it == index_.end()) return std::nullopt;
        int code = it->second->code;
        order_.erase(it->second);
        index_.erase(it);
        return code;
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
    int64_t ttlNs_;
    std::mutex mu_;
    std::list<Record> order_;  // oldest first
    std::unordered_map<std::pair<std::string, uint64_t>, std::list<Record>::iterator, KeyHash> index_;
    uint64_t dropped_ = 0;
};

}  // namespace mori
