// A work-claiming thread pool for the MoE kernel.
//
// parallel_for(total, chunk, threads, fn) runs fn(i) for i in [0, total): the calling thread and up
// to threads - 1 helpers claim chunks from one atomic counter. The caller waits only for chunks a
// helper has actually claimed, never for a helper to wake up, so on a machine shared with other
// processes (a helper descheduled for milliseconds) a call is never slower than running alone.
// Helpers spin ~200 us for the next job (back-to-back layers; spin_us(): MOEGATE_SPIN_US at start, the
// MOEGATE_SPIN_US environment variable or moegate_pool_spin), then sleep on a condition variable; rest() sends
// them to sleep now (the caller has no job coming soon: a decode step's last kernel call).
// After fork() the child gets a fresh pool (the parent's helper threads do not exist there).
//
// A job streaming fewer than kSmallWorkBytes runs on the caller alone (threads_for: waking a helper, and waiting
// for it when it is descheduled holding a claimed chunk, cost more than the work). That changes no bits: every
// kernel's arithmetic per output element is the same for any number of threads.
#pragma once

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
inline void moegate_pause() { _mm_pause(); }
#else
inline void moegate_pause() {}
#endif

#ifndef MOEGATE_SPIN_US
#define MOEGATE_SPIN_US 200
#endif

namespace moegate {

// Weight (or cache) bytes below which one job runs on the calling thread alone.
constexpr int64_t kSmallWorkBytes = int64_t(1) << 20;

// Off (moegate_pool_sizing(0)): every job gets the threads it asks for (tests comparing thread counts).
inline std::atomic<bool>& pool_sizing() {
  static std::atomic<bool> on{true};
  return on;
}

// Microseconds a helper spins for the next job before it sleeps (moegate_pool_spin sets it).
inline std::atomic<int64_t>& spin_us() {
  static std::atomic<int64_t> us{[] {
    const char* env = std::getenv("MOEGATE_SPIN_US");
    return env != nullptr && *env != '\0' ? std::max<int64_t>(0, std::atoll(env)) : int64_t(MOEGATE_SPIN_US);
  }()};
  return us;
}

inline int threads_for(int64_t work_bytes, int threads) {
  return work_bytes < kSmallWorkBytes && pool_sizing().load(std::memory_order_relaxed) ? 1 : threads;
}

// Spin with pause, then yield the CPU: for short waits on work another thread is finishing.
template <class Ready>
inline void spin_until(Ready ready) {
  for (int i = 0; !ready(); ++i) {
    if (i < 256) moegate_pause();
    else sched_yield();
  }
}

class WorkPool {
 public:
  static WorkPool& instance() {
    static std::mutex m;
    static WorkPool* pool = nullptr;
    static pid_t owner = 0;
    std::lock_guard<std::mutex> g(m);
    if (pool == nullptr || owner != getpid()) {  // leaked on purpose: helpers outlive static destructors
      pool = new WorkPool();
      owner = getpid();
    }
    return *pool;
  }

  void parallel_for(int64_t total, int64_t chunk, int threads, const std::function<void(int64_t)>& fn) {
    if (total <= 0) return;
    chunk = std::max<int64_t>(chunk, 1);
    if (threads <= 1 || total <= chunk) {
      for (int64_t i = 0; i < total; ++i) fn(i);
      return;
    }
    std::lock_guard<std::mutex> one_job_at_a_time(run_mu_);
    ensure_helpers(threads - 1);
    auto job = std::make_shared<Job>(fn, total, chunk, threads - 1);
    resting_.store(false, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> g(mu_);
      current_ = job;
      gen_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    job->work();
    spin_until([&] { return job->done.load(std::memory_order_acquire) >= total; });
    std::lock_guard<std::mutex> g(mu_);
    current_.reset();
  }

  // Helpers waiting for a job stop spinning and sleep until the next one (a spinning helper would take a core
  // from the caller's own work between calls and from other processes). The next parallel_for wakes them.
  void rest() { resting_.store(true, std::memory_order_relaxed); }

 private:
  struct Job {
    Job(const std::function<void(int64_t)>& f, int64_t t, int64_t c, int h) : fn(f), total(t), chunk(c), max_helpers(h) {}
    std::function<void(int64_t)> fn;  // only called for claimed indices, i.e. while the caller waits
    int64_t total, chunk;
    int max_helpers;
    alignas(64) std::atomic<int64_t> next{0};  // claimed by every thread: its own cache line
    alignas(64) std::atomic<int64_t> done{0};
    alignas(64) std::atomic<int> joined{0};
    void work() {
      for (;;) {
        const int64_t b = next.fetch_add(chunk, std::memory_order_relaxed);
        if (b >= total) return;
        const int64_t e = std::min(total, b + chunk);
        for (int64_t i = b; i < e; ++i) fn(i);
        done.fetch_add(e - b, std::memory_order_release);
      }
    }
  };

  void ensure_helpers(int n) {
    while ((int)helpers_ < n) {
      std::thread([this] { helper_loop(); }).detach();
      ++helpers_;
    }
  }

  void helper_loop() {
    uint64_t seen = gen_.load(std::memory_order_acquire);
    for (;;) {
      // Spin up to kSpin for the next job before sleeping: back-to-back calls (a decode step's layers) find
      // the helper awake; waking a sleeping thread costs tens of microseconds, more on a virtual machine
      // whose idle vCPU has halted. Longer spins take a core from torch's own threads between kernel calls
      // (reference model, 2 threads: 50-300 us best; 2 ms cost prefill 20% and decode 12%).
      const auto until = std::chrono::steady_clock::now() +
                         std::chrono::microseconds(spin_us().load(std::memory_order_relaxed));
      for (int i = 0; gen_.load(std::memory_order_acquire) == seen; ++i) {
        moegate_pause();
        if ((i & 63) == 63 && (resting_.load(std::memory_order_relaxed) || std::chrono::steady_clock::now() > until))
          break;
      }
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return gen_.load(std::memory_order_acquire) != seen; });
        seen = gen_.load(std::memory_order_acquire);
        job = current_;
      }
      if (job && job->joined.fetch_add(1) < job->max_helpers) job->work();
    }
  }

  std::mutex run_mu_, mu_;
  std::condition_variable cv_;
  std::shared_ptr<Job> current_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<bool> resting_{false};
  size_t helpers_ = 0;
};

}  // namespace moegate
