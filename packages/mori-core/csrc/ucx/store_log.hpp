// The words this engine's handlers wrote (signal puts' signals, atomics), each recorded once it
// is visible, for a thread of the process that waits on one of them: mori.shmem's
// shmem_wait_until on a GPU heap learns a remote PE's signal the moment the engine's store into
// GPU memory ended, without a copy out of the GPU per look. The log keeps the last kEntries
// stores; a waiter that falls further behind is told so, and then reads the word itself (as it
// must anyway for words written by anyone else: the device's kernels, peers over P2P).
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>

namespace mori::ucx {

class StoreLog {
public:
    static constexpr size_t kEntries = 256;

    // The width-bit (32 or 64) word at addr holds value now (the handler's write has ended).
    void record(uint64_t addr, int width, uint64_t value);
    // Stores recorded so far: a waiter's starting point (taken before its first read of the word,
    // so that a store the read missed is recorded after it).
    uint64_t mark() const { return count_.load(std::memory_order_acquire); }

    // The first store into the width-bit word at addr recorded after `since`, waiting for one up
    // to timeoutNs; `since` moves past it (or past every store looked at). nullopt on timeout, or
    // with `lost` set (and `since` at the latest store) when stores after `since` left the log
    // before this looked at them.
    std::optional<uint64_t> next(uint64_t addr, int width, uint64_t& since, int64_t timeoutNs, bool& lost);

private:
    struct Entry {
        uint64_t addr = 0, value = 0;
        int width = 0;
    };
    // A store into the word in (since, count_]; since moves to the last one looked at. Lock held.
    std::optional<uint64_t> find_locked(uint64_t addr, int width, uint64_t& since, bool& lost) const;

    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::atomic<uint64_t> count_{0};  // stores recorded (written under mu_, read without it)
    std::array<Entry, kEntries> ring_{};
};

}  // namespace mori::ucx
