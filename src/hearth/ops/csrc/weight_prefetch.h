// Software prefetch of weight rows a little ahead of the skinny kernels' tiles. A skinny product uses each weight
// once; with the weights cold (a decode step streams ~100 MB through caches that hold a fraction of it) the
// hardware prefetcher alone left a W8A32 LM head (49,152 x 576 Q8_0) at ~2 ms, against ~0.5 ms to merely sum its
// bytes: the loads' latency was not hidden behind the arithmetic. Asking ~8 KB ahead brought it to ~0.7 ms.
// (The INT4 loops do without: rows of half the bytes and more arithmetic a byte, and a batch-1 decode stack step
// was ~5% slower with them prefetching.)
#pragma once

#include <algorithm>
#include <cstdint>

namespace hearth {

constexpr int64_t kPrefetchAheadBytes = 8192;

inline void prefetch_line(const char* address) {
#if defined(__x86_64__)
  // As an asm statement: GCC 12 deleted __builtin_prefetch / _mm_prefetch loops here at -O1 and above.
  asm volatile("prefetcht0 %0" : : "m"(*address));
#else
  __builtin_prefetch(address, 0, 3);
#endif
}

// Rows [o, o + rows) of a row-major array of `row_bytes`-byte rows, shifted `kPrefetchAheadBytes` ahead and cut
// at row `end`, towards L1.
inline void prefetch_ahead(const void* base, int64_t row_bytes, int64_t o, int64_t rows, int64_t end) {
  const char* array = static_cast<const char*>(base);
  const int64_t from = o * row_bytes + kPrefetchAheadBytes;
  const int64_t to = std::min(end * row_bytes, from + rows * row_bytes);
  for (int64_t b = from; b < to; b += 64) prefetch_line(array + b);
}

}  // namespace hearth
