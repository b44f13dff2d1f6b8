// Tickets: what a target gives an engine key over its authenticated control plane, and what that
// engine then presents on the data plane, which serves it as that key: a key cannot be claimed on
// the data plane alone. Every plane issues and checks its tickets in a TicketTable:
//   - the UCX engine (ucx/engine.hpp): 64-bit tickets, carried by every request, atomic and note
//     of its wire (ucx/wire.hpp) and by the same-host hello (same_host/ring.hpp); each admits
//     until it is dropped;
//   - the TCP target (tcp/engine.hpp): text tickets, carried by a data connection's hello
//     (tcp/wire.hpp); each admits 64 connections within 60 s.
// TCP's are text because its hello has carried a length-prefixed ticket from the start and its
// caller may pick its own (Target.issue_ticket(key, ticket), which the hostile-input tests drive
// with tickets of their own); the ones drawn here are 128 random bits in hex.
// A key holds one ticket: issuing again returns it, its age and uses renewed. A table keeps at
// most maxTickets (the oldest issued is dropped to make room) and counts every presentation that
// admitted nothing, with what its plane adds (a wrong token, a reply to no request of ours).
// Thread-safe.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <list>
#include <mutex>
#include <string>
#include <unordered_map>

namespace mori {

// How many tickets a table keeps and what each admits.
struct TicketRules {
    size_t maxTickets = 1;  // tickets kept at once; the oldest issued is dropped to make room
    double ttl = 0;         // seconds a ticket admits after it is issued; 0: until it is dropped
    uint32_t uses = 0;      // admissions a ticket gives, then it is dropped; 0: no bound
};

// A fresh ticket from the kernel's CSPRNG (getrandom): 64 bits, never 0; text: 128 bits as 32 hex
// digits. Throws std::runtime_error when the kernel gives none.
void draw_ticket(uint64_t& ticket);
void draw_ticket(std::string& ticket);

// Whether a and b are equal, in a time that depends on their lengths only (secrets an attacker
// presents: tokens, the key a ticket was issued to).
bool equal_const_time(const std::string& a, const std::string& b);

template <typename Ticket>
class TicketTable {
public:
    // Throws std::invalid_argument unless rules.maxTickets >= 1 and 0 <= ttl < 1e9.
    explicit TicketTable(TicketRules rules);
    // key's ticket: the one it holds, renewed, else a fresh one (dropping the oldest when full).
    // Throws std::invalid_argument unless key is 1..4096 bytes.
    Ticket issue(const std::string& key);
    // Gives key a ticket its caller picked, renewed if key held it already; a ticket key held
    // before no longer admits, nor does ticket admit any other key it was issued to.
    void grant(const std::string& key, const Ticket& ticket);
    // The key ticket admits (one of its uses), or "": unknown, expired or dropped (counted bad).
    std::string admit(const Ticket& ticket);
    // Whether ticket admits key (one of its uses). Issued to another key it admits nothing and
    // stays valid for that one; either way a refusal is counted bad.
    bool admit(const Ticket& ticket, const std::string& key);
    // A refusal the plane found itself (the table's own are counted by admit).
    void count_bad() { bad_.fetch_add(1, std::memory_order_relaxed); }
    uint64_t bad() const { return bad_.load(std::memory_order_relaxed); }

private:
    struct Entry {
        std::string key;
        int64_t expiresNs;  // INT64_MAX: no age bound
        uint32_t usesLeft;  // 0: no bound
        typename std::list<Ticket>::iterator order;
    };
    using Entries = std::unordered_map<Ticket, Entry>;
    // The entry of ticket if it admits at now (an expired one is dropped), else end().
    typename Entries::iterator live_locked(const Ticket& ticket, int64_t now);
    // One admission by it: a ticket whose uses are spent is dropped.
    void use_locked(typename Entries::iterator it);
    void drop_locked(typename Entries::iterator it);
    // Makes it key's ticket anew: its age and uses from now, last in the issue order.
    void renew_locked(Entry& e, int64_t now);
    // Adds ticket for key (which holds none), after dropping the expired and, when full, the oldest.
    void insert_locked(const std::string& key, const Ticket& ticket, int64_t now);

    const TicketRules rules_;
    const int64_t ttlNs_;
    std::mutex mu_;
    Entries entries_;
    std::unordered_map<std::string, Ticket> byKey_;
    std::list<Ticket> order_;  // issue (or renewal) order, oldest first: also the order they expire in
    std::atomic<uint64_t> bad_{0};
};

extern template class TicketTable<uint64_t>;
extern template class TicketTable<std::string>;

}  // namespace mori
