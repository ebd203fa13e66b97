// fp32-activation projections (fp32, bf16, int8 weights; bf16_a16 without vdpbf16ps) on 512-bit zmm
// fp32 FMA in the avx512 variant: 16 output lanes per unit (as w4a8_zmm.h: a gate_up tile, two R8 = 1
// tiles, or the last single one) and up to 15 activation rows per weight vector (a pass), so at prefill sizes
// each weight is loaded and converted to fp32 once per pass instead of once per 1-2 rows (tile_dot).
// Included by moe_cpu.cpp after w4a8_zmm.h.
//
// The arithmetic per output row is tile_dot's, bit for bit (each lane is one row of a tile; fma is
// single-rounding in both): fp32 / bf16 / bf16_a16 accumulate even k and odd k in two chains (an odd
// tail k into the even one) and add them at the end; int8 sums each group's even and odd k in two
// chains from zero and adds fma(scale, even + odd, acc) in group order. Nothing depends on MT or on
// which rows share the call, so a row's result is batch-invariant and equals the avx2 build's.
//
// More than kSequentialRows rows read their activations interleaved (FpActs, as ZmmActs for W4A8): a pass
// of MT rows stores each k's MT floats side by side, so every broadcast fma addresses one pointer plus a
// constant and the loop bumps two pointers. Per-row pointers with an index register cost each fma a
// second front-end uop (an indexed memory operand is unlaminated) and the loop reloaded spilled pointers
// from the stack: the loop was issue-bound, not fma-bound (perf, bf16 M = 128).
#pragma once

namespace {

constexpr int kFpPassRows = 15;      // the most rows of one pass: 2 x 15 fma chains + a weight in 32 zmm registers
constexpr int64_t kFpSegment = 64;  // no pass straddles a multiple of 64 rows (the callers' row blocks are multiples)

// The pass holding row j of an L-row segment (L <= kFpSegment): ceil(L / 15) passes of as even a size as possible,
// the larger ones first (17 rows: 9 + 8; 24: 12 + 12; 64: 13 + 13 + 13 + 13 + 12). Its first row and row count.
inline void fp_pass_of(int64_t j, int64_t L, int64_t& start, int64_t& rows) {
  const int64_t np = (L + kFpPassRows - 1) / kFpPassRows, base = L / np, in_big = L % np * (base + 1);
  if (j < in_big) {
    rows = base + 1;
    start = j / rows * rows;
  } else {
    rows = base;
    start = in_big + (j - in_big) / base * base;
  }
}

// fp32 activations of a set of N rows, interleaved per pass: segments of kFpSegment rows from row 0 (the last one
// N mod 64), each cut into passes by fp_pass_of; a pass of n rows from row s holds x [kp][n] at x + s * kp.
// rows(i) (i a multiple of kFpSegment, or a pass's first row) is the set from row i on.
struct FpActs {
  float* x;
  int64_t kp;

  FpActs rows(int64_t i) const { return FpActs{x + i * kp, kp}; }

  // Row i of the N-row set from a row of kp floats.
  void put(int64_t i, int64_t N, const float* row) const {
    const int64_t s0 = i / kFpSegment * kFpSegment;
    int64_t start, n;
    fp_pass_of(i - s0, std::min<int64_t>(kFpSegment, N - s0), start, n);
    float* c = x + (s0 + start) * kp + (i - s0 - start);
    for (int64_t k = 0; k < kp; ++k) c[k * n] = row[k];
  }
};

}  // namespace

#ifdef MOEGATE_ZMM

namespace {

// One 16-lane unit of a tiled fp32-activation projection: weights of k at w0 + k * stride (lanes 0-7,
// kContig all 16) and w1 + k * stride (lanes 8-15, kPair), in elements of the weight type.
template <class T>
struct FpOperand {
  const T* w0;
  const T* w1;
  const uint16_t* s0;  // int8: fp16 scales of lanes 0-7 (kContig: 0-15), sstride apart per group
  const uint16_t* s1;
  int64_t stride, sstride, kp, gs;
};

// The unit's 16 weights of k as fp32 (kSingle: the upper 8 lanes zero).
template <int FMT, int MODE, class T>
inline __m512 fp_weights(const FpOperand<T>& A, int64_t k) {
  const T* p0 = A.w0 + k * A.stride;
  const T* p1 = A.w1 + k * A.stride;
  if constexpr (FMT == FP32) {
    if constexpr (MODE == kContig) return _mm512_loadu_ps(p0);
    const __m256 lo = _mm256_loadu_ps(p0);
    if constexpr (MODE == kSingle) return _mm512_zextps256_ps512(lo);
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)),
                                                _mm256_castps_pd(_mm256_loadu_ps(p1)), 1));
  } else if constexpr (FMT == INT8) {
    __m128i b;
    if constexpr (MODE == kContig) b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p0));
    else if constexpr (MODE == kSingle) b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p0));
    else b = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p0)),
                                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p1)));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  } else {  // bf16 bits: the upper half of an fp32
    __m256i h;
    if constexpr (MODE == kContig) h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0));
    else if constexpr (MODE == kSingle) h = _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0)));
    else h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0))),
                                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1)), 1);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// Prefetch kPrefetch bytes ahead of the weights of k in each stream, once per 64-byte line.
template <int MODE, class T>
inline void fp_prefetch(const FpOperand<T>& A, int64_t k) {
  const int64_t bytes = A.stride * (int64_t)sizeof(T), off = k * bytes;
  if ((off & 63) >= bytes) return;  // not the first k of a line
  __builtin_prefetch(reinterpret_cast<const char*>(A.w0) + off + kPrefetch, 0, 3);
  if constexpr (MODE == kPair) __builtin_prefetch(reinterpret_cast<const char*>(A.w1) + off + kPrefetch, 0, 3);
}

// a[m] = fma(w(k), x[m][k], a[m]) for MT rows.
template <int FMT, int MODE, int MT, class T>
inline void fp_step(const FpOperand<T>& A, int64_t k, const float* const* x, __m512* a) {
  fp_prefetch<MODE>(A, k);
  const __m512 w = fp_weights<FMT, MODE>(A, k);
  #pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) a[m] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[m][k]), a[m]);
}

// out[m][0 .. 16) (kSingle: [0 .. 8)) = unit rows . x[m] for MT fp32 activation rows.
template <int FMT, int MODE, int MT, class T>
void zmm_fp(const FpOperand<T>& A, const float* const* x, float* const* out) {
  __m512 acc[MT], even[MT], odd[MT];
  #pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) acc[m] = even[m] = odd[m] = _mm512_setzero_ps();
  if constexpr (FMT == INT8) {
    for (int64_t g = 0; g < A.kp / A.gs; ++g) {
      #pragma GCC unroll 16
      for (int m = 0; m < MT; ++m) even[m] = odd[m] = _mm512_setzero_ps();
      for (int64_t k = g * A.gs; k < (g + 1) * A.gs; k += 2) {  // gs is even
        fp_step<FMT, MODE, MT>(A, k, x, even);
        fp_step<FMT, MODE, MT>(A, k + 1, x, odd);
      }
      const __m512 s = zmm_f16<MODE>(A.s0 + g * A.sstride, A.s1 + g * A.sstride);
      #pragma GCC unroll 16
      for (int m = 0; m < MT; ++m) acc[m] = _mm512_fmadd_ps(s, _mm512_add_ps(even[m], odd[m]), acc[m]);
    }
  } else {
    int64_t k = 0;
    for (; k + 2 <= A.kp; k += 2) {
      fp_step<FMT, MODE, MT>(A, k, x, even);
      fp_step<FMT, MODE, MT>(A, k + 1, x, odd);
    }
    if (k < A.kp) fp_step<FMT, MODE, MT>(A, k, x, even);
    #pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_add_ps(even[m], odd[m]);
  }
  store_unit_rows<MODE, MT>(acc, out);
}

template <int FMT, int MODE, class T>
void zmm_fp_rows(const FpOperand<T>& A, const float* const* x, float* const* out, int n) {
  for_row_chunks(n, [&](auto mt, int i) { zmm_fp<FMT, MODE, decltype(mt)::value>(A, x + i, out + i); });
}

// The unit's 16 weights at p0 (lanes 0-7, kContig all 16) and p1 (lanes 8-15, kPair) as fp32.
template <int FMT, int MODE, class T>
inline __m512 fp_weights_at(const T* p0, const T* p1) {
  return fp_weights<FMT, MODE>(FpOperand<T>{p0, p1, nullptr, nullptr, 0, 0, 0, 0}, 0);
}

// acc[m] = fma(w, x[m], acc[m]) for the MT floats of one k of an interleaved chunk.
template <int MT>
inline void fp_fma_rows(__m512 w, const float* xk, __m512* a) {
  #pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) a[m] = _mm512_fmadd_ps(w, _mm512_set1_ps(xk[m]), a[m]);
}

// Pairs of k ahead of the interleaved activations the pass loop prefetches (into L1: 1 KiB at MT = 8, one
// line per pair; two lines a pair past 8 rows). A unit reads all of its expert's activations once more (a
// gate_up unit 32 KiB per 8 rows at K 1024, from L2), and the L1 streamer alone left the loop waiting on them:
// an 8-row loop of this shape, K 1024, acts and weights in L2, one thread, ran 39.5 GMAC/s without, 53.5 with
// 1 KiB ahead (55 in L1).
constexpr int64_t kFpActsAheadPairs = 16;

// zmm_fp for one pass of MT (<= kFpPassRows) interleaved rows xc [kp][MT] (FpActs): the same fma sequence per
// lane, each weight converted once for all MT rows, the weights and the activations each read through one
// pointer bumped per pair of k.
template <int FMT, int MODE, int MT, class T>
void zmm_fp_chunk(const FpOperand<T>& A, const float* xc, float* const* out) {
  static_assert(MT <= kFpPassRows, "2 MT chains and a weight in 32 registers");
  __m512 acc[MT], even[MT], odd[MT];
  #pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) acc[m] = even[m] = odd[m] = _mm512_setzero_ps();
  const T* p0 = A.w0;
  const T* p1 = A.w1;
  const int64_t st = A.stride;
  // kPrefetch bytes ahead in each stream, per pair of k (a line holds 1-4 pairs; fp32 kContig: two lines a pair)
  constexpr bool two_lines = FMT == FP32 && MODE == kContig;
  constexpr int64_t ahead = kFpActsAheadPairs * 2 * MT * (int64_t)sizeof(float);
  auto pair = [&](__m512* e, __m512* o) {
    __builtin_prefetch(reinterpret_cast<const char*>(xc) + ahead, 0, 3);
    if constexpr (2 * MT * sizeof(float) > 64) __builtin_prefetch(reinterpret_cast<const char*>(xc) + ahead + 64, 0, 3);
    __builtin_prefetch(reinterpret_cast<const char*>(p0) + kPrefetch, 0, 3);
    if constexpr (two_lines) __builtin_prefetch(reinterpret_cast<const char*>(p0) + kPrefetch + 64, 0, 3);
    if constexpr (MODE == kPair) __builtin_prefetch(reinterpret_cast<const char*>(p1) + kPrefetch, 0, 3);
    fp_fma_rows<MT>(fp_weights_at<FMT, MODE>(p0, p1), xc, e);
    fp_fma_rows<MT>(fp_weights_at<FMT, MODE>(p0 + st, MODE == kPair ? p1 + st : p1), xc + MT, o);
    p0 += 2 * st;
    if constexpr (MODE == kPair) p1 += 2 * st;
    xc += 2 * MT;
  };
  if constexpr (FMT == INT8) {
    for (int64_t g = 0; g < A.kp / A.gs; ++g) {
      #pragma GCC unroll 16
      for (int m = 0; m < MT; ++m) even[m] = odd[m] = _mm512_setzero_ps();
      for (int64_t j = 0; j < A.gs; j += 2) pair(even, odd);  // gs is even
      const __m512 s = zmm_f16<MODE>(A.s0 + g * A.sstride, A.s1 + g * A.sstride);
      #pragma GCC unroll 16
      for (int m = 0; m < MT; ++m) acc[m] = _mm512_fmadd_ps(s, _mm512_add_ps(even[m], odd[m]), acc[m]);
    }
  } else {
    for (int64_t j = 0; j + 2 <= A.kp; j += 2) pair(even, odd);
    if (A.kp & 1) fp_fma_rows<MT>(fp_weights_at<FMT, MODE>(p0, p1), xc, even);
    #pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_add_ps(even[m], odd[m]);
  }
  store_unit_rows<MODE, MT>(acc, out);
}

// f(std::integral_constant<int, mt>{}) for a pass of mt (1 .. kFpPassRows) rows.
template <class F>
inline void with_pass_rows(int64_t mt, F&& f) {
  static_assert(kFpPassRows == 15, "one case per pass size");
  using std::integral_constant;
  switch (mt) {
    case 15: f(integral_constant<int, 15>{}); break;
    case 14: f(integral_constant<int, 14>{}); break;
    case 13: f(integral_constant<int, 13>{}); break;
    case 12: f(integral_constant<int, 12>{}); break;
    case 11: f(integral_constant<int, 11>{}); break;
    case 10: f(integral_constant<int, 10>{}); break;
    case 9: f(integral_constant<int, 9>{}); break;
    case 8: f(integral_constant<int, 8>{}); break;
    case 7: f(integral_constant<int, 7>{}); break;
    case 6: f(integral_constant<int, 6>{}); break;
    case 5: f(integral_constant<int, 5>{}); break;
    case 4: f(integral_constant<int, 4>{}); break;
    case 3: f(integral_constant<int, 3>{}); break;
    case 2: f(integral_constant<int, 2>{}); break;
    case 1: f(integral_constant<int, 1>{}); break;
    default: break;
  }
}

// Rows [0, n) of an interleaved set (n a multiple of kFpSegment or the set's last rows) through one unit, a pass
// at a time (fp_pass_of). Each pass converts every weight again, and a pass of few rows is bound by its chains'
// fma latency (one row: 2 chains): 17 rows run as 9 + 8, not 8 + 8 + 1.
template <int FMT, int MODE, class T>
void zmm_fp_chunks(const FpOperand<T>& A, const FpActs& X, float* const* out, int n) {
  for (int64_t s0 = 0; s0 < n; s0 += kFpSegment) {
    const int64_t L = std::min<int64_t>(kFpSegment, n - s0);
    for (int64_t j = 0; j < L;) {
      int64_t start, mt;
      fp_pass_of(j, L, start, mt);
      with_pass_rows(mt, [&](auto c) { zmm_fp_chunk<FMT, MODE, decltype(c)::value>(A, X.rows(s0 + j).x, out + s0 + j); });
      j += mt;
    }
  }
}

// Many rows (n > kSequentialRows) of unit `u` from interleaved activations: R8 = 2 the gate_up tile
// first + u, R8 = 1 the pair of tiles first + 2u, first + 2u + 1 (or the last single one).
template <int FMT, int R8>
void zmm_fp_unit_chunks(const Mat& M, int64_t first, int64_t u, int64_t n8, const FpActs& X, float* const* out,
                        int n) {
  using T = std::conditional_t<FMT == FP32, float, std::conditional_t<FMT == INT8, int8_t, uint16_t>>;
  const T* w = static_cast<const T*>(M.w);
  const int64_t ng = FMT == INT8 ? M.kp / M.gs : 0;
  if constexpr (R8 == 2) {
    const int64_t t = first + u;
    const uint16_t* s = FMT == INT8 ? M.scales + t * ng * 16 : nullptr;
    zmm_fp_chunks<FMT, kContig>(FpOperand<T>{w + t * M.kp * 16, nullptr, s, nullptr, 16, 16, M.kp, M.gs}, X, out, n);
  } else {
    const int64_t t = first + 2 * u;
    const uint16_t* s = FMT == INT8 ? M.scales + t * ng * 8 : nullptr;
    const FpOperand<T> A{w + t * M.kp * 8, w + (t + 1) * M.kp * 8, s, s ? s + ng * 8 : nullptr, 8, 8, M.kp, M.gs};
    if (2 * u + 1 < n8) zmm_fp_chunks<FMT, kPair>(A, X, out, n);
    else zmm_fp_chunks<FMT, kSingle>(A, X, out, n);
  }
}

// int8 weights, few activation rows (n <= kSequentialRows): the per-row order is tile_dot's (each group's
// even-k and odd-k chains from zero, then fma(scale, even + odd, acc) in group order), but one row's two
// chains on one tile leave the fma latency exposed (the ymm tiles: ~10 GB/s per core with the weights in
// cache). Groups are independent until they reach acc, so G groups run side by side, each with its own
// chains, and are added to acc in group order: the same bits with 2G (R8 = 2) or T x G (R8 = 1) chains per
// row. G = 2 (~16 GB/s per core in cache, as W8A8); G = 4 at M = 1 measured no faster.
//
// R8 = 1: T adjacent 8-row tiles (T = 2: a unit). A tile's 16 bytes of a k pair ([k: r0..7][k+1: r0..7],
// contiguous) convert to 16 fp32 lanes at once and multiply [x[k] x 8 | x[k+1] x 8]: lanes 0-7 run the
// even-k chain, lanes 8-15 the odd-k chain; one convert and one fma per 16 weights. A unit's two tiles are two
// streams a tile apart, prefetched as W4A8's pairs (pair_prefetch). One tile after the other with G = 4 (one
// stream) measured 0.6x in cache: a vpermps of x per tile instead of per unit.
template <int T, int G, int MT>
inline void zmm_i8_kpair_groups(const int8_t* w, const uint16_t* s, int64_t kp, int64_t gs, int64_t g0,
                                const float* const* x, __m256 (*acc)[T]) {
  const int64_t tw = kp * 8, ts = kp / gs * 8;  // one tile's weight bytes, scales
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 c[G][MT][T];
  #pragma GCC unroll 4
  for (int h = 0; h < G; ++h)
    #pragma GCC unroll 4
    for (int m = 0; m < MT; ++m)
      #pragma GCC unroll 4
      for (int t = 0; t < T; ++t) c[h][m][t] = _mm512_setzero_ps();
  for (int64_t j = 0; j < gs; j += 2) {  // gs is even
    #pragma GCC unroll 4
    for (int h = 0; h < G; ++h) {
      const int64_t k = (g0 + h) * gs + j;
      if ((k & 7) == 0) {  // one prefetch per 64-byte line (8 k) of each tile
        if constexpr (T == 2) pair_prefetch(w, w + tw, k * 8, tw);
        else __builtin_prefetch(w + k * 8 + kPrefetch, 0, 3);
      }
      __m512 wv[T];
      #pragma GCC unroll 4
      for (int t = 0; t < T; ++t)
        wv[t] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + t * tw + k * 8))));
      #pragma GCC unroll 4
      for (int m = 0; m < MT; ++m) {
        const __m512 xv = _mm512_permutexvar_ps(
            halves, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(x[m] + k)))));
        #pragma GCC unroll 4
        for (int t = 0; t < T; ++t) c[h][m][t] = _mm512_fmadd_ps(wv[t], xv, c[h][m][t]);
      }
    }
  }
  #pragma GCC unroll 4
  for (int h = 0; h < G; ++h)
    #pragma GCC unroll 4
    for (int t = 0; t < T; ++t) {
      const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + t * ts + (g0 + h) * 8)));
      #pragma GCC unroll 4
      for (int m = 0; m < MT; ++m) {
        const __m256 even = _mm512_castps512_ps256(c[h][m][t]);
        const __m256 odd = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(c[h][m][t]), 1));
        acc[m][t] = _mm256_fmadd_ps(sc, _mm256_add_ps(even, odd), acc[m][t]);
      }
    }
}

// out[m][0 .. 8T) = the T tiles at w (scales s) . x[m] for MT (<= kSequentialRows) rows.
template <int T, int MT>
void zmm_i8_kpairs(const int8_t* w, const uint16_t* s, int64_t kp, int64_t gs, const float* const* x,
                   float* const* out) {
  constexpr int G = 2;
  __m256 acc[MT][T];
  #pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
    #pragma GCC unroll 4
    for (int t = 0; t < T; ++t) acc[m][t] = _mm256_setzero_ps();
  const int64_t ng = kp / gs;
  int64_t g = 0;
  for (; g + G <= ng; g += G) zmm_i8_kpair_groups<T, G, MT>(w, s, kp, gs, g, x, acc);
  for (; g < ng; ++g) zmm_i8_kpair_groups<T, 1, MT>(w, s, kp, gs, g, x, acc);
  #pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
    #pragma GCC unroll 4
    for (int t = 0; t < T; ++t) _mm256_storeu_ps(out[m] + 8 * t, acc[m][t]);
}

// R8 = 2: one gate_up tile ([k: gate r0..7, up r0..7], 16 contiguous bytes per k): even and odd k each one
// 16-lane chain, as zmm_fp's kContig, for G groups side by side.
template <int G, int MT>
inline void zmm_i8_gate_up_groups(const int8_t* w, const uint16_t* s, int64_t gs, int64_t g0, const float* const* x,
                                  __m512* acc) {
  __m512 even[G][MT], odd[G][MT];
  #pragma GCC unroll 4
  for (int h = 0; h < G; ++h)
    #pragma GCC unroll 4
    for (int m = 0; m < MT; ++m) even[h][m] = odd[h][m] = _mm512_setzero_ps();
  for (int64_t j = 0; j < gs; j += 2) {  // gs is even
    #pragma GCC unroll 4
    for (int h = 0; h < G; ++h) {
      const int64_t k = (g0 + h) * gs + j;
      if ((k & 3) == 0) __builtin_prefetch(w + k * 16 + kPrefetch, 0, 3);  // one per 64-byte line (4 k)
      const __m512 we = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * 16))));
      const __m512 wo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * 16 + 16))));
      #pragma GCC unroll 4
      for (int m = 0; m < MT; ++m) {
        even[h][m] = _mm512_fmadd_ps(we, _mm512_set1_ps(x[m][k]), even[h][m]);
        odd[h][m] = _mm512_fmadd_ps(wo, _mm512_set1_ps(x[m][k + 1]), odd[h][m]);
      }
    }
  }
  #pragma GCC unroll 4
  for (int h = 0; h < G; ++h) {
    const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + (g0 + h) * 16)));
    #pragma GCC unroll 4
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_fmadd_ps(sc, _mm512_add_ps(even[h][m], odd[h][m]), acc[m]);
  }
}

template <int MT>
void zmm_i8_gate_up(const int8_t* w, const uint16_t* s, int64_t kp, int64_t gs, const float* const* x,
                    float* const* out) {
  constexpr int G = 2;
  __m512 acc[MT];
  #pragma GCC unroll 4
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t ng = kp / gs;
  int64_t g = 0;
  for (; g + G <= ng; g += G) zmm_i8_gate_up_groups<G, MT>(w, s, gs, g, x, acc);
  for (; g < ng; ++g) zmm_i8_gate_up_groups<1, MT>(w, s, gs, g, x, acc);
  #pragma GCC unroll 4
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out[m], acc[m]);
}

// Few-row int8 unit `u` (as zmm_fp_unit_rows) for n <= kSequentialRows rows.
template <int R8>
void zmm_i8_few_rows(const Mat& M, int64_t first, int64_t u, int64_t n8, const float* const* x, float* const* out,
                     int n) {
  static_assert(kSequentialRows == 2, "one case per row count up to kSequentialRows");
  const int64_t ng = M.kp / M.gs;
  const int8_t* w = static_cast<const int8_t*>(M.w);
  if constexpr (R8 == 2) {
    const int64_t t = first + u;
    const int8_t* wt = w + t * M.kp * 16;
    const uint16_t* s = M.scales + t * ng * 16;
    if (n == 2) zmm_i8_gate_up<2>(wt, s, M.kp, M.gs, x, out);
    else zmm_i8_gate_up<1>(wt, s, M.kp, M.gs, x, out);
  } else {
    const int64_t t = first + 2 * u;
    const int8_t* wt = w + t * M.kp * 8;
    const uint16_t* s = M.scales + t * ng * 8;
    const bool pair = 2 * u + 1 < n8;
    if (n == 2) pair ? zmm_i8_kpairs<2, 2>(wt, s, M.kp, M.gs, x, out) : zmm_i8_kpairs<1, 2>(wt, s, M.kp, M.gs, x, out);
    else pair ? zmm_i8_kpairs<2, 1>(wt, s, M.kp, M.gs, x, out) : zmm_i8_kpairs<1, 1>(wt, s, M.kp, M.gs, x, out);
  }
}

// Unit `u` of a tiled fp32-activation projection (as zmm_unit_rows): R8 = 2 the gate_up tile first + u,
// R8 = 1 the tiles first + 2u and first + 2u + 1 (if 2u + 1 < n8; few int8 rows: zmm_i8_few_rows).
template <int FMT, int R8>
void zmm_fp_unit_rows(const Mat& M, int64_t first, int64_t u, int64_t n8, const float* const* x, float* const* out,
                      int n) {
  using T = std::conditional_t<FMT == FP32, float, std::conditional_t<FMT == INT8, int8_t, uint16_t>>;
  if constexpr (FMT == INT8) {
    if (n <= kSequentialRows) return zmm_i8_few_rows<R8>(M, first, u, n8, x, out, n);  // memory-bound calls
  }
  const T* w = static_cast<const T*>(M.w);
  const int64_t ng = FMT == INT8 ? M.kp / M.gs : 0;
  if constexpr (R8 == 2) {
    const int64_t t = first + u;
    const uint16_t* s = FMT == INT8 ? M.scales + t * ng * 16 : nullptr;
    zmm_fp_rows<FMT, kContig>(FpOperand<T>{w + t * M.kp * 16, nullptr, s, nullptr, 16, 16, M.kp, M.gs}, x, out, n);
  } else {
    const int64_t t = first + 2 * u;
    const bool pair = 2 * u + 1 < n8;
    const uint16_t* s = FMT == INT8 ? M.scales + t * ng * 8 : nullptr;
    const FpOperand<T> A{w + t * M.kp * 8, w + (t + 1) * M.kp * 8, s, s ? s + ng * 8 : nullptr, 8, 8, M.kp, M.gs};
    // fp32 / bf16 weights: a pair at any row count. One row's fma chains are latency-bound on one 8-lane
    // tile (bf16 M = 1 in L2: 11.5 GB/s on one core), 16 lanes double the work per fma (17.2 GB/s).
    if (pair) zmm_fp_rows<FMT, kPair>(A, x, out, n);
    else zmm_fp_rows<FMT, kSingle>(A, x, out, n);
  }
}

}  // namespace

#endif  // MOEGATE_ZMM
