// The kernel library's own thread pool (cpu_pool.h): every parallel loop of the library runs on it.
//
// Why not OpenMP (PyTorch's libgomp, which the library used before): libgomp keeps one pool of threads
// per thread that starts parallel regions, and once its threads outnumber the CPUs (a process whose
// main thread ran torch ops, and whose engine runs on another thread, as `draftwise serve`'s worker
// does) it stops spinning between regions: each of a step's ~150 regions then waits for a futex
// wake-up. SmolLM2-135M decode ran at half speed on a non-main thread (16.2 against 7.8-8.9 ms a token).
//
// A job is a loop split in chunks. The caller and the workers claim chunks one at a time from one
// atomic word, so the caller never waits for a worker that has not started (another process may hold
// the cores: a pool that gives each thread a fixed part waits a scheduler quantum per job then), only
// for chunks already claimed. Workers spin for a while (SPIN_NS) after each job, whoever calls,
// yielding the core to any thread that wants it, then sleep on a condition variable until the next.
//
// One caller at a time runs jobs on the pool; a caller that finds it busy (another thread's step)
// runs its job alone (the results are the same: chunks are independent). After fork() the child
// starts with no workers (pthread_atfork).

#include "cpu_pool.h"

#include <emmintrin.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace {

constexpr int64_t SPIN_NS = 2'000'000;  // a worker spins this long after a job before it sleeps
constexpr int MAX_WORKERS = 255;
constexpr int CHUNK_BITS = 20, GEN_BITS = 64 - 2 * CHUNK_BITS;
constexpr uint64_t CHUNK_MASK = (uint64_t(1) << CHUNK_BITS) - 1;

// The claim word: generation | chunks | next chunk. One word, so that a worker never pairs one job's
// generation with another's chunk count; a chunk claimed keeps its job (and the job's caller) alive.
inline uint64_t claim_word(uint64_t gen, uint64_t chunks, uint64_t next) {
    return (gen << (2 * CHUNK_BITS)) | (chunks << CHUNK_BITS) | next;
}

struct Pool {
    std::mutex caller;  // held by the thread running a job on the pool
    std::mutex sleep_lock;
    std::condition_variable wake;
    std::atomic<uint64_t> claim{0};
    std::atomic<int64_t> done{0};  // chunks of the current job finished
    std::atomic<int> sleepers{0};
    const DwChunkJob* job = nullptr;
    int64_t n = 0, grain = 1;
    int workers = 0;  // started (detached; they live as long as the process)
};

Pool* pool = new Pool();  // never destroyed: detached workers may touch it during exit

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

// Claims and runs chunks of the job of generation `gen` until none is left.
void run_chunks(Pool* p, uint64_t gen) {
    uint64_t c = p->claim.load(std::memory_order_acquire);
    for (;;) {
        const uint64_t chunks = (c >> CHUNK_BITS) & CHUNK_MASK, next = c & CHUNK_MASK;
        if ((c >> (2 * CHUNK_BITS)) != gen || next >= chunks) return;
        if (!p->claim.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel)) continue;
        const int64_t begin = static_cast<int64_t>(next) * p->grain;
        const int64_t end = begin + p->grain < p->n ? begin + p->grain : p->n;
        (*p->job)(begin, end);
        p->done.fetch_add(1, std::memory_order_acq_rel);
        c = p->claim.load(std::memory_order_acquire);
    }
}

void worker(Pool* p, uint64_t seen) {  // joins every job after generation `seen`
    for (;;) {
        const int64_t until = now_ns() + SPIN_NS;
        uint64_t gen;
        int spins = 0;
        while ((gen = p->claim.load(std::memory_order_acquire) >> (2 * CHUNK_BITS)) == seen) {
            _mm_pause();
            if (++spins % 64 != 0) continue;
            sched_yield();  // spinning, but a thread of another process waiting for this core runs first
            if (now_ns() > until) {
                std::unique_lock<std::mutex> lock(p->sleep_lock);
                p->sleepers.fetch_add(1);
                p->wake.wait(lock, [&] { return (p->claim.load(std::memory_order_acquire) >> (2 * CHUNK_BITS)) != seen; });
                p->sleepers.fetch_sub(1);
            }
        }
        seen = gen;
        run_chunks(p, gen);
    }
}

void after_fork_in_child() {  // the workers did not come along
    pool = new Pool();
}

}  // namespace

void dw_parallel_for(int threads, int64_t n, int64_t grain, const DwChunkJob& body) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    if ((n + grain - 1) / grain > static_cast<int64_t>(CHUNK_MASK)) grain = (n + CHUNK_MASK - 1) / CHUNK_MASK;
    const int64_t chunks = (n + grain - 1) / grain;
    if (threads > MAX_WORKERS + 1) threads = MAX_WORKERS + 1;
    if (threads <= 1 || chunks <= 1) {
        body(0, n);
        return;
    }
    Pool* p = pool;
    std::unique_lock<std::mutex> mine(p->caller, std::try_to_lock);
    if (!mine.owns_lock()) {  // another thread's job holds the pool: this one alone
        body(0, n);
        return;
    }
    static std::once_flag fork_hook;
    std::call_once(fork_hook, [] { pthread_atfork(nullptr, nullptr, after_fork_in_child); });
    const uint64_t current = p->claim.load(std::memory_order_relaxed) >> (2 * CHUNK_BITS);
    const uint64_t gen = (current + 1) & ((uint64_t(1) << GEN_BITS) - 1);
    while (p->workers < threads - 1) {  // a new worker waits for the next generation
        std::thread(worker, p, current).detach();
        ++p->workers;
    }
    p->job = &body;
    p->n = n;
    p->grain = grain;
    p->done.store(0, std::memory_order_relaxed);
    {
        std::lock_guard<std::mutex> lock(p->sleep_lock);  // a worker going to sleep sees the new generation
        p->claim.store(claim_word(gen, chunks, 0), std::memory_order_release);
    }
    if (p->sleepers.load() > 0) p->wake.notify_all();
    run_chunks(p, gen);
    int spins = 0;
    while (p->done.load(std::memory_order_acquire) < chunks) {  // chunks other threads claimed
        _mm_pause();
        if (++spins % 64 == 0) sched_yield();
    }
}

extern "C" int dw_pool_workers(void) { return pool->workers; }  // started so far (tests)
