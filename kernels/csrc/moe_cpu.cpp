// Fused routed-expert MoE for CPU: gate+up -> SiLU(gate)*up -> down, weighted sum per token.
//
// Compiled twice by kernels/build.py: with -mavx2 -mfma -mf16c (AVX2 path, intrinsics) and without
// (generic path, plain loops the compiler may auto-vectorize). Always -ffp-contract=off so each
// output row's arithmetic is a fixed sequence of operations: a row's result does not depend on
// which other rows share the batch, on thread count, or on scheduling.
//
// Weight layout (see kernels/formats.py): a projection [N, K] is cut into tiles of 8 output rows;
// gate_up tiles hold 8 gate rows and the matching 8 up rows (R8 = 2), down tiles 8 rows (R8 = 1).
// Inside a tile, for each k (int4: each pair of k) the R8 * 8 row values are contiguous, so the
// inner loop streams one contiguous block per tile and needs no horizontal reductions.
// Quantized formats: per (row, group of gs along K) an fp16 scale s (and for int4_asym an fp16
// min m); w = q * s (int8), w = (u - 8) * s (int4), w = u * s + m (int4_asym), u in [0, 15].
// int4 tiles hold blocks of 8 k: per row one dword whose nibble 2c is k0 + c and nibble 2c+1 is
// k0 + 4 + c (c = 0..3). The int4 gate_up projection is W4A8: the layer input is quantized per
// token and group to int8 (symmetric, round half to even), integer dot products via maddubs are
// exact, and the group result is s*sx*sum(u*q) + b*sx*sum(q) (b = -8s or the min). The int4 down
// projection and every other format use fp32 activations with weights dequantized in registers.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define MOEGATE_AVX2 1
#endif

namespace {

enum Fmt { FP32 = 0, BF16 = 1, INT8 = 2, INT4 = 3, INT4A = 4 };

#ifdef MOEGATE_AVX2
struct V8 {
  __m256 v;
};
inline V8 v_zero() { return {_mm256_setzero_ps()}; }
inline V8 v_load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void v_store(float* p, V8 a) { _mm256_storeu_ps(p, a.v); }
inline V8 v_bcast(const float* p) { return {_mm256_broadcast_ss(p)}; }
inline V8 v_set1(float f) { return {_mm256_set1_ps(f)}; }
inline V8 v_mul(V8 a, V8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline V8 v_fma(V8 a, V8 b, V8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline V8 load_bf16(const uint16_t* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
}
inline V8 load_i8(const int8_t* p) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))};
}
struct U4 {  // 8 rows x 8 k of int4 (one dword per row)
  __m256i v;
};
inline U4 load_u4(const uint8_t* p) { return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))}; }
template <int J>
inline V8 u4_nibble(U4 b) {  // nibble J of every row dword, as float
  return {_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b.v, 4 * J), _mm256_set1_epi32(15)))};
}
struct I8 {  // 8 int32 lanes
  __m256i v;
};
inline I8 i_zero() { return {_mm256_setzero_si256()}; }
inline V8 i_cvt(I8 a) { return {_mm256_cvtepi32_ps(a.v)}; }
// acc[row] += sum over the 8 k of u[row][k] * q[k]; q = 8 int8 activations for this k block.
template <int R8, int MT>
inline void w4a8_block(const U4* w, const int8_t* const* q, int64_t off, I8 (*acc)[R8]) {
  const __m256i m15 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256i lo[R8], hi[R8];
  for (int r = 0; r < R8; ++r) {
    lo[r] = _mm256_and_si256(w[r].v, m15);
    hi[r] = _mm256_and_si256(_mm256_srli_epi16(w[r].v, 4), m15);
  }
  for (int m = 0; m < MT; ++m) {
    int32_t a, b;
    std::memcpy(&a, q[m] + off, 4);
    std::memcpy(&b, q[m] + off + 4, 4);
    const __m256i xa = _mm256_set1_epi32(a), xb = _mm256_set1_epi32(b);
    for (int r = 0; r < R8; ++r) {
      __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo[r], xa), _mm256_maddubs_epi16(hi[r], xb));
      acc[m][r].v = _mm256_add_epi32(acc[m][r].v, _mm256_madd_epi16(p, ones));
    }
  }
}
inline V8 load_f16(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
#else
struct V8 {
  float v[8];
};
inline V8 v_zero() { V8 r; for (int i = 0; i < 8; ++i) r.v[i] = 0.f; return r; }
inline V8 v_load(const float* p) { V8 r; for (int i = 0; i < 8; ++i) r.v[i] = p[i]; return r; }
inline void v_store(float* p, V8 a) { for (int i = 0; i < 8; ++i) p[i] = a.v[i]; }
inline V8 v_set1(float f) { V8 r; for (int i = 0; i < 8; ++i) r.v[i] = f; return r; }
inline V8 v_bcast(const float* p) { return v_set1(*p); }
inline V8 v_mul(V8 a, V8 b) { V8 r; for (int i = 0; i < 8; ++i) r.v[i] = a.v[i] * b.v[i]; return r; }
inline V8 v_fma(V8 a, V8 b, V8 c) {
  V8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i];  // not contracted: -ffp-contract=off
  return r;
}
inline float bits_to_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0) {  // zero / subnormal: man * 2^-24, exact in fp32
    float f = (float)man * 5.9604644775390625e-08f;
    return sign ? -f : f;
  }
  if (exp == 31) return bits_to_f32(sign | 0x7f800000u | (man << 13));
  return bits_to_f32(sign | ((exp + 112) << 23) | (man << 13));
}
inline V8 load_bf16(const uint16_t* p) {
  V8 r; for (int i = 0; i < 8; ++i) r.v[i] = bits_to_f32((uint32_t)p[i] << 16); return r;
}
inline V8 load_i8(const int8_t* p) { V8 r; for (int i = 0; i < 8; ++i) r.v[i] = (float)p[i]; return r; }
struct U4 {
  const uint8_t* p;
};
inline U4 load_u4(const uint8_t* p) { return {p}; }
template <int J>
inline V8 u4_nibble(U4 b) {
  V8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = (float)((b.p[4 * i + J / 2] >> (4 * (J & 1))) & 15);
  return r;
}
struct I8 {
  int32_t v[8];
};
inline I8 i_zero() { I8 r; for (int i = 0; i < 8; ++i) r.v[i] = 0; return r; }
inline V8 i_cvt(I8 a) { V8 r; for (int i = 0; i < 8; ++i) r.v[i] = (float)a.v[i]; return r; }
template <int R8, int MT>
inline void w4a8_block(const U4* w, const int8_t* const* q, int64_t off, I8 (*acc)[R8]) {
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R8; ++r)
      for (int i = 0; i < 8; ++i) {
        int32_t sum = 0;
        for (int c = 0; c < 4; ++c) {
          const uint8_t b = w[r].p[4 * i + c];
          sum += (b & 15) * q[m][off + c] + (b >> 4) * q[m][off + 4 + c];
        }
        acc[m][r].v[i] += sum;
      }
}
inline V8 load_f16(const uint16_t* p) { V8 r; for (int i = 0; i < 8; ++i) r.v[i] = f16_to_f32(p[i]); return r; }
#endif

// One tiled projection of one expert.
struct Mat {
  const void* w;
  const uint16_t* scales;  // fp16 [n8][kp / gs][R8][8]; null for fp32 / bf16
  const uint16_t* mins;    // fp16, int4_asym only
  int64_t kp;              // padded K
  int64_t gs;              // group size along K (quantized formats)
};

// out[m][0 .. R8*8) = tile rows . X[m] for MT activation rows. xs[m] holds per-group sums of X[m].
template <int FMT, int R8, int MT>
void tile_dot(const Mat& A, int64_t tile, const float* const* X, const float* const* xs, float* const* out) {
  V8 acc[MT][R8];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R8; ++r) acc[m][r] = v_zero();
  const int64_t kp = A.kp;
  if constexpr (FMT == FP32 || FMT == BF16) {
    using T = std::conditional_t<FMT == FP32, float, uint16_t>;
    const T* w = static_cast<const T*>(A.w) + tile * kp * R8 * 8;
    for (int64_t k = 0; k < kp; ++k) {
      V8 wv[R8];
      for (int r = 0; r < R8; ++r) {
        if constexpr (FMT == FP32) wv[r] = v_load(w + (k * R8 + r) * 8);
        else wv[r] = load_bf16(w + (k * R8 + r) * 8);
      }
      for (int m = 0; m < MT; ++m) {
        V8 xb = v_bcast(X[m] + k);
        for (int r = 0; r < R8; ++r) acc[m][r] = v_fma(wv[r], xb, acc[m][r]);
      }
    }
  } else {
    const int64_t gs = A.gs, ng = kp / gs;
    const uint16_t* sc = A.scales + tile * ng * R8 * 8;
    const uint16_t* mn = FMT == INT4A ? A.mins + tile * ng * R8 * 8 : nullptr;
    const int8_t* w8 = static_cast<const int8_t*>(A.w) + tile * kp * R8 * 8;
    const uint8_t* w4 = static_cast<const uint8_t*>(A.w) + tile * (kp / 8) * R8 * 32;
    for (int64_t g = 0; g < ng; ++g) {
      V8 gacc[MT][R8];
      for (int m = 0; m < MT; ++m)
        for (int r = 0; r < R8; ++r) gacc[m][r] = v_zero();
      if constexpr (FMT == INT8) {
        for (int64_t k = g * gs; k < (g + 1) * gs; ++k) {
          V8 wv[R8];
          for (int r = 0; r < R8; ++r) wv[r] = load_i8(w8 + (k * R8 + r) * 8);
          for (int m = 0; m < MT; ++m) {
            V8 xb = v_bcast(X[m] + k);
            for (int r = 0; r < R8; ++r) gacc[m][r] = v_fma(wv[r], xb, gacc[m][r]);
          }
        }
      } else {
        for (int64_t kb = g * gs / 8; kb < (g + 1) * gs / 8; ++kb) {
          U4 b[R8];
          for (int r = 0; r < R8; ++r) b[r] = load_u4(w4 + (kb * R8 + r) * 32);
          // nibble J holds k = 8kb + J/2 (J even) or 8kb + 4 + J/2 (J odd)
#define MOEGATE_NIBBLE(J)                                                                  \
  {                                                                                        \
    V8 wv[R8];                                                                             \
    for (int r = 0; r < R8; ++r) wv[r] = u4_nibble<J>(b[r]);                              \
    for (int m = 0; m < MT; ++m) {                                                         \
      V8 xb = v_bcast(X[m] + kb * 8 + ((J)&1) * 4 + (J) / 2);                              \
      for (int r = 0; r < R8; ++r) gacc[m][r] = v_fma(wv[r], xb, gacc[m][r]);             \
    }                                                                                      \
  }
          MOEGATE_NIBBLE(0) MOEGATE_NIBBLE(1) MOEGATE_NIBBLE(2) MOEGATE_NIBBLE(3)
          MOEGATE_NIBBLE(4) MOEGATE_NIBBLE(5) MOEGATE_NIBBLE(6) MOEGATE_NIBBLE(7)
#undef MOEGATE_NIBBLE
        }
      }
      for (int r = 0; r < R8; ++r) {
        V8 s = load_f16(sc + (g * R8 + r) * 8);
        V8 b = s;
        if constexpr (FMT == INT4) b = v_mul(s, v_set1(-8.f));  // exact: power-of-two multiple
        if constexpr (FMT == INT4A) b = load_f16(mn + (g * R8 + r) * 8);
        for (int m = 0; m < MT; ++m) {
          acc[m][r] = v_fma(s, gacc[m][r], acc[m][r]);
          if constexpr (FMT == INT4 || FMT == INT4A) acc[m][r] = v_fma(b, v_bcast(xs[m] + g), acc[m][r]);
        }
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R8; ++r) v_store(out[m] + r * 8, acc[m][r]);
}

// W4A8: out[m] = tile rows . dequant(q[m]) with q[m] int8 activations, sx[m] / qs[m] per-group
// activation scales and sums of q (as float).
template <int FMT, int R8, int MT>
void tile_dot_w4a8(const Mat& A, int64_t tile, const int8_t* const* q, const float* const* sx,
                   const float* const* qs, float* const* out) {
  V8 acc[MT][R8];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R8; ++r) acc[m][r] = v_zero();
  const int64_t kp = A.kp, gs = A.gs, ng = kp / gs;
  const uint16_t* sc = A.scales + tile * ng * R8 * 8;
  const uint16_t* mn = FMT == INT4A ? A.mins + tile * ng * R8 * 8 : nullptr;
  const uint8_t* w4 = static_cast<const uint8_t*>(A.w) + tile * (kp / 8) * R8 * 32;
  for (int64_t g = 0; g < ng; ++g) {
    I8 isum[MT][R8];
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < R8; ++r) isum[m][r] = i_zero();
    for (int64_t kb = g * gs / 8; kb < (g + 1) * gs / 8; ++kb) {
      U4 b[R8];
      for (int r = 0; r < R8; ++r) b[r] = load_u4(w4 + (kb * R8 + r) * 32);
      w4a8_block<R8, MT>(b, q, kb * 8, isum);
    }
    for (int r = 0; r < R8; ++r) {
      V8 s = load_f16(sc + (g * R8 + r) * 8);
      V8 b = FMT == INT4A ? load_f16(mn + (g * R8 + r) * 8) : v_mul(s, v_set1(-8.f));
      for (int m = 0; m < MT; ++m) {
        V8 sxv = v_bcast(sx[m] + g);
        acc[m][r] = v_fma(v_mul(s, sxv), i_cvt(isum[m][r]), acc[m][r]);
        acc[m][r] = v_fma(v_mul(b, sxv), v_bcast(qs[m] + g), acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R8; ++r) v_store(out[m] + r * 8, acc[m][r]);
}

template <int FMT, int R8>
void tile_rows_w4a8(const Mat& A, int64_t tile, const int8_t* const* q, const float* const* sx,
                    const float* const* qs, float* const* out, int n) {
  int i = 0;
  for (; i + 4 <= n; i += 4) tile_dot_w4a8<FMT, R8, 4>(A, tile, q + i, sx + i, qs + i, out + i);
  switch (n - i) {
    case 3: tile_dot_w4a8<FMT, R8, 3>(A, tile, q + i, sx + i, qs + i, out + i); break;
    case 2: tile_dot_w4a8<FMT, R8, 2>(A, tile, q + i, sx + i, qs + i, out + i); break;
    case 1: tile_dot_w4a8<FMT, R8, 1>(A, tile, q + i, sx + i, qs + i, out + i); break;
    default: break;
  }
}

// Symmetric per-group int8 quantization of a padded row: s = amax / 127, q = round_half_even(x / s).
void quantize_row(const float* x, int64_t kp, int64_t gs, int8_t* q, float* sx, float* qs) {
  for (int64_t g = 0; g < kp / gs; ++g) {
    float amax = 0.f;
    for (int64_t k = g * gs; k < (g + 1) * gs; ++k) amax = std::max(amax, std::fabs(x[k]));
    const float s = amax / 127.f;
    int32_t sum = 0;
    for (int64_t k = g * gs; k < (g + 1) * gs; ++k) {
      const float v = s > 0.f ? std::nearbyint(x[k] / s) : 0.f;
      q[k] = (int8_t)std::min(127.f, std::max(-127.f, v));
      sum += q[k];
    }
    sx[g] = s;
    qs[g] = (float)sum;
  }
}

constexpr int kMaxMT = 4;

// Rows rows[0..n) of one expert through one tile, in chunks of up to kMaxMT activation rows.
template <int FMT, int R8>
void tile_rows(const Mat& A, int64_t tile, const float* const* X, const float* const* xs, float* const* out, int n) {
  int i = 0;
  for (; i + 4 <= n; i += 4) tile_dot<FMT, R8, 4>(A, tile, X + i, xs + i, out + i);
  switch (n - i) {
    case 3: tile_dot<FMT, R8, 3>(A, tile, X + i, xs + i, out + i); break;
    case 2: tile_dot<FMT, R8, 2>(A, tile, X + i, xs + i, out + i); break;
    case 1: tile_dot<FMT, R8, 1>(A, tile, X + i, xs + i, out + i); break;
    default: break;
  }
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// Per-group sums of a padded activation row (int4 zero-point correction); fixed left-to-right order.
void group_sums(const float* x, int64_t kp, int64_t gs, float* out) {
  for (int64_t g = 0; g < kp / gs; ++g) {
    float s = 0.f;
    for (int64_t k = g * gs; k < (g + 1) * gs; ++k) s += x[k];
    out[g] = s;
  }
}

struct Problem {
  int64_t T, K, E, H, I, gs, h8, i8, hp, ip, hbuf;
  Mat gu, dn;
};

template <int FMT>
int run(const Problem& P, const float* x, const int64_t* ids, const float* wts, float* out, int nthreads) {
  const int64_t T = P.T, K = P.K, E = P.E;
  // Counting sort of (token, slot) by expert: experts read once, rows in token order inside.
  std::vector<int64_t> count(E + 1, 0);
  for (int64_t j = 0; j < T * K; ++j) {
    int64_t e = ids[j];
    if (e < -1 || e >= E) return -1;
    if (e >= 0) ++count[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) count[e + 1] += count[e];
  const int64_t S = count[E];
  std::vector<int64_t> row_of(T * K, -1), src_token(S), fill(count.begin(), count.end() - 1);
  for (int64_t j = 0; j < T * K; ++j)
    if (ids[j] >= 0) {
      int64_t r = fill[ids[j]]++;
      row_of[j] = r;
      src_token[r] = j / K;
    }
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e)
    if (count[e + 1] > count[e]) active.push_back(e);
  const int64_t na = (int64_t)active.size();
  const bool quant = FMT != FP32 && FMT != BF16;
  const bool need_xs = FMT == INT4 || FMT == INT4A;
  const int64_t hp = P.hp, ip = P.ip, hbuf = P.hbuf, ldy = P.h8 * 8;
  const int64_t ngh = quant ? hp / P.gs : 0, ngi = quant ? ip / P.gs : 0;
  // Padded copies: per token X [T, hp], per row H [S, hbuf], Y [S, h8*8].
  std::vector<float> xp(T * hp, 0.f), xs(T * ngh + 1), hb(S * hbuf + 1, 0.f), hs(S * ngi + 1), y(S * ldy + 1);
  std::vector<int8_t> xq(need_xs ? T * hp : 1);  // int4: W4A8 gate_up input; xs = scales, xqs = sums
  std::vector<float> xqs(T * ngh + 1);
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(&xp[t * hp], x + t * P.H, sizeof(float) * P.H);
    if (need_xs) quantize_row(&xp[t * hp], hp, P.gs, &xq[t * hp], &xs[t * ngh], &xqs[t * ngh]);
  }
  const int64_t n1 = na * P.i8, n2 = na * P.h8;
#pragma omp parallel num_threads(nthreads)
  {
    const float* xr[kMaxMT * 64];
    const float* sr[kMaxMT * 64];
    const int8_t* qr[kMaxMT * 64];
    const float* qsr[kMaxMT * 64];
    float* orow[kMaxMT * 64];
    float tmp[kMaxMT * 64][16];
    // Phase 1: gate+up tiles, SiLU(gate) * up into H.
#pragma omp for schedule(dynamic, 8)
    for (int64_t it = 0; it < n1; ++it) {
      const int64_t e = active[it / P.i8], tile = it % P.i8;
      for (int64_t r0 = count[e]; r0 < count[e + 1]; r0 += kMaxMT * 64) {
        const int n = (int)std::min<int64_t>(kMaxMT * 64, count[e + 1] - r0);
        for (int i = 0; i < n; ++i) {
          const int64_t t = src_token[r0 + i];
          xr[i] = &xp[t * hp];
          sr[i] = need_xs ? &xs[t * ngh] : nullptr;
          qr[i] = need_xs ? &xq[t * hp] : nullptr;
          qsr[i] = need_xs ? &xqs[t * ngh] : nullptr;
          orow[i] = tmp[i];
        }
        // experts are contiguous runs of tiles: global tile = e * i8 + tile
        if constexpr (FMT == INT4 || FMT == INT4A) tile_rows_w4a8<FMT, 2>(P.gu, e * P.i8 + tile, qr, sr, qsr, orow, n);
        else tile_rows<FMT, 2>(P.gu, e * P.i8 + tile, xr, sr, orow, n);
        for (int i = 0; i < n; ++i) {
          float* hrow = &hb[(r0 + i) * hbuf + tile * 8];
          for (int c = 0; c < 8; ++c) hrow[c] = silu(tmp[i][c]) * tmp[i][8 + c];
        }
      }
    }
    // Padding columns (tiles past I produce silu(0)*0 = 0; columns past i8*8 stay 0); group sums.
    if (need_xs) {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < S; ++r) group_sums(&hb[r * hbuf], ip, P.gs, &hs[r * ngi]);
    }
    // Phase 2: down tiles into Y.
#pragma omp for schedule(dynamic, 8)
    for (int64_t it = 0; it < n2; ++it) {
      const int64_t e = active[it / P.h8], tile = it % P.h8;
      for (int64_t r0 = count[e]; r0 < count[e + 1]; r0 += kMaxMT * 64) {
        const int n = (int)std::min<int64_t>(kMaxMT * 64, count[e + 1] - r0);
        for (int i = 0; i < n; ++i) {
          xr[i] = &hb[(r0 + i) * hbuf];
          sr[i] = need_xs ? &hs[(r0 + i) * ngi] : nullptr;
          orow[i] = &y[(r0 + i) * ldy + tile * 8];
        }
        tile_rows<FMT, 1>(P.dn, e * P.h8 + tile, xr, sr, orow, n);
      }
    }
    // Phase 3: out[t] = sum over slots in slot order of weight * Y[row(t, slot)].
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      float* o = out + t * ldy;
      for (int64_t c = 0; c < ldy; c += 8) {
        V8 acc = v_zero();
        for (int64_t s = 0; s < K; ++s) {
          const int64_t r = row_of[t * K + s];
          if (r >= 0) acc = v_fma(v_set1(wts[t * K + s]), v_load(&y[r * ldy + c]), acc);
        }
        v_store(o + c, acc);
      }
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// Returns 0 on success, -1 if an expert id is out of range, -2 for an unknown format.
// x [T, H] fp32; ids [T, K] int64 (-1 = skip); wts [T, K] fp32; out [T, ceil(H/8)*8] fp32.
int moegate_fused_moe(const float* x, const int64_t* ids, const float* wts, float* out, int64_t T, int64_t K,
                      int64_t fmt, int64_t E, int64_t H, int64_t I, int64_t gs, const void* gu_w,
                      const uint16_t* gu_s, const uint16_t* gu_m, const void* dn_w, const uint16_t* dn_s,
                      const uint16_t* dn_m, int nthreads) {
  Problem P;
  P.T = T; P.K = K; P.E = E; P.H = H; P.I = I; P.gs = gs;
  P.h8 = (H + 7) / 8; P.i8 = (I + 7) / 8;
  const bool quant = fmt >= INT8;
  P.hp = quant ? (H + gs - 1) / gs * gs : H;
  P.ip = quant ? (I + gs - 1) / gs * gs : I;
  P.hbuf = std::max(P.ip, P.i8 * 8);
  P.gu = Mat{gu_w, gu_s, gu_m, P.hp, gs};
  P.dn = Mat{dn_w, dn_s, dn_m, P.ip, gs};
  if (nthreads < 1) nthreads = 1;
  switch (fmt) {
    case FP32: return run<FP32>(P, x, ids, wts, out, nthreads);
    case BF16: return run<BF16>(P, x, ids, wts, out, nthreads);
    case INT8: return run<INT8>(P, x, ids, wts, out, nthreads);
    case INT4: return run<INT4>(P, x, ids, wts, out, nthreads);
    case INT4A: return run<INT4A>(P, x, ids, wts, out, nthreads);
    default: return -2;
  }
}

int moegate_is_avx2() {
#ifdef MOEGATE_AVX2
  return 1;
#else
  return 0;
#endif
}

// STREAM triad a = b + s * c over n floats; returns seconds of the best of `reps` runs.
double moegate_stream_triad(float* a, const float* b, const float* c, int64_t n, int reps, int nthreads) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    double t0 = omp_get_wtime();
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < n; ++i) a[i] = b[i] + 3.0f * c[i];
    double dt = omp_get_wtime() - t0;
    if (dt < best) best = dt;
  }
  return best;
}

}  // extern "C"
