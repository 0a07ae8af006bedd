// The kernel library's thread pool (cpu_pool.cpp).
#pragma once

#include <stdint.h>

#include <functional>

// job(part, parts) for part = 0 .. parts - 1, part 0 on the calling thread, the others on the pool's
// workers; returns when all are done. Parts must not depend on each other or call dw_parallel.
using DwJob = std::function<void(int, int)>;
void dw_parallel(int parts, const DwJob& job);

// [begin, end) of n items for part `part` of `parts`: contiguous, in order, sizes differing by at most one.
static inline void dw_split(int64_t n, int part, int parts, int64_t& begin, int64_t& end) {
    begin = n * part / parts;
    end = n * (part + 1) / parts;
}
