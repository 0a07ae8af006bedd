// The kernel library's own thread pool (cpu_pool.h): every parallel loop of the library runs on it.
//
// Why not OpenMP (PyTorch's libgomp, which the library used before): libgomp keeps one pool of threads
// per thread that starts parallel regions, and once its threads outnumber the CPUs (a process whose
// main thread ran torch ops, and whose engine runs on another thread, as `draftwise serve`'s worker
// does) it stops spinning between regions: each of a step's ~150 regions then waits for a futex
// wake-up. SmolLM2-135M decode ran at half speed on a non-main thread (16.2 against 7.8-8.9 ms a token).
// This pool's workers spin for a while (SPIN_NS) after each job, whoever calls, then sleep on a
// condition variable until the next.
//
// One caller at a time runs jobs on the pool; a caller that finds it busy (another thread's step)
// runs its job on its own thread (the results are the same: every job's parts are independent).
// After fork() the child starts with no workers (pthread_atfork).

#include "cpu_pool.h"

#include <emmintrin.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace {

constexpr int64_t SPIN_NS = 2'000'000;  // a worker spins this long after a job before it sleeps
constexpr int MAX_WORKERS = 254;  // parts fit the state word's low byte

struct Pool {
    std::mutex caller;  // held by the thread running a job on the pool
    std::mutex sleep_lock;
    std::condition_variable wake;
    // (generation << 8) | parts: one word, so that a worker never pairs one job's generation with
    // another's part count; the job itself is read only by its participants, whom its caller waits for
    std::atomic<uint64_t> state{0};
    std::atomic<int> pending{0};  // participants still in the current job
    std::atomic<int> sleepers{0};
    const DwJob* job = nullptr;
    int workers = 0;  // started (detached; they live as long as the process)
};

Pool* pool = new Pool();  // never destroyed: detached workers may touch it during exit

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

// Runs part index + 1 of every job after generation `seen` with more parts than that.
void worker(Pool* p, int index, uint64_t seen) {
    for (;;) {
        const int64_t until = now_ns() + SPIN_NS;
        uint64_t s;
        int spins = 0;
        while (((s = p->state.load(std::memory_order_acquire)) >> 8) == seen) {
            _mm_pause();
            if (++spins % 256 == 0 && now_ns() > until) {
                std::unique_lock<std::mutex> lock(p->sleep_lock);
                p->sleepers.fetch_add(1);
                p->wake.wait(lock, [&] { return (p->state.load(std::memory_order_acquire) >> 8) != seen; });
                p->sleepers.fetch_sub(1);
            }
        }
        seen = s >> 8;
        const int parts = static_cast<int>(s & 0xFF);
        if (index + 1 < parts) {
            (*p->job)(index + 1, parts);
            p->pending.fetch_sub(1, std::memory_order_acq_rel);
        }
    }
}

void after_fork_in_child() {  // the workers did not come along
    pool = new Pool();
}

}  // namespace

void dw_parallel(int parts, const DwJob& job) {
    if (parts > MAX_WORKERS + 1) parts = MAX_WORKERS + 1;
    if (parts <= 1) {
        job(0, 1);
        return;
    }
    Pool* p = pool;
    std::unique_lock<std::mutex> mine(p->caller, std::try_to_lock);
    if (!mine.owns_lock()) {  // another thread's job holds the pool: this one alone
        job(0, 1);
        return;
    }
    static std::once_flag fork_hook;
    std::call_once(fork_hook, [] { pthread_atfork(nullptr, nullptr, after_fork_in_child); });
    const uint64_t now = p->state.load(std::memory_order_relaxed) >> 8;  // a new worker waits for the next
    while (p->workers < parts - 1) std::thread(worker, p, p->workers++, now).detach();
    p->job = &job;
    p->pending.store(parts - 1, std::memory_order_relaxed);
    {
        std::lock_guard<std::mutex> lock(p->sleep_lock);  // a worker going to sleep sees the new generation
        const uint64_t next = (p->state.load(std::memory_order_relaxed) >> 8) + 1;
        p->state.store((next << 8) | static_cast<uint64_t>(parts), std::memory_order_release);
    }
    if (p->sleepers.load() > 0) p->wake.notify_all();
    job(0, parts);
    while (p->pending.load(std::memory_order_acquire) > 0) _mm_pause();
}

extern "C" int dw_pool_workers(void) { return pool->workers; }  // started so far (tests)
