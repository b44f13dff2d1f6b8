// The words an engine's handlers wrote, for waiters in the process (see ucx/store_log.hpp).
#include "ucx/store_log.hpp"

#include <algorithm>
#include <chrono>
#include <thread>

#include "base/transfer.hpp"

namespace mori::ucx {

namespace {

// How long a waiter looks at the count before it sleeps: a remote signal is usually microseconds
// away, and a wake-up from the condition variable costs several.
constexpr int64_t kSpinNs = 20'000;

}  // namespace

void StoreLog::record(uint64_t addr, int width, uint64_t value) {
    {
        std::lock_guard lk(mu_);
        const uint64_t n = count_.load(std::memory_order_relaxed);
        ring_[n % kEntries] = Entry{addr, value, width};
        count_.store(n + 1, std::memory_order_release);
    }
    cv_.notify_all();
}

std::optional<uint64_t> StoreLog::find_locked(uint64_t addr, int width, uint64_t& since, bool& lost) const {
    const uint64_t n = count_.load(std::memory_order_relaxed);
    if (n - since > kEntries) {  // some left the log unseen: the caller reads the word itself
        lost = true;
        since = n;
        return std::nullopt;
    }
    for (; since < n; ++since) {
        const Entry& e = ring_[since % kEntries];
        if (e.addr == addr && e.width == width) {
            ++since;
            return e.value;
        }
    }
    return std::nullopt;
}

std::optional<uint64_t> StoreLog::next(uint64_t addr, int width, uint64_t& since, int64_t timeoutNs, bool& lost) {
    lost = false;
    const int64_t start = now_ns();
    while (count_.load(std::memory_order_acquire) == since && now_ns() - start < std::min(timeoutNs, kSpinNs))
        std::this_thread::yield();
    std::unique_lock lk(mu_);
    const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(timeoutNs - (now_ns() - start));
    for (;;) {
        if (auto v = find_locked(addr, width, since, lost)) return v;
        if (lost) return std::nullopt;
        if (cv_.wait_until(lk, until, [&] { return count_.load(std::memory_order_relaxed) != since; })) continue;
        return std::nullopt;
    }
}

}  // namespace mori::ucx
