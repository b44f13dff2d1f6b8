// The command ring between a GPU's kernels and mori-core's proxy thread: the one layout both
// sides use (the device API posts in proxy.cuh; the proxy, csrc/proxy/proxy.cpp, executes). Plain
// types and no includes, so it compiles as CUDA (nvcc, NVRTC, clang -nocudainc) and as host C++.
//
// The ring lives in host-mapped (pinned, device-mapped) memory: a ProxyHeader, then kProxySlots
// ProxySlots. A kernel takes ticket t from a counter in GPU memory (an atomic add), waits until
// slot t % kProxySlots is free for t (seq == 4t), fills it and publishes it with a release store
// of seq = 4t + 1. The proxy takes tickets in order, executes each on the UCX engine and frees the
// slot (seq = 4(t + kProxySlots)); a command with a reply (a fetching atomic, g) is answered
// instead (value = the reply, seq = 4t + 2) and the kernel frees the slot once it has read it.
// The proxy publishes `completed`: every ticket below it is complete at its target.
#pragma once

namespace mori {
namespace device {

// Slots in every PE's ring (a power of two): up to this many commands are posted and not yet
// taken by the proxy; a kernel that finds its slot still in use waits for it (backpressure).
constexpr unsigned long long kProxySlots = 1024;

// ProxySlot::command
enum ProxyCommand : unsigned int {
  kProxyPut = 1,        // bytes from local address `local` to heap offset `remote` of PE `pe`
  kProxyGet = 2,        // bytes from heap offset `remote` of PE `pe` to local address `local`
  kProxyPutInline = 3,  // up to 16 bytes carried in `value` then `compare` (p, immediates)
  kProxyGetInline = 4,  // up to 8 bytes into the reply (g)
  kProxyAtomic = 5,     // op `op` (mori-core's UCX atomic codes) of `width` bits at `remote`
  kProxyFence = 6,      // the next command to a PE with commands in flight waits for them:
                        // every PE, or PE `value` - 1 alone when value != 0
};

// ProxySlot::flags
constexpr unsigned int kProxyFlagReply = 1u;    // answer with the old value / the bytes read
constexpr unsigned int kProxyFlagOrdered = 2u;  // start once every earlier command is complete
constexpr unsigned int kProxyFlagSignal = 4u;   // a put with signal: once the bytes are written,
                                                // apply op `op` with `value` to the 64-bit word at
                                                // heap offset `compare` of the same PE
constexpr unsigned int kProxyFlagInline = 8u;   // with kProxyFlagSignal: the put's 1 to 8 bytes are
                                                // carried in `local` (first byte lowest), not read
                                                // from an address

// The atomic codes of mori-core's UCX engine (ucx/atomic.hpp's AtomicOp), for ProxySlot::op.
constexpr unsigned int kProxyAmoFetchAdd = 1, kProxyAmoCompareSwap = 2, kProxyAmoSwap = 3, kProxyAmoStore = 4,
                       kProxyAmoFetchAnd = 5, kProxyAmoFetchOr = 6, kProxyAmoFetchXor = 7;

struct ProxySlot {
  unsigned long long seq;      // 4t: free for ticket t; 4t + 1: posted; 4t + 2: answered
  unsigned int command;        // ProxyCommand
  int pe;                      // target PE
  unsigned long long remote;   // heap offset at the target
  unsigned long long local;    // local address (put source, get destination); inline signal bytes
  unsigned long long bytes;    // bytes to move (inline: 1..16 / 1..8)
  unsigned long long value;    // atomic operand, signal value, inline bytes; the reply
  unsigned long long compare;  // compare-swap's compare, signal offset, inline bytes 8..15
  unsigned char op;            // atomic / signal operation (kProxyAmo*)
  unsigned char width;         // atomic width in bits (32, 64)
  unsigned char flags;         // kProxyFlag*
  unsigned char reserved[5];
};

struct ProxyHeader {
  unsigned long long slots;      // kProxySlots (checked by both sides)
  unsigned long long completed;  // every ticket below this is complete (the proxy writes it)
  unsigned long long failed;     // 0, or 1 + the first PE an operation to which failed (sticky)
  unsigned long long waitingPe;  // 1 + the PE of the oldest command in flight; 0 when none
  unsigned long long taken;      // tickets the proxy has taken (the next one it expects)
  unsigned long long reserved[3];
};

static_assert(sizeof(ProxySlot) == 64, "ProxySlot is 64 bytes");
static_assert(sizeof(ProxyHeader) == 64, "ProxyHeader is 64 bytes");
static_assert((kProxySlots & (kProxySlots - 1)) == 0, "kProxySlots is a power of two");

}  // namespace device
}  // namespace mori
