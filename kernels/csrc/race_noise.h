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

}  // namespace

extern "C" int moegate_race_noise(float* out, int64_t n, uint64_t key, uint64_t counter) {
  const uint64_t k = splitmix64(key ^ splitmix64(counter));
  const uint32_t k0 = static_cast<uint32_t>(k), k1 = static_cast<uint32_t>(k >> 32);
  uint32_t id = 0;  // i mod 2^32, counted beside i: the 64-bit index's truncation kept the loop scalar on avx2
  for (int64_t i = 0; i < n; ++i, ++id) {
    const uint32_t h = fmix32(fmix32(id * 0x9E3779B9u ^ k0) ^ k1);
    const float u = static_cast<float>(((h >> 9) << 1) | 1u) * 5.9604644775390625e-8f;  // odd / 2^24: (0, 1)
    out[i] = -race_log(-race_log(u));
  }
  return 0;
}
