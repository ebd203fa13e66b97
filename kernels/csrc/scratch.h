// Per-thread scratch memory of the kernel entry points, kept from one call to the next.
//
// A prefill-sized call (128 tokens x top-8 of the bench shape) needs megabytes of padded activations,
// intermediate rows and per-row outputs; as std::vectors they were allocated, page-faulted and zeroed by
// the kernel on every call (~10% of an M = 128 MoE call under perf). A Scratch hands out 64-byte aligned
// slices of blocks it keeps; reset() at the start of a call makes all of it free again and merges the
// blocks one call grew into a single block, so the next call of that size touches no new page.
// Slices are NOT zeroed: callers write every element they read (or zero the padding they need).
// One Scratch per thread (local()); a call's slices are valid until the same thread's next reset(), so
// only leaf entry points (run, run_linear) take them, never code that calls another entry point.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace moegate {

class Scratch {
 public:
  static Scratch& local() {
    thread_local Scratch s;
    return s;
  }

  void reset() {
    if (blocks_.size() > 1) {  // last call outgrew the first block: one block of the total next time
      size_t total = 0;
      for (const Block& b : blocks_) total += b.size;
      release();
      grow(total);
    }
    for (Block& b : blocks_) b.used = 0;
  }

  // n elements of T (n >= 0), 64-byte aligned, uninitialised.
  template <class T>
  T* take(int64_t n) {
    const size_t bytes = (sizeof(T) * static_cast<size_t>(n > 0 ? n : 1) + 63) & ~static_cast<size_t>(63);
    if (blocks_.empty() || blocks_.back().used + bytes > blocks_.back().size) grow(bytes);
    Block& b = blocks_.back();
    T* p = reinterpret_cast<T*>(b.data + b.used);
    b.used += bytes;
    return p;
  }

  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { release(); }

 private:
  struct Block {
    char* data;
    size_t size, used;
  };

  void grow(size_t bytes) {
    const size_t size = std::max<size_t>(bytes, size_t(1) << 20);
    blocks_.push_back(Block{static_cast<char*>(::operator new(size, std::align_val_t(64))), size, 0});
  }

  void release() {
    for (Block& b : blocks_) ::operator delete(b.data, std::align_val_t(64));
    blocks_.clear();
  }

  std::vector<Block> blocks_;
};

}  // namespace moegate
