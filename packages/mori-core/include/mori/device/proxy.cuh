// Device-initiated RMA to PEs whose heaps are not mapped here (another host, or MORI_DISABLE_P2P):
// the device API posts each operation as a command into the ring of mori-core's proxy
// (proxy_ring.cuh), a host thread that executes it on the UCX engine, and waits on the ring's
// header where it must (blocking calls, quiet, fetching atomics, g, the barrier).
//
// - put/get (nbi): issued when the command is posted; complete after ShmemQuiet*, as over P2P.
//   The local buffer of a put or get must be global memory (the proxy's UCX reads or writes it),
//   except puts of up to 16 bytes, whose bytes travel in the command.
// - blocking put/get, p, atomics, g: the calling group waits until the proxy completed it.
// - put with signal: the proxy applies the signal once the target has the bytes; up to 8 bytes
//   travel in the command, and with the signal in one message.
// - quiet: waits until every command this PE posted is complete; fence: a command after which
//   the proxy starts nothing to a PE until that PE's earlier commands are complete (none when
//   nothing is in flight); the barrier's arrival at a remote PE is an atomic store that the
//   proxy orders after every earlier command.
// Waits poll the header in host-mapped memory, fail the kernel with a report naming the PE when
// the proxy reports a failed operation, and give up after MORI_DEVICE_WAIT_TIMEOUT_NS.
// This is the one place a GPU-initiated RDMA provider (IBGDA) would replace: the posting
// functions below, behind the same device API.
#pragma once

#include "group.cuh"
#include "p2p.cuh"
#include "proxy_ring.cuh"

namespace mori {
namespace device {
namespace detail {

// The unsigned integer of kBytes bytes (1, 2, 4 or 8): the bits of an operand or of g's value.
// (Not named N: a user's kernel source may #define N before including the headers.)
template <int kBytes>
using UintOf =
    typename Conditional<kBytes == 1, uint8_t,
                         typename Conditional<kBytes == 2, uint16_t,
                                              typename Conditional<kBytes == 4, uint32_t, uint64_t>::type>::type>::type;
template <class T>
MORI_DEVICE_INLINE uint64_t BitsOf(T v) {
  return static_cast<uint64_t>(BitCast<UintOf<sizeof(T)>>(v));
}

MORI_DEVICE_INLINE bool HasProxy() { return (StateFlags() & kFlagProxy) != 0; }

MORI_DEVICE_INLINE ProxyHeader* ProxyRingHeader() { return reinterpret_cast<ProxyHeader*>(globalGpuStates.proxyRing); }

MORI_DEVICE_COLD void FailProxy(const char* op, int pe) {
  MORI_DEVICE_FAIL("%s: the proxy's operation to PE %d failed (the host log says why)", op, pe);
}

MORI_DEVICE_COLD void FailProxyTimeout(const char* op, const char* what, int pe) {
  MORI_DEVICE_FAIL("%s: timed out after %llu ns waiting for %s (oldest operation in flight: PE %d)", op,
                   static_cast<unsigned long long>(MORI_DEVICE_WAIT_TIMEOUT_NS), what, pe);
}

// Polls `word` (host-mapped) until it equals `target` (exact) or reaches it; fails the kernel when
// the proxy reports a failure or the wait passes MORI_DEVICE_WAIT_TIMEOUT_NS.
MORI_DEVICE_FUNC void ProxyWait(const unsigned long long* word, unsigned long long target, bool exact, const char* op,
                                const char* what) {
  ProxyHeader* h = ProxyRingHeader();
  uint64_t start = 0;
  uint32_t sleep = 32;
#pragma unroll 1
  for (int i = 0;; ++i) {
    const unsigned long long seen = ptx::LoadAcquireSys(word);
    if (exact ? seen == target : seen >= target) return;
    const unsigned long long failed = ptx::LoadRelaxedSys(&h->failed);
    if (MORI_DEVICE_UNLIKELY(failed != 0)) FailProxy(op, static_cast<int>(failed - 1));
    if (i < 64) continue;
    if (start == 0) start = ptx::GlobalTimerNs();
    ptx::Nanosleep(sleep);
    if (sleep < 1024) sleep *= 2;
    if (MORI_DEVICE_WAIT_TIMEOUT_NS != 0 &&
        MORI_DEVICE_UNLIKELY(ptx::GlobalTimerNs() - start > MORI_DEVICE_WAIT_TIMEOUT_NS)) {
      FailProxyTimeout(op, what, static_cast<int>(ptx::LoadRelaxedSys(&h->waitingPe)) - 1);
    }
  }
}

// Checks that [sym, sym + bytes) lies in this PE's heap and that PE `pe` is served by the proxy;
// returns the heap offset. Otherwise reports what was wrong and aborts the kernel.
MORI_DEVICE_INLINE uint64_t ProxyOffset(const void* sym, uint64_t bytes, int pe, const char* op) {
  const uint64_t offset = reinterpret_cast<uint64_t>(sym) - StateHeapBase();
  const bool inRange = static_cast<uint32_t>(pe) < static_cast<uint32_t>(StateWorldSize());
  if (MORI_DEVICE_UNLIKELY(!HasProxy() || !inRange || offset >= StateHeapSize() || bytes > StateHeapSize() - offset)) {
    FailRemote(op, sym, pe);
  }
  return offset;
}

struct ProxyRequest {
  uint32_t command;
  int pe;
  uint64_t remote, local, bytes, value, compare;
  uint32_t op, width, flags;
};

// Posts one command; returns its ticket. Waits for its slot when the ring is full.
MORI_DEVICE_FUNC uint64_t ProxyPost(const ProxyRequest& r, const char* op) {
  const uint64_t ring = globalGpuStates.proxyRing;
  const uint64_t t = ptx::AtomAddSys(reinterpret_cast<uint64_t*>(globalGpuStates.proxyTickets), uint64_t(1));
  ProxySlot* slot = reinterpret_cast<ProxySlot*>(ring + sizeof(ProxyHeader)) + (t & (kProxySlots - 1));
  ProxyWait(&slot->seq, 4ull * t, true, op, "a free slot in the proxy's ring");
  volatile ProxySlot* s = slot;
  s->command = r.command;
  s->pe = r.pe;
  s->remote = r.remote;
  s->local = r.local;
  s->bytes = r.bytes;
  s->value = r.value;
  s->compare = r.compare;
  s->op = static_cast<unsigned char>(r.op);
  s->width = static_cast<unsigned char>(r.width);
  s->flags = static_cast<unsigned char>(r.flags);
  // Release at system scope: the fields, and what this thread wrote before (a put's source), are
  // visible to the proxy once it sees the slot posted.
  ptx::StoreReleaseSys(&slot->seq, 4ull * t + 1);
  return t;
}

// Waits until the command of ticket t (and every earlier one) is complete.
MORI_DEVICE_FUNC void ProxyWaitComplete(uint64_t t, const char* op) {
  ProxyWait(&ProxyRingHeader()->completed, t + 1, false, op, "the proxy to complete an operation");
}

// Waits for the answer of the command of ticket t, frees its slot, returns the answer.
MORI_DEVICE_FUNC uint64_t ProxyAnswer(uint64_t t, const char* op) {
  ProxySlot* slot =
      reinterpret_cast<ProxySlot*>(globalGpuStates.proxyRing + sizeof(ProxyHeader)) + (t & (kProxySlots - 1));
  ProxyWait(&slot->seq, 4ull * t + 2, true, op, "the proxy's answer");
  const uint64_t value = ptx::LoadRelaxedSys(&slot->value);
  ptx::StoreReleaseSys(&slot->seq, 4ull * (t + kProxySlots));
  return value;
}

// Completes every command this PE posted so far (quiet).
MORI_DEVICE_FUNC void ProxyQuiet(const char* op) {
  const uint64_t posted = ptx::LoadRelaxedSys(reinterpret_cast<const uint64_t*>(globalGpuStates.proxyTickets));
  if (posted != 0) ProxyWait(&ProxyRingHeader()->completed, posted, false, op, "the proxy to complete");
}

// A put or get through the proxy in scope G (every thread of the group calls it alike): the
// group's stores are fenced, one thread posts, and with `wait` the group leaves once it is complete.
template <class G>
MORI_DEVICE_FUNC void ProxyTransfer(bool put, void* local, const void* sym, size_t bytes, int pe, bool wait,
                                    const char* op) {
  const uint64_t offset = ProxyOffset(sym, bytes, pe, op);
  if constexpr (!G::kAlone) {
    ptx::FenceAcqRelSys();
    G::Sync();
  }
  if (G::Rank() == 0 && bytes != 0) {
    ProxyRequest r{put ? kProxyPut : kProxyGet, pe, offset, reinterpret_cast<uint64_t>(local), bytes, 0, 0, 0, 0, 0};
    if (put && bytes <= 16) {
      // Small puts carry their bytes: the source may be any memory of this thread (even local).
      const unsigned char* from = static_cast<const unsigned char*>(local);
      uint64_t words[2] = {0, 0};
      for (size_t i = 0; i < bytes; ++i) words[i / 8] |= static_cast<uint64_t>(from[i]) << (8 * (i % 8));
      r.command = kProxyPutInline;
      r.value = words[0];
      r.compare = words[1];
    }
    const uint64_t t = ProxyPost(r, op);
    if (wait) ProxyWaitComplete(t, op);
  }
  if constexpr (!G::kAlone) {
    if (wait) G::Sync();
  }
}

// A put with signal through the proxy (the signal's operation in mori-core's atomic codes).
template <class G>
MORI_DEVICE_FUNC void ProxyPutSignal(const void* sym, const void* source, size_t bytes, const uint64_t* sig,
                                     uint64_t sigVal, bool add, int pe, const char* op) {
  const uint64_t offset = ProxyOffset(sym, bytes, pe, op);
  const uint64_t sigOffset = ProxyOffset(sig, 8, pe, op);
  if constexpr (!G::kAlone) {
    ptx::FenceAcqRelSys();
    G::Sync();
  }
  if (G::Rank() == 0) {
    ProxyRequest r{kProxyPut, pe,
                   offset,    reinterpret_cast<uint64_t>(source),
                   bytes,     sigVal,
                   sigOffset, add ? kProxyAmoFetchAdd : kProxyAmoStore,
                   64,        kProxyFlagSignal};
    if (bytes != 0 && bytes <= 8) {
      // A few bytes travel in the command: the proxy sends them with the signal in one message,
      // with no copy out of the GPU first (the source may be any memory of this thread).
      const unsigned char* from = static_cast<const unsigned char*>(source);
      uint64_t word = 0;
      for (size_t i = 0; i < bytes; ++i) word |= static_cast<uint64_t>(from[i]) << (8 * i);
      r.local = word;
      r.flags |= kProxyFlagInline;
    }
    ProxyPost(r, op);
  }
}

// An atomic through the proxy (op: mori-core's atomic codes); with `fetch` waits for and
// returns the old value, else returns once posted (complete after quiet).
template <class T>
MORI_DEVICE_FUNC T ProxyAtomic(T* sym, int pe, uint32_t amo, T value, T compare, bool fetch, const char* op) {
  const uint64_t offset = ProxyOffset(sym, sizeof(T), pe, op);
  ProxyRequest r{kProxyAtomic,    pe,
                 offset,          0,
                 sizeof(T),       BitsOf(value),
                 BitsOf(compare), amo,
                 8 * sizeof(T),   fetch ? kProxyFlagReply : 0u};
  const uint64_t t = ProxyPost(r, op);
  return fetch ? static_cast<T>(ProxyAnswer(t, op)) : T(0);
}

// g through the proxy: the value of `sym` on PE `pe`.
template <class T>
MORI_DEVICE_FUNC T ProxyG(const T* sym, int pe, const char* op) {
  const uint64_t offset = ProxyOffset(sym, sizeof(T), pe, op);
  ProxyRequest r{kProxyGetInline, pe, offset, 0, sizeof(T), 0, 0, 0, 0, kProxyFlagReply};
  const uint64_t bits = ProxyAnswer(ProxyPost(r, op), op);
  return BitCast<T>(static_cast<UintOf<sizeof(T)>>(bits));
}

// A fence: the proxy makes the next command to each PE (to `pe` alone when pe >= 0) that has
// commands in flight wait until they are complete. Commands of one PE to another do not keep
// their order on the wire (a small put overtakes a large one), so a fence with commands in flight
// must reach the proxy; with none in flight (every ticket taken is complete) there is nothing to
// order and no command is posted.
MORI_DEVICE_FUNC void ProxyFence(const char* op, int pe = -1) {
  const uint64_t posted = ptx::LoadRelaxedSys(reinterpret_cast<const uint64_t*>(globalGpuStates.proxyTickets));
  if (ptx::LoadRelaxedSys(&ProxyRingHeader()->completed) >= posted) return;
  ProxyRequest r{kProxyFence, StateRank(), 0, 0, 0, pe < 0 ? 0 : uint64_t(pe) + 1, 0, 0, 0, 0};
  ProxyPost(r, op);
}

// The barrier's arrival at remote PE `pe`: `epoch` stored into this PE's slot there, after every
// earlier command of this PE is complete.
MORI_DEVICE_FUNC void ProxyArrive(int pe, uint64_t slotOffset, uint64_t epoch, const char* op) {
  ProxyRequest r{kProxyAtomic, pe, slotOffset, 0, 8, epoch, 0, kProxyAmoStore, 64, kProxyFlagOrdered};
  ProxyPost(r, op);
}

}  // namespace detail
}  // namespace device
}  // namespace mori
