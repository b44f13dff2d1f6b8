// The completion slot every native plane's transfer is built on: the parts still out, the first
// error (code and message), and the published code its owner reads with one atomic load. A waiter
// first leads progress itself through the plane's hook (the TCP initiator reads its connection's
// replies, the UCX engine progresses a worker or polls a same-host ring), so a small transfer
// costs no thread hand-off, then sleeps until the code is published or its deadline passes.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>

#include "base/trace.hpp"
#include "base/transfer.hpp"

namespace mori {

class CompletionSlot {
public:
    explicit CompletionSlot(int64_t parts) : remaining_(parts) {}
    int code() const { return code_.load(std::memory_order_acquire); }
    bool finished() const { return code() != kInProgress; }
    std::string message() const {
        std::lock_guard lk(mu_);
        return msg_;
    }
    // Accounts n finished parts; the first error wins. True when this call finished the last one.
    bool account(int64_t n, int code, const std::string& msg) {
        if (code != kSuccess) {
            std::lock_guard lk(mu_);
            if (err_ == 0) {
                err_ = code;
                msg_ = msg;
            }
        }
        return remaining_.fetch_sub(n, std::memory_order_acq_rel) == n;
    }
    // The outcome the parts reported: the first error and its message, or kSuccess.
    std::pair<int, std::string> outcome() const {
        std::lock_guard lk(mu_);
        return {err_ != 0 ? err_ : kSuccess, msg_};
    }
    // Publishes code and msg and wakes the waiters, after before() ran under the slot's lock (what
    // must be released before anyone sees the code); false, running nothing, when published already.
    template <class Before>
    bool publish(int code, const std::string& msg, Before&& before) {
        std::lock_guard lk(mu_);
        if (code_.load(std::memory_order_relaxed) != kInProgress) return false;
        err_ = code == kSuccess ? 0 : code;
        msg_ = msg;
        before();
        code_.store(code, std::memory_order_release);
        cv_.notify_all();
        return true;
    }
    bool publish(int code, const std::string& msg) {
        return publish(code, msg, [] {});
    }
    // Runs f under the slot's lock unless the code is published; whether it ran.
    template <class F>
    bool unless_published(F&& f) {
        std::lock_guard lk(mu_);
        if (code_.load(std::memory_order_relaxed) != kInProgress) return false;
        f();
        return true;
    }
    // Unless published, lead(deadlineNs) progresses on the caller's thread; then sleeps until the
    // code is published or deadlineNs. True when finished.
    template <class Lead>
    bool wait_until(int64_t deadlineNs, Lead&& lead) {
        bool ended = finished();
        if (!ended) {
            lead(deadlineNs);
            std::unique_lock lk(mu_);
            std::chrono::steady_clock::time_point until{std::chrono::nanoseconds(deadlineNs)};
            ended = cv_.wait_until(lk, until, [this] { return code_.load() != kInProgress; });
        }
        trace::mark('Z', ended);
        return ended;
    }
    // The deadline of a wait of timeoutSec seconds (negative: none; at most 1e9 s).
    static int64_t deadline_in(double timeoutSec) {
        return now_ns() + static_cast<int64_t>(std::clamp(timeoutSec, 0.0, 1e9) * 1e9);
    }

private:
    std::atomic<int64_t> remaining_;
    std::atomic<int> code_{kInProgress};
    mutable std::mutex mu_;
    std::condition_variable cv_;
    int err_ = 0;
    std::string msg_;
};

}  // namespace mori
