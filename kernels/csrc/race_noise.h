// The race noise of temperature sampling (engine/sampler.py): g_i = -log(-log u_i), u_i uniform in (0, 1), for
// ids i = 0..n-1 of one draw, from a counter-based hash of (key, counter, i): a sequence's k-th draw is a function
// of its key and k alone, so it does not depend on batch companions, nor on which thread or SIMD build runs it.
// Every float step is one IEEE operation (-ffp-contract=off) and the log is Cephes' logf on normal positive
// inputs, so the plain loop the compiler vectorizes and the numpy reference (kernels/race_noise.py) give the same
// bits. Included by moe_cpu.cpp.
#pragma once

namespace {

inline uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// log(x) for normal x > 0 (Cephes logf): x = m 2^e with m in [sqrt(1/2), sqrt(2)), a degree-8 polynomial in m - 1.
inline float race_log(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  int e = static_cast<int>((bits >> 23) & 0xFFu) - 126;
  bits = (bits & 0x807FFFFFu) | 0x3F000000u;  // m in [0.5, 1)
  float m;
  std::memcpy(&m, &bits, 4);
  // below sqrt(1/2): m -> 2m - 1 and e -> e - 1, else m -> m - 1; in arithmetic (m * 0 or m * 1 is exact), not a
  // branch, so the loop vectorizes (a branch on random m mispredicted half the time: ~8 ms for 152k ids)
  const int low = m < 0.707106781186547524f;
  e -= low;
  m = (m + m * static_cast<float>(low)) - 1.f;
  const float z = m * m;
  float y = 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = (y * m) * z;
  const float fe = static_cast<float>(e);
  y = y + fe * -2.12194440e-4f;
  y = y - z * 0.5f;
  return (m + y) + fe * 0.693359375f;
}

// The largest noise a draw can give: g of the largest u, (2^24 - 1) / 2^24 (g rises with u over all 2^23 of them:
// tests/kernels/test_kernels_race_noise.py checks every one), 16.635532f.
constexpr uint32_t kRaceNoiseMaxBits = 0x41851592u;

// g for id `id` of the draw whose hashed key is (k0, k1).
inline float race_gumbel(uint32_t id, uint32_t k0, uint32_t k1) {
  const uint32_t h = fmix32(fmix32(id * 0x9E3779B9u ^ k0) ^ k1);
  const float u = static_cast<float>(((h >> 9) << 1) | 1u) * 5.9604644775390625e-8f;  // odd / 2^24: (0, 1)
  return -race_log(-race_log(u));
}

inline void race_key(uint64_t key, uint64_t counter, uint32_t* k0, uint32_t* k1) {
  const uint64_t k = splitmix64(key ^ splitmix64(counter));
  *k0 = static_cast<uint32_t>(k);
  *k1 = static_cast<uint32_t>(k >> 32);
}

// A race's ids in blocks: a block is drawn only where its largest logit could still win (64 ids: the draw's loop
// runs at full speed; 16 cost 1.7x per id on a row where every block is drawn).
constexpr int64_t kRaceBlock = 64;
constexpr int64_t kRaceChunk = 4096;  // ids a pool thread claims at a time

struct RacePick {
  float score;
  int64_t id;  // -1: none drawn in the chunk
};

// float -> uint32 in the floats' order (-inf lowest, +inf highest; -0 just below +0), and back
inline uint32_t float_order(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

inline float order_float(uint32_t k) {
  const uint32_t u = (k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// The largest g of each of the 4096 buckets of u by its top 12 bits (the hash's top 12 bits: u rises with h >> 9):
// g of the bucket's largest u, as g rises with u (tests/kernels/test_kernels_race_noise.py checks every u). An id
// whose hash lies in bucket k draws at most bucket_max[k]; the last is kRaceNoiseMaxBits' G.
constexpr int kRaceBuckets = 4096;

// The lanes of GCC's float vectors in block_max and race_top: the build's register width (wider vectors would be
// split into scalar code on avx2 and generic).
#if defined(__AVX512F__)
constexpr int64_t kRaceLanes = 16;
#elif defined(__AVX2__)
constexpr int64_t kRaceLanes = 8;
#else
constexpr int64_t kRaceLanes = 4;
#endif

inline const float* race_bucket_max() {
  static const std::vector<float> table = [] {
    std::vector<float> g(kRaceBuckets);
    for (uint32_t k = 0; k < kRaceBuckets; ++k) {
      const uint32_t m = (k << 11) | 0x7FFu;  // the bucket's largest h >> 9
      const float u = static_cast<float>((m << 1) | 1u) * 5.9604644775390625e-8f;
      g[k] = -race_log(-race_log(u));
    }
    return g;
  }();
  return table.data();
}

// The largest of logits[0, n) (n <= kRaceBlock), NaN-free: GCC's vectors of the build's register width.
inline float block_max(const float* logits, int64_t n) {
  constexpr int64_t L = kRaceLanes;
  typedef float Lanes __attribute__((vector_size(L * 4)));
  float top = logits[0];
  int64_t j = 0;
  if (n >= L) {
    Lanes m;
    std::memcpy(&m, logits, sizeof(m));
    for (j = L; j + L <= n; j += L) {
      Lanes x;
      std::memcpy(&x, logits + j, sizeof(x));
      m = x > m ? x : m;
    }
    for (int64_t k = 0; k < L; ++k) top = m[k] > top ? m[k] : top;
  }
  for (; j < n; ++j) top = logits[j] > top ? logits[j] : top;
  return top;
}

// The best (largest score, lowest id on ties) of ids [b, e) scoring at least `floor`, a score some id has. Per block
// of ids, from its largest logit x: the least bucket k whose bound fl(fl(x / t) + bucket_max[k]) reaches the best
// score so far (none: the block is skipped); only ids whose hash lies in bucket k or above are drawn (fl(a / t) and
// fl(a + g) rise with a and g, so no other id of the block can reach it). A hash is a few integer operations, the
// draw two logs: on a flat row the ids drawn are the few in the top buckets. No NaN logit (moegate_race_sample).
inline RacePick race_chunk(const float* logits, int64_t b, int64_t e, float t, uint32_t k0, uint32_t k1,
                           float floor) {
  const float* bucket_max = race_bucket_max();
  RacePick best{floor, -1};
  for (int64_t i = b; i < e; i += kRaceBlock) {
    const int64_t n = std::min(kRaceBlock, e - i);
    const float a = block_max(logits + i, n) / t;
    if (!(a + bucket_max[kRaceBuckets - 1] >= best.score)) continue;
    int lo = 0, hi = kRaceBuckets - 1;  // the least bucket whose bound reaches best.score
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (a + bucket_max[mid] >= best.score) hi = mid;
      else lo = mid + 1;
    }
    const uint32_t from = static_cast<uint32_t>(lo), id = static_cast<uint32_t>(i);
    uint32_t hash[kRaceBlock];
    int drawn = 0;
    for (int64_t j = 0; j < n; ++j) {
      hash[j] = fmix32(fmix32((id + static_cast<uint32_t>(j)) * 0x9E3779B9u ^ k0) ^ k1);
      drawn += (hash[j] >> 20) >= from;
    }
    if (drawn == 0) continue;
    float score[kRaceBlock];
    if (n == kRaceBlock && drawn >= 16) {  // many: the whole block through the vectorized draw
      for (int64_t j = 0; j < kRaceBlock; ++j) score[j] = logits[i + j] / t + race_gumbel(id + j, k0, k1);
    } else {
      for (int64_t j = 0; j < n; ++j) {
        score[j] = (hash[j] >> 20) >= from ? logits[i + j] / t + race_gumbel(id + j, k0, k1)
                                           : -std::numeric_limits<float>::infinity();
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      if (score[j] > best.score || (best.id < 0 && score[j] == best.score)) best = RacePick{score[j], i + j};
    }
  }
  return best;
}

// Whether any of logits[i, i + n) is >= x (element-wise, so the compiler vectorizes it).
inline bool any_at_least(const float* logits, int64_t n, float x) {
  int hit = 0;
  for (int64_t j = 0; j < n; ++j) hit |= logits[j] >= x;
  return hit != 0;
}

// Some id of the largest logit of logits[0, n) (n > 0), and whether any logit is NaN (then the id is meaningless).
inline int64_t race_top(const float* logits, int64_t n, bool* nan) {
  // a select and a compare per register of logits
  constexpr int64_t L = kRaceLanes;
  typedef float Lanes __attribute__((vector_size(L * 4)));
  typedef int32_t Flags __attribute__((vector_size(L * 4)));
  float lane[L];
  for (int64_t j = 0; j < L; ++j) lane[j] = -std::numeric_limits<float>::infinity();
  Lanes lanes;
  Flags nans = {};
  std::memcpy(&lanes, lane, sizeof(lanes));
  const int64_t whole = n / L * L;
  for (int64_t i = 0; i < whole; i += L) {
    Lanes x;
    std::memcpy(&x, logits + i, sizeof(x));
    lanes = x > lanes ? x : lanes;
    nans |= x != x;
  }
  std::memcpy(lane, &lanes, sizeof(lanes));
  for (int64_t i = whole; i < n; ++i) lane[i - whole] = logits[i] > lane[i - whole] ? logits[i] : lane[i - whole];
  float top = lane[0];
  for (int64_t j = 0; j < L; ++j) top = lane[j] > top ? lane[j] : top;
  int any_nan = 0;
  for (int64_t j = 0; j < L; ++j) any_nan |= nans[j];
  for (int64_t i = whole; i < n; ++i) any_nan |= logits[i] != logits[i];
  *nan = any_nan != 0;
  for (int64_t i = 0; i < n; i += kRaceBlock) {
    const int64_t m = std::min(kRaceBlock, n - i);
    if (!any_at_least(logits + i, m, top)) continue;
    for (int64_t j = 0; j < m; ++j) {
      if (logits[i + j] >= top) return i + j;
    }
  }
  return 0;  // every logit NaN
}

// The race inside the lm_head's call (moegate_linear_race): each row's logits scored span by span while the span's
// columns are still in the cache of the thread that wrote them, pruned by the row's best score so far over every
// span (`floor`, in the floats' order), and the spans' picks merged in column order (`race_merge`): the id and score
// of moegate_race_sample over the same logits, whatever the spans, threads or their order.
struct HeadRace {
  const float* temps;        // [M]: > 0 races the row at that temperature; else its first largest logit is taken
  const uint32_t* k0;        // [M] each row's hashed key (race_key)
  const uint32_t* k1;
  std::atomic<uint32_t>* floor;  // [M] the best score any span of the row has found (float_order), -inf at first
  float* best;               // [M] out: the pick's score (race) or logit (first largest); -inf where none
};

// The best of ids [b, e) of one row, as race_chunk, from the larger of the row's shared best and the span's own
// largest logit's score (the span then has a pick); a NaN logit: the span's first NaN (score NaN), nothing drawn.
inline RacePick race_span(const float* logits, int64_t b, int64_t e, float t, uint32_t k0, uint32_t k1,
                          std::atomic<uint32_t>& floor) {
  if (e <= b) return RacePick{0.f, -1};
  bool nan;
  const int64_t top = b + race_top(logits + b, e - b, &nan);
  if (nan) {
    int64_t i = b;
    while (logits[i] == logits[i]) ++i;
    return RacePick{logits[i], i};
  }
  const float own = logits[top] / t + race_gumbel(static_cast<uint32_t>(top), k0, k1);
  const float shared = order_float(floor.load(std::memory_order_relaxed));
  const RacePick pick = race_chunk(logits, b, e, t, k0, k1, own > shared ? own : shared);
  if (pick.id >= 0) {
    const uint32_t got = float_order(pick.score);
    uint32_t was = floor.load(std::memory_order_relaxed);
    while (got > was && !floor.compare_exchange_weak(was, got, std::memory_order_relaxed)) {}
  }
  return pick;
}

// The row's pick from its spans' picks in column order: the first NaN span's NaN, else the largest score, the
// lowest id on ties (an earlier span's); id -1 where no span has one.
inline RacePick race_merge(RacePick win, const RacePick& p) {
  if (p.id < 0 || (win.id >= 0 && win.score != win.score)) return win;
  if (p.score != p.score || win.id < 0 || p.score > win.score) return p;
  return win;
}

}  // namespace

extern "C" int moegate_race_noise(float* out, int64_t n, uint64_t key, uint64_t counter) {
  uint32_t k0, k1;
  race_key(key, counter, &k0, &k1);
  uint32_t id = 0;  // i mod 2^32, counted beside i: the 64-bit index's truncation kept the loop scalar on avx2
  for (int64_t i = 0; i < n; ++i, ++id) out[i] = race_gumbel(id, k0, k1);
  return 0;
}

// One temperature row's race in one call: the first id of the largest score fl(fl(logits[i] / t) + g_i) over
// i < n, g the draw `counter` of the stream `key` (moegate_race_noise's values), as numpy's argmax of
// `logits / t + noise`. Ids whose score cannot reach the best found so far are not drawn (race_chunk): the same id
// bit for bit. Threads claim chunks of ids over the pool. Returns the id and writes its score to *best; a NaN
// logit: the first NaN's id, *best NaN (the caller's finite check fails the row, as numpy's argmax picks it).
extern "C" int64_t moegate_race_sample(const float* logits, int64_t n, float t, uint64_t key, uint64_t counter,
                                       float* best, int nthreads) {
  if (n <= 0) {
    *best = -std::numeric_limits<float>::infinity();
    return -1;
  }
  bool nan;
  const int64_t top = race_top(logits, n, &nan);  // its score is the first floor
  if (nan) {
    int64_t i = 0;
    while (logits[i] == logits[i]) ++i;
    *best = logits[i];
    return i;
  }
  uint32_t k0, k1;
  race_key(key, counter, &k0, &k1);
  const float floor = logits[top] / t + race_gumbel(static_cast<uint32_t>(top), k0, k1);
  const int64_t chunks = (n + kRaceChunk - 1) / kRaceChunk;
  std::vector<RacePick> picks(chunks);
  // the best score any chunk has found, in the floats' order: a chunk starts from it (a score some id has)
  std::atomic<uint32_t> shared{float_order(floor)};
  moegate::WorkPool::instance().parallel_for(chunks, 1, std::max(nthreads, 1), [&](int64_t c) {
    const float from = order_float(shared.load(std::memory_order_relaxed));
    picks[c] = race_chunk(logits, c * kRaceChunk, std::min(n, (c + 1) * kRaceChunk), t, k0, k1, from);
    if (picks[c].id >= 0) {
      const uint32_t got = float_order(picks[c].score);
      uint32_t was = shared.load(std::memory_order_relaxed);
      while (got > was && !shared.compare_exchange_weak(was, got, std::memory_order_relaxed)) {}
    }
  });
  RacePick win{floor, top};  // the chunk holding `top` finds it again (or a better id): ties go to the lowest id
  for (const RacePick& p : picks) {
    if (p.id >= 0 && (p.score > win.score || (p.score == win.score && p.id < win.id))) win = p;
  }
  *best = win.score;
  return win.id;
}
