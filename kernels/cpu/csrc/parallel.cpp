// The pool behind corefleet::parallel_for (parallel.h): why it exists is explained there.
//
// One job at a time. The caller publishes a job (its chunks, function and context), bumps the
// generation word the helpers wait on, and claims chunks like any helper. A helper enters a
// job by counting itself in `users_` and checking that the job is still active; it leaves by
// counting itself out. The caller returns once every chunk is done and no helper is inside,
// so the job's fields (and the caller's stack the context points into) are never read late.
//
// Waiting: a short spin first (back-to-back regions of one step are microseconds apart), then
// a futex. Every store/load pair that decides whether to sleep is sequentially consistent, so
// that of "I am going to sleep" and "I changed the word" at least one side sees the other.
#include "parallel.h"

#include <ATen/Parallel.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace corefleet {
namespace {

// Chunks per thread: enough that a thread descheduled for a while costs the others little.
constexpr int64_t kChunksPerThread = 8;
// How long an idle thread spins before it sleeps. Longer catches more regions without a
// wake-up (a futex wake costs tens of microseconds in a VM), shorter leaves more of the cores
// to a neighbour and to our own other threads.
constexpr std::chrono::microseconds kSpin{30};

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

inline uint32_t* word(std::atomic<uint32_t>& a) { return reinterpret_cast<uint32_t*>(&a); }

void futex_wait(std::atomic<uint32_t>& a, uint32_t expected) {
  syscall(SYS_futex, word(a), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>& a) {
  syscall(SYS_futex, word(a), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

// Spins up to kSpin for `a` to leave `value`, then sleeps on it; `sleeping` is raised while
// asleep so that the writer knows to wake us. Returns the new value.
uint32_t wait_while_equal(std::atomic<uint32_t>& a, uint32_t value, std::atomic<uint32_t>& sleeping,
                          const std::atomic<bool>& stop) {
  const auto deadline = std::chrono::steady_clock::now() + kSpin;
  for (uint32_t i = 1;; ++i) {
    const uint32_t now = a.load(std::memory_order_acquire);
    if (now != value || stop.load(std::memory_order_relaxed)) {
      return now;
    }
    if (i % 32 == 0 && std::chrono::steady_clock::now() > deadline) {
      break;
    }
    cpu_relax();
  }
  for (;;) {
    sleeping.fetch_add(1, std::memory_order_seq_cst);
    if (a.load(std::memory_order_seq_cst) == value && !stop.load(std::memory_order_seq_cst)) {
      futex_wait(a, value);  // returns at once if the word already changed
    }
    sleeping.fetch_sub(1, std::memory_order_seq_cst);
    const uint32_t now = a.load(std::memory_order_acquire);
    if (now != value || stop.load(std::memory_order_relaxed)) {
      return now;
    }
  }
}

class Pool {
 public:
  // Deliberately never destroyed (see instance()): helpers end with the process.
  void run(int64_t begin, int64_t end, int64_t chunk, int64_t chunks, int64_t threads, ChunkFn fn,
           const void* ctx) {
    resize(threads - 1);
    fn_ = fn;
    ctx_ = ctx;
    begin_ = begin;
    end_ = end;
    chunk_ = chunk;
    chunks_ = static_cast<uint32_t>(chunks);
    next_.store(0, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    active_.store(true, std::memory_order_seq_cst);
    generation_.fetch_add(1, std::memory_order_seq_cst);
    if (helper_sleepers_.load(std::memory_order_seq_cst) > 0) {
      futex_wake_all(generation_);
    }

    work();
    // Every chunk claimed; wait for those still running elsewhere, then for stragglers that
    // entered the job and have not left yet.
    for (uint32_t done = done_.load(std::memory_order_acquire); done != chunks_;) {
      done = wait_while_equal(done_, done, caller_sleeping_, stop_);
    }
    active_.store(false, std::memory_order_seq_cst);
    for (uint32_t users = users_.load(std::memory_order_seq_cst); users != 0;) {
      users = wait_while_equal(users_, users, caller_sleeping_, stop_);
    }
    if (error_) {  // no thread is inside the job any more: error_ is ours alone
      std::exception_ptr error = std::move(error_);
      error_ = nullptr;
      std::rethrow_exception(error);
    }
  }

  static Pool& instance() {
    static Pool* pool = new Pool();  // leaked on purpose: no join racing static destructors
    return *pool;
  }

 private:
  // Claims and runs chunks until none is left.
  void work() {
    for (;;) {
      const uint32_t i = next_.fetch_add(1, std::memory_order_relaxed);
      if (i >= chunks_) {
        return;
      }
      const int64_t b = begin_ + static_cast<int64_t>(i) * chunk_;
      try {
        fn_(ctx_, b, std::min(b + chunk_, end_));
      } catch (...) {
        // A chunk that throws (a TORCH_CHECK on bad data) must not end the process from a
        // helper thread: the first error is rethrown by the caller once the job is over.
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) {
          error_ = std::current_exception();
        }
      }
      if (done_.fetch_add(1, std::memory_order_seq_cst) + 1 == chunks_ &&
          caller_sleeping_.load(std::memory_order_seq_cst) > 0) {
        futex_wake_all(done_);
      }
    }
  }

  void helper_loop() {
    uint32_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      seen = wait_while_equal(generation_, seen, helper_sleepers_, stop_);
      if (stop_.load(std::memory_order_acquire)) {
        return;
      }
      users_.fetch_add(1, std::memory_order_seq_cst);
      if (active_.load(std::memory_order_seq_cst)) {
        work();
      }
      if (users_.fetch_sub(1, std::memory_order_seq_cst) == 1 &&
          caller_sleeping_.load(std::memory_order_seq_cst) > 0) {
        futex_wake_all(users_);
      }
    }
  }

  // Only ever called by the one thread running a job, between jobs.
  void resize(int64_t helpers) {
    if (static_cast<int64_t>(helpers_.size()) == helpers) {
      return;
    }
    stop_.store(true, std::memory_order_seq_cst);
    generation_.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(generation_);
    for (std::thread& t : helpers_) {
      t.join();
    }
    helpers_.clear();
    stop_.store(false, std::memory_order_seq_cst);
    for (int64_t i = 0; i < helpers; ++i) {
      helpers_.emplace_back([this] { helper_loop(); });
    }
  }

  // The job: written by the caller only while no helper is inside it.
  ChunkFn fn_ = nullptr;
  const void* ctx_ = nullptr;
  int64_t begin_ = 0;
  int64_t end_ = 0;
  int64_t chunk_ = 1;
  uint32_t chunks_ = 0;

  std::atomic<uint32_t> next_{0};        // the next chunk to claim
  std::atomic<uint32_t> done_{0};        // chunks finished; the caller may sleep on it
  std::atomic<uint32_t> users_{0};       // helpers inside the job; the caller may sleep on it
  std::atomic<bool> active_{false};      // a job is published and not yet finished
  std::atomic<uint32_t> generation_{0};  // bumped per job; helpers sleep on it
  std::atomic<uint32_t> helper_sleepers_{0};
  std::atomic<uint32_t> caller_sleeping_{0};
  std::atomic<bool> stop_{false};
  std::vector<std::thread> helpers_;
  std::mutex error_mutex_;
  std::exception_ptr error_;  // the first exception a chunk threw in the current job
};

// One loop at a time uses the pool; a nested or concurrent loop runs serially instead.
std::atomic<bool> pool_busy{false};

}  // namespace

int64_t parallel_threads() { return std::max<int64_t>(1, at::get_num_threads()); }

void run_chunks(int64_t begin, int64_t end, int64_t grain, ChunkFn fn, const void* ctx) {
  if (end <= begin) {
    return;
  }
  const int64_t range = end - begin;
  const int64_t threads = parallel_threads();
  grain = std::max<int64_t>(grain, 1);
  const int64_t chunks = std::min((range + grain - 1) / grain, threads * kChunksPerThread);
  if (threads == 1 || chunks <= 1 || pool_busy.exchange(true, std::memory_order_acquire)) {
    fn(ctx, begin, end);
    return;
  }
  const int64_t chunk = (range + chunks - 1) / chunks;
  struct Release {  // the pool is free again however run() ends, a rethrown error included
    ~Release() { pool_busy.store(false, std::memory_order_release); }
  } release;
  Pool::instance().run(begin, end, chunk, (range + chunk - 1) / chunk, threads, fn, ctx);
}

}  // namespace corefleet
