// A transfer and its parts: how a part's outcome reaches its transfer, how a transfer publishes
// its outcome (and tells the target), and how a waiter leads the progress it waits for (see
// ucx/engine.hpp; the posting is in ucx/post.cpp).
#include <algorithm>
#include <cstdint>
#include <utility>

#include "base/trace.hpp"
#include "ucx/wire.hpp"

namespace mori::ucx {

namespace {

// A waiter progresses its worker itself (yielding between empty polls) for this long before it
// hands over to the progress thread and sleeps: a small transfer, or a 1 MiB one over tcp.
constexpr int64_t kLeadSpinNs = 1'000'000;

void on_note_sent(void* request, api::Status, void* user) {
    fn().request_free(request);
    delete static_cast<NoteHeader*>(user);
}

}  // namespace

// ---- Part and Transfer -------------------------------------------------------------------------

void Part::finish(int c, const std::string& msg) {
    if (done) return;
    done = true;
    trace::mark('F', c);
    if (answer != nullptr) {
        answer->code = c;
        answer->message = msg;
        answer = nullptr;
    } else if (transfer) {
        transfer->part_done(c, msg);
    }
}

Transfer::Transfer(std::shared_ptr<Worker> worker, Link* link, int64_t parts, int64_t deadlineNs, bool notify,
                   uint64_t uid)
    : CompletionSlot(parts),
      worker_(worker),
      link_(link),
      onWorker_(worker != nullptr),
      deadlineNs_(deadlineNs),
      notify_(notify),
      uid_(uid) {}

const std::shared_ptr<Transfer>& finished_transfer() {
    static const std::shared_ptr<Transfer> finished = [] {
        auto t = std::make_shared<Transfer>(nullptr, nullptr, 1, INT64_MAX, false, 0);
        t->part_done(kSuccess, "");
        return t;
    }();
    return finished;
}

void Transfer::part_done(int c, const std::string& msg, Link* via) {
    if (!account(1, c, msg)) return;
    auto [code, text] = outcome();
    finish(code, text, via);
}

void Transfer::fail(int c, const std::string& msg) { finish(c, msg); }

void Transfer::finish(int c, const std::string& msg, Link* via) {
    // The send-queue room is free before anyone sees the code: a caller that saw one transfer end
    // finds its room for the next. Published before the note goes: a waiter need not wait for it.
    const bool published = publish(c, msg, [this] {
        if (queue_) queue_->give(queueOps_);
        queue_.reset();
    });
    if (!published) return;
    // The target hears the outcome after every byte (a message behind the transfer's last
    // reply); a transport failure is not sent (the link is gone). On the same-host path, and for
    // a transfer of one message (kFlagNotify), the target records it itself. The worker lock is
    // held: link_ is still valid though the owner may have seen the code. A spread transfer's
    // note leaves on the link of the child that finished last (its worker's lock is held), none
    // when that child was never posted (its link is gone).
    Link* link = via != nullptr ? via : link_;
    if (notify_ && !sameHost_ && recorded_outcome(c) && link != nullptr && !link->eps.empty()) {
        auto* note = new NoteHeader{kMagic, c, link->peer->ticket, uid_};
        api::RequestParam p{};
        p.opAttrMask = api::kOpCallback | api::kOpUserData | api::kOpFlags;
        p.flags = api::kAmSendEager;
        p.cb = reinterpret_cast<void*>(&on_note_sent);
        p.userData = note;
        api::StatusPtr r = fn().am_send_nbx(link->eps[0], kAmNote, note, sizeof(*note), nullptr, 0, &p);
        if (r == nullptr || api::is_error_ptr(r)) delete note;
    }
    // A child of a spread transfer finishes under its worker's lock when it was posted.
    if (parent_) std::exchange(parent_, nullptr)->part_done(c, msg, onWorker_ ? link_ : nullptr);
}

void Transfer::holds(std::shared_ptr<SendQueue> queue, uint64_t ops) {
    const bool held = unless_published([&] {
        queue_ = queue;
        queueOps_ = ops;
    });
    if (!held) queue->give(ops);
}

bool Transfer::wait(double timeoutSec) {
    return wait_until(deadline_in(timeoutSec), [this](int64_t deadline) {
        for (const std::weak_ptr<Transfer>& child : children_)  // spread: each leads its own worker
            if (auto t = child.lock()) t->wait(std::max<int64_t>(deadline - now_ns(), 0) / 1e9);
        if (sameHost_) {
            sameHost_->lead(*this, deadline, spinNs_);
        } else if (auto w = worker_.lock()) {
            w->lead([this] { return finished(); }, std::min<int64_t>(kLeadSpinNs, deadline - now_ns()));
            if (!finished()) w->wake();  // what is left needs the progress thread
        }
    });
}

}  // namespace mori::ucx
