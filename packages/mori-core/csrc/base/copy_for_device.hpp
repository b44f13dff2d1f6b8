// Copies into host memory that a device reads next (a copy engine staging it to a GPU), not this
// CPU: non-temporal stores skip reading each destination line in first and leave the cache to
// the bytes this CPU works on. The data planes copy received bytes into staged memory with it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace mori {

// Copies n bytes from src to dst (plain memcpy for the unaligned ends, and where SSE2 is
// missing); the stores are visible to other agents when it returns.
inline void copy_for_device(void* dst, const void* src, size_t n) {
#if defined(__SSE2__)
    auto* d = static_cast<char*>(dst);
    const auto* s = static_cast<const char*>(src);
    const size_t head = std::min(n, static_cast<size_t>((16 - reinterpret_cast<uintptr_t>(d) % 16) % 16));
    std::memcpy(d, s, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
        const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
        _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
        _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
        _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
        _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
    }
    std::memcpy(d + i, s + i, n - i);
    _mm_sfence();  // before the caller hands the memory to the device
#else
    std::memcpy(dst, src, n);
#endif
}

}  // namespace mori
