// The kernel library's thread pool (cpu_pool.cpp).
#pragma once

#include <stdint.h>

#include <functional>

// body(begin, end) over [0, n) in chunks of `grain` items (the last one shorter), on up to `threads` threads:
// the caller's and the pool's workers, each claiming the next chunk when it is free; returns when all are
// done. Chunks must not depend on each other or call dw_parallel_for.
using DwChunkJob = std::function<void(int64_t, int64_t)>;
void dw_parallel_for(int threads, int64_t n, int64_t grain, const DwChunkJob& body);

// A grain that gives each of `threads` threads about four chunks of n items.
static inline int64_t dw_grain(int64_t n, int threads) {
    const int64_t g = n / (4 * static_cast<int64_t>(threads > 1 ? threads : 1));
    return g > 0 ? g : 1;
}
