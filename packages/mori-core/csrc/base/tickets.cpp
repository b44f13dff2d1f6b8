// The ticket table every plane issues and checks its tickets in (see base/tickets.hpp).
#include "base/tickets.hpp"

#include <sys/random.h>

#include <cstdio>
#include <iterator>
#include <limits>
#include <stdexcept>

#include "base/transfer.hpp"

namespace mori {

namespace {

constexpr size_t kMaxKeyLen = 4096;

// The rules, once checked (before the age is turned into nanoseconds).
TicketRules checked(TicketRules rules) {
    if (rules.maxTickets < 1 || !(rules.ttl >= 0 && rules.ttl < 1e9))
        throw std::invalid_argument("tickets: the number kept must be positive, their age 0..1e9 s");
    return rules;
}

void fill_random(void* out, size_t n) {
    if (getrandom(out, n, 0) != static_cast<ssize_t>(n)) throw std::runtime_error("tickets: getrandom failed");
}

}  // namespace

void draw_ticket(uint64_t& ticket) {
    ticket = 0;
    while (ticket == 0) fill_random(&ticket, sizeof(ticket));  // 0 is "no ticket" on the wire
}

void draw_ticket(std::string& ticket) {
    uint64_t bits[2];
    fill_random(bits, sizeof(bits));
    char text[33];
    std::snprintf(text, sizeof(text), "%016llx%016llx", static_cast<unsigned long long>(bits[0]),
                  static_cast<unsigned long long>(bits[1]));
    ticket = text;
}

bool equal_const_time(const std::string& a, const std::string& b) {
    if (a.size() != b.size()) return false;
    unsigned char diff = 0;
    for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
    return diff == 0;
}

template <typename Ticket>
TicketTable<Ticket>::TicketTable(TicketRules rules)
    : rules_(checked(rules)),
      ttlNs_(rules_.ttl > 0 ? static_cast<int64_t>(rules_.ttl * 1e9) : std::numeric_limits<int64_t>::max()) {}

template <typename Ticket>
Ticket TicketTable<Ticket>::issue(const std::string& key) {
    if (key.empty() || key.size() > kMaxKeyLen) throw std::invalid_argument("engine key must be 1..4096 bytes");
    const int64_t now = now_ns();
    std::lock_guard lk(mu_);
    auto held = byKey_.find(key);
    if (held != byKey_.end()) {
        auto it = live_locked(held->second, now);
        if (it != entries_.end()) {
            renew_locked(it->second, now);
            return it->first;
        }
    }
    Ticket t;
    draw_ticket(t);
    while (entries_.count(t)) draw_ticket(t);  // a draw that is taken already (2^-64): again
    insert_locked(key, t, now);
    return t;
}

template <typename Ticket>
void TicketTable<Ticket>::grant(const std::string& key, const Ticket& ticket) {
    if (key.empty() || key.size() > kMaxKeyLen) throw std::invalid_argument("engine key must be 1..4096 bytes");
    const int64_t now = now_ns();
    std::lock_guard lk(mu_);
    auto it = entries_.find(ticket);
    if (it != entries_.end() && it->second.key == key) {
        renew_locked(it->second, now);
        return;
    }
    if (it != entries_.end()) drop_locked(it);  // another key's: it is this one's now
    auto held = byKey_.find(key);
    if (held != byKey_.end()) drop_locked(entries_.find(held->second));
    insert_locked(key, ticket, now);
}

template <typename Ticket>
std::string TicketTable<Ticket>::admit(const Ticket& ticket) {
    const int64_t now = now_ns();
    std::lock_guard lk(mu_);
    auto it = live_locked(ticket, now);
    if (it == entries_.end()) {
        count_bad();
        return {};
    }
    std::string key = it->second.key;
    use_locked(it);
    return key;
}

template <typename Ticket>
bool TicketTable<Ticket>::admit(const Ticket& ticket, const std::string& key) {
    const int64_t now = now_ns();
    std::lock_guard lk(mu_);
    auto it = live_locked(ticket, now);
    if (it == entries_.end() || !equal_const_time(it->second.key, key)) {
        count_bad();
        return false;
    }
    use_locked(it);
    return true;
}

template <typename Ticket>
typename TicketTable<Ticket>::Entries::iterator TicketTable<Ticket>::live_locked(const Ticket& ticket, int64_t now) {
    auto it = entries_.find(ticket);
    if (it == entries_.end() || it->second.expiresNs > now) return it;
    drop_locked(it);
    return entries_.end();
}

template <typename Ticket>
void TicketTable<Ticket>::use_locked(typename Entries::iterator it) {
    if (it->second.usesLeft != 0 && --it->second.usesLeft == 0) drop_locked(it);
}

template <typename Ticket>
void TicketTable<Ticket>::drop_locked(typename Entries::iterator it) {
    byKey_.erase(it->second.key);
    order_.erase(it->second.order);
    entries_.erase(it);
}

template <typename Ticket>
void TicketTable<Ticket>::renew_locked(Entry& e, int64_t now) {
    e.expiresNs = rules_.ttl > 0 ? now + ttlNs_ : ttlNs_;
    e.usesLeft = rules_.uses;
    order_.splice(order_.end(), order_, e.order);
}

template <typename Ticket>
void TicketTable<Ticket>::insert_locked(const std::string& key, const Ticket& ticket, int64_t now) {
    // Renewal moves a ticket last and every age is the same: the first ones expire first.
    while (!order_.empty() && (entries_.size() >= rules_.maxTickets || entries_.at(order_.front()).expiresNs <= now))
        drop_locked(entries_.find(order_.front()));
    order_.push_back(ticket);
    auto& e = entries_[ticket];
    e.key = key;
    e.order = std::prev(order_.end());
    byKey_[key] = ticket;
    renew_locked(e, now);
}

template class TicketTable<uint64_t>;
template class TicketTable<std::string>;

}  // namespace mori
