// The C++ CPU ops' own parallel loop: dynamic chunks on a small pool, built to keep going on a
// shared node.
//
// Why not at::parallel_for: with OpenMP it gives each thread one fixed share of the range and
// ends every region with a barrier, so a region lasts as long as its slowest thread. On a node
// where a neighbour's process shares the cores, the scheduler deschedules one of our threads for
// a whole time slice (milliseconds) now and then, and a decode step has hundreds of regions: the
// engine measured 0.1 of its quiet throughput next to two busy loops. OpenMP's idle threads also
// spin for a long time between regions, which spends the engine's own CPU share.
//
// Here the range is cut into more chunks than threads, and threads claim chunks one at a time
// from a shared counter. The calling thread works too, and it waits only for chunks another
// thread has actually claimed: a helper that has not woken up yet is simply not waited for, the
// others take its chunks. Idle helpers spin for a short while (the next region of a step usually
// follows within microseconds), then sleep on a futex.
//
// A chunk that throws does not stop the others; the first exception is rethrown on the calling
// thread once every chunk is done (as at::parallel_for does). Check arguments before the loop
// where possible: the other chunks' work is wasted otherwise.
#pragma once

#include <cstdint>

namespace corefleet {

using ChunkFn = void (*)(const void* ctx, int64_t begin, int64_t end);

// Runs `fn(ctx, b, e)` over disjoint chunks covering [begin, end), each at least `grain` long
// (except the last), on at most at::get_num_threads() threads. Returns when every chunk is done.
// Called from inside a chunk (or from two threads at once), the loop runs serially on the
// calling thread.
void run_chunks(int64_t begin, int64_t end, int64_t grain, ChunkFn fn, const void* ctx);

// The same for any callable `f(int64_t begin, int64_t end)`.
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  run_chunks(
      begin, end, grain,
      [](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); }, &f);
}

// The number of threads the loop uses (the caller included): at::get_num_threads().
int64_t parallel_threads();

}  // namespace corefleet
