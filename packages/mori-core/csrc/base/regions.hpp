// The one region table of mori-core's native planes: registered memory by id (address, size,
// kind) and the accesses in flight on each (pins). The TCP data plane's target, the UCX engine
// and its same-host service keep their regions in one; a target checks every incoming block with
// acquire, the one check of a request's memory, before a byte of it is touched.
//
// Deregistration has one rule at its deadline: acquire refuses the region at once; the
// accesses still holding pins get until the deadline; then the plane's cut ends those it can
// reach (the TCP target resets their connections; the UCX engine's end by themselves, failed at
// their own timeout) and the table waits kCutGraceNs more. A region still pinned after that
// stays out of the table, its memory in use, until its last pin drops: deregister says so
// (kStillPinned), and the plane tells its caller not to free the memory yet.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/reasons.hpp"
#include "base/transfer.hpp"

namespace mori {

enum class MemoryKind : int32_t { kHost = 0, kGpu = 1 };

// A registered region. A plane's region derives from it to add what it holds beyond the memory
// (a UCX registration, a GPU staging).
struct Region {
    uint64_t id = 0, addr = 0, size = 0;
    MemoryKind kind = MemoryKind::kHost;
    std::atomic<int64_t> pins{0};  // accesses in flight; deregistration waits for them
    bool gpu() const { return kind == MemoryKind::kGpu; }
    bool contains(uint64_t off, uint64_t len) const { return off <= size && len <= size - off; }
    void unpin() { pins.fetch_sub(1, std::memory_order_acq_rel); }
};

template <class R>
class RegionTable {
public:
    // What a region holds beyond its memory, let go once it is out of the table and unpinned.
    using Release = std::function<void(R&)>;
    // Ends the accesses to a region that the plane can reach at the deadline; how many.
    using Cut = std::function<size_t(const R&)>;
    enum class Ended { kUnknown, kReleased, kStillPinned };
    // How long deregister waits for the accesses its cut ended.
    static constexpr int64_t kCutGraceNs = 2'000'000'000;

    explicit RegionTable(Release release = nullptr) : release_(std::move(release)) {}
    ~RegionTable() { clear(); }
    RegionTable(const RegionTable&) = delete;
    RegionTable& operator=(const RegionTable&) = delete;

    // Adds r; false (nothing added) when its id is taken. Lets go the deregistered regions whose
    // last pin dropped since.
    bool add(std::shared_ptr<R> r) {
        std::unique_lock lk(mu_);
        if (!regions_.emplace(r->id, r).second) return false;
        std::vector<std::shared_ptr<R>> freed;
        auto still =
            std::stable_partition(retired_.begin(), retired_.end(), [](auto& z) { return z->pins.load() != 0; });
        freed.assign(still, retired_.end());
        retired_.erase(still, retired_.end());
        lk.unlock();
        for (auto& z : freed) release(*z);
        return true;
    }

    // The region, unpinned (to describe it), or null.
    std::shared_ptr<R> find(uint64_t id) const {
        std::shared_lock lk(mu_);
        auto it = regions_.find(id);
        return it == regions_.end() ? nullptr : it->second;
    }

    // The whole region with one more pin (the caller unpins it), or null.
    std::shared_ptr<R> pin(uint64_t id) const {
        std::shared_lock lk(mu_);
        auto it = regions_.find(id);
        if (it == regions_.end()) return nullptr;
        it->second->pins.fetch_add(1, std::memory_order_acq_rel);
        return it->second;
    }

    // The check of an incoming block: region id pinned with [offset, offset + size) inside it
    // (the caller unpins it), or null with why: kReasonMemory (no such region), kReasonRange.
    std::shared_ptr<R> acquire(uint64_t id, uint64_t offset, uint64_t size, uint32_t& reason) const {
        std::shared_lock lk(mu_);
        auto it = regions_.find(id);
        if (it == regions_.end()) {
            reason = kReasonMemory;
            return nullptr;
        }
        if (!it->second->contains(offset, size)) {
            reason = kReasonRange;
            return nullptr;
        }
        reason = kReasonNone;
        it->second->pins.fetch_add(1, std::memory_order_acq_rel);
        return it->second;
    }

    // Stops serving id and waits for its accesses (see the top of this file).
    Ended deregister(uint64_t id, int64_t deadlineNs, const Cut& cut = nullptr) {
        std::shared_ptr<R> r;
        {
            std::unique_lock lk(mu_);
            auto it = regions_.find(id);
            if (it == regions_.end()) return Ended::kUnknown;
            r = std::move(it->second);
            regions_.erase(it);  // acquire refuses it from here on
        }
        if (!unpinned_by(*r, deadlineNs) && cut) {
            cut(*r);
            unpinned_by(*r, now_ns() + kCutGraceNs, &cut);
        }
        if (r->pins.load() != 0) {
            std::lock_guard lk(mu_);
            retired_.push_back(std::move(r));
            return Ended::kStillPinned;
        }
        release(*r);
        return Ended::kReleased;
    }

    // Lets go every region, pinned or not (the plane has stopped every access).
    void clear() {
        std::unique_lock lk(mu_);
        auto regions = std::move(regions_);
        auto retired = std::move(retired_);
        regions_.clear();
        retired_.clear();
        lk.unlock();
        for (auto& [id, r] : regions) release(*r);
        for (auto& r : retired) release(*r);
    }

private:
    // Waits (polling, backing off) until r has no pins; false at the deadline. With cut, cuts
    // again every 100 ms meanwhile (accesses that slipped past the first cut).
    static bool unpinned_by(const R& r, int64_t deadlineNs, const Cut* cut = nullptr) {
        int sleepUs = 20;
        int64_t nextCut = now_ns() + 100'000'000;
        while (r.pins.load() != 0) {
            const int64_t now = now_ns();
            if (now >= deadlineNs) return false;
            if (cut && now >= nextCut) {
                (*cut)(r);
                nextCut = now + 100'000'000;
            }
            std::this_thread::sleep_for(std::chrono::microseconds(sleepUs));
            sleepUs = std::min(sleepUs * 2, 2000);
        }
        return true;
    }
    void release(R& r) {
        if (release_) release_(r);
    }

    Release release_;
    mutable std::shared_mutex mu_;
    std::unordered_map<uint64_t, std::shared_ptr<R>> regions_;
    std::vector<std::shared_ptr<R>> retired_;  // deregistered while pinned: let go once unpinned
};

// A pin held for a scope: unpinned when it ends (or at reset).
template <class R>
class Pinned {
public:
    Pinned() = default;
    explicit Pinned(std::shared_ptr<R> r) : r_(std::move(r)) {}
    ~Pinned() { reset(); }
    Pinned(Pinned&& o) noexcept = default;
    Pinned& operator=(Pinned&& o) noexcept {
        reset();
        r_ = std::move(o.r_);
        return *this;
    }
    void reset() {
        if (r_) r_->unpin();
        r_.reset();
    }
    R* get() const { return r_.get(); }
    R* operator->() const { return r_.get(); }
    explicit operator bool() const { return r_ != nullptr; }

private:
    std::shared_ptr<R> r_;
};

}  // namespace mori
