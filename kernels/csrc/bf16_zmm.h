// bf16 weights x bf16 activations (format bf16_a16) on AVX-512 BF16 vdpbf16ps, in the avx512 variant
// when the CPU has AVX-512 BF16 (checked at run time; the functions carry their own target attribute, so
// nothing else in the build uses BF16 instructions). Included by moe_cpu.cpp after w4a8_zmm.h.
//
// Units as in w4a8_zmm.h: 16 output lanes (a gate_up tile, or two R8 = 1 tiles, or the last single one).
// Per pair of k one 64-byte block (two 32-byte blocks for a pair of tiles) is permuted with vpermw into
// one (w[k], w[k+1]) dword per row, and up to 8 activation rows each add w[k] x[k] + w[k+1] x[k+1]
// with one vdpbf16ps (products exact in fp32). Each row accumulates k pairs alternately into two fixed
// chains, added at the end: the same order whatever MT, so a row's result is batch-invariant. The
// hardware's rounding inside vdpbf16ps is not the fp32 FMA's, so these bits differ from the avx2 /
// generic path (bf16 weights times the same bf16-rounded activations with fp32 FMA); both are within
// the tolerance of the torch reference.
#pragma once

#ifdef MOEGATE_ZMM

namespace {

// Word order of a unit's two k (kContig: [k r0..15][k+1 r0..15]; kPair / kSingle:
// [t: k r0..7, k+1 r0..7][t+1: k r0..7, k+1 r0..7]) -> one (k, k+1) pair per output lane.
template <int MODE>
inline __m512i bf16_pair_index() {
  alignas(64) int16_t idx[32];
  for (int i = 0; i < 16; ++i) {
    const int base = MODE == kContig ? i : (i < 8 ? i : 16 + (i - 8));
    const int step = MODE == kContig ? 16 : 8;
    idx[2 * i] = (int16_t)base;
    idx[2 * i + 1] = (int16_t)(base + step);
  }
  return _mm512_load_si512(idx);
}

#define MOEGATE_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

// Weights of k and k + 1 (both) or of k alone (the odd tail: zeros for k + 1) for one unit. w0 / w1:
// bf16 weights of lanes 0-7 (kContig: all 16) / 8-15, `stride` elements per k.
template <int MODE>
MOEGATE_BF16_TARGET __attribute__((always_inline)) inline __m512i bf16_load(const uint16_t* w0, const uint16_t* w1, int64_t stride, int64_t k,
                                             bool both) {
  if constexpr (MODE == kContig) {
    if (both) return _mm512_loadu_si512(w0 + k * stride);
    return _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + k * stride)));
  } else {
    const __m256i lo = both ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + k * stride))
                            : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w0 + k * stride)));
    if constexpr (MODE == kSingle) return _mm512_zextsi256_si512(lo);
    const __m256i hi = both ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1 + k * stride))
                            : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w1 + k * stride)));
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
}

// acc[m] += w[k] x[k] + w[k+1] x[k+1] per lane for MT activation rows (one vdpbf16ps each).
template <int MODE, int MT>
MOEGATE_BF16_TARGET __attribute__((always_inline)) inline void bf16_step(__m512i perm, const uint16_t* w0, const uint16_t* w1, int64_t stride,
                                          int64_t k, bool both, const uint16_t* const* xb, __m512* acc) {
  if constexpr (MODE == kPair) pair_prefetch(w0, w1, 2 * k * stride, (int64_t)(w1 - w0) * 2);
  else __builtin_prefetch(w0 + k * stride + kPrefetch / 2, 0, 3);
  const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(perm, bf16_load<MODE>(w0, w1, stride, k, both));
  #pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) {
    int32_t a;
    std::memcpy(&a, xb[m] + k, 4);
    acc[m] = _mm512_dpbf16_ps(acc[m], w, (__m512bh)_mm512_set1_epi32(a));
  }
}

// out[m][0 .. 16) (kSingle: 8) = unit rows . xb[m], xb[m] a row of bf16 activations (kp rounded up to
// even, the last one zero when kp is odd).
template <int MODE, int MT>
MOEGATE_BF16_TARGET void zmm_bf16(const uint16_t* w0, const uint16_t* w1, int64_t stride, int64_t kp,
                                  const uint16_t* const* xb, float* const* out) {
  const __m512i perm = bf16_pair_index<MODE>();
  __m512 acc[2][MT];
  #pragma GCC unroll 16
  for (int c = 0; c < 2; ++c)
    #pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) acc[c][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 4 <= kp; k += 4) {
    bf16_step<MODE, MT>(perm, w0, w1, stride, k, true, xb, acc[0]);
    bf16_step<MODE, MT>(perm, w0, w1, stride, k + 2, true, xb, acc[1]);
  }
  if (k + 2 <= kp) {
    bf16_step<MODE, MT>(perm, w0, w1, stride, k, true, xb, acc[0]);
    k += 2;
  }
  if (k < kp) bf16_step<MODE, MT>(perm, w0, w1, stride, k, false, xb, acc[1]);
  #pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) {
    const __m512 r = _mm512_add_ps(acc[0][m], acc[1][m]);
    if constexpr (MODE == kSingle) _mm256_storeu_ps(out[m], _mm512_castps512_ps256(r));
    else _mm512_storeu_ps(out[m], r);
  }
}

template <int MODE>
void zmm_bf16_rows(const uint16_t* w0, const uint16_t* w1, int64_t stride, int64_t kp, const uint16_t* const* xb,
                   float* const* out, int n) {
  for_row_chunks(n, [&](auto mt, int i) { zmm_bf16<MODE, decltype(mt)::value>(w0, w1, stride, kp, xb + i, out + i); });
}

// Unit `u` of a tiled bf16 projection (as zmm_unit_rows): R8 = 2 the gate_up tile first + u, R8 = 1 the
// tiles first + 2u and first + 2u + 1 (if 2u + 1 < n8).
template <int R8>
void zmm_bf16_unit_rows(const Mat& M, int64_t first, int64_t u, int64_t n8, const uint16_t* const* xb,
                        float* const* out, int n) {
  const uint16_t* w = static_cast<const uint16_t*>(M.w);
  if constexpr (R8 == 2) {
    zmm_bf16_rows<kContig>(w + (first + u) * M.kp * 16, nullptr, 16, M.kp, xb, out, n);
  } else {
    const int64_t t = first + 2 * u;
    const uint16_t* w0 = w + t * M.kp * 8;
    const bool pair = 2 * u + 1 < n8;
    if (pair && n > kSequentialRows) {
      zmm_bf16_rows<kPair>(w0, w0 + M.kp * 8, 8, M.kp, xb, out, n);
    } else {  // one tile after the other (as zmm_unit_rows): one sequential stream for few rows
      zmm_bf16_rows<kSingle>(w0, nullptr, 8, M.kp, xb, out, n);
      if (pair) {
        float* out1[kSequentialRows];
        for (int i = 0; i < n; ++i) out1[i] = out[i] + 8;
        zmm_bf16_rows<kSingle>(w0 + M.kp * 8, nullptr, 8, M.kp, xb, out1, n);
      }
    }
  }
}

inline bool cpu_has_bf16_dot() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has && moegate::path_allowed(moegate::kBf16Dot);
}

}  // namespace

#endif  // MOEGATE_ZMM
