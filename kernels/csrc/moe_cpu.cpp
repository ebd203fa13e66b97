// Fused routed-expert MoE for CPU: gate+up -> SiLU(gate)*up -> down, weighted sum per token. Optional
// per-expert biases (gate_up [E][2][I8*8] and down [E][H8*8] fp32, zero-padded) and GPT-OSS's clamped
// SwiGLU ((clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)) are chosen at run
// time (Act); padding rows stay 0 under both activations.
//
// Compiled three ways by kernels/build.py: avx512 (the AVX2 path, with the int4 W4A8 projections on
// 512-bit AVX-512 VNNI vpdpbusd, 16 output rows x up to 8 tokens per weight block: w4a8_zmm.h; fp32,
// bf16 and int8 weights on zmm fp32 FMA, 16 output rows x up to 15 tokens per weight vector: fp_zmm.h), avx2
// (AVX2 + FMA + F16C intrinsics) and generic (plain loops the compiler may auto-vectorize). Always -ffp-contract=off so each output row's arithmetic is a fixed sequence of
// operations: a row's result does not depend on which other rows share the batch, on thread count,
// or on scheduling. Threads: work_pool.h (tiles
// of active experts are claimed dynamically; OpenMP is used only by the STREAM triad helper).
//
// Weight layout (see kernels/formats.py): a projection [N, K] is cut into tiles of 8 output rows;
// gate_up tiles hold 8 gate rows and the matching 8 up rows (R8 = 2), down tiles 8 rows (R8 = 1).
// Inside a tile, for each k (int4: each block of 8 k) the R8 * 8 rows are contiguous, so the
// inner loop streams one contiguous block per tile and needs no horizontal reductions.
// Quantized formats: per (row, group of gs along K) an fp16 scale s (and for int4_asym an fp16
// min m); w = q * s (int8), w = (u - 8) * s (int4), w = u * s + m (int4_asym), u in [0, 15].
// int4 tiles hold blocks of 8 k: per row one dword whose nibble 2c is k0 + c and nibble 2c+1 is
// k0 + 4 + c (c = 0..3). The int4 gate_up projection is W4A8: the layer input is quantized per
// token and group to int8 (symmetric, round half to even), integer dot products (maddubs, vpdpbusd)
// are exact, and the group result is s*sx*(sum(u*q) - 8*sum(q)) (int4; the difference is an exact fp32
// integer) or s*sx*sum(u*q) + m*sx*sum(q) (int4_asym, m the group min). The int4 down projection is W4A8
// too (its input quantized the same way); int8_a8 is W8A8 on both projections (w8a8.h); fp32 / bf16 / int8
// use fp32 activations with weights dequantized in registers.

#include <omp.h>

#include "paths.h"
#include "scratch.h"
#include "simd.h"
#include "work_pool.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace {

enum Fmt { FP32 = 0, BF16 = 1, INT8 = 2, INT4 = 3, INT4A = 4, BF16A = 5, I8A8 = 6 };  // bf16_a16, int8_a8
inline bool is_quantized(int64_t fmt) { return fmt == INT8 || fmt == INT4 || fmt == INT4A || fmt == I8A8; }
// Bytes of n weights in a format (scales aside): what a job streams, for WorkPool's threads_for.
inline int64_t weight_bytes(int64_t fmt, int64_t n) {
  return fmt == FP32 ? 4 * n : fmt == BF16 || fmt == BF16A ? 2 * n : fmt == INT4 || fmt == INT4A ? n / 2 : n;
}

// fp32 -> the nearest bf16 value (round half to even; NaN kept), as torch's .to(torch.bfloat16).
inline float round_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) <= 0x7f800000u) u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&f, &u, 4);
  return f;
}

// bf16_a16 activations: x[0 .. k) rounded to bf16 in place; with `bits` also their bf16 bit patterns
// (bits[0 .. k rounded up to even), the padding zero) for the vdpbf16ps path.
inline void round_row_bf16(float* x, int64_t k, uint16_t* bits) {
  for (int64_t i = 0; i < k; ++i) {
    x[i] = round_bf16(x[i]);
    if (bits) {
      uint32_t u;
      std::memcpy(&u, &x[i], 4);
      bits[i] = (uint16_t)(u >> 16);
    }
  }
  if (bits && (k & 1)) bits[k] = 0;
}

// One tiled projection of one expert.
struct Mat {
  const void* w;
  const uint16_t* scales;  // fp16 [n8][kp / gs][R8][8]; null for fp32 / bf16
  const uint16_t* mins;    // fp16, int4_asym only
  int64_t kp;              // padded K
  int64_t gs;              // group size along K (quantized formats)
};

// Software prefetch of a weight stream kPrefetch bytes ahead of the bytes [p, p + n) being read, one
// per cache line. The hardware prefetchers alone left each core latency-bound (int4 M = 1 at 2 threads:
// 16 -> 21 GB/s; 1 KiB and 4 KiB ahead measured a little slower, 8 KiB slower still).
constexpr int64_t kPrefetch = 2048;
inline void prefetch_ahead(const void* p, int64_t n) {
  const char* c = static_cast<const char*>(p) + kPrefetch;
  for (int64_t off = 0; off < n; off += 64) __builtin_prefetch(c + off, 0, 3);
}

// out[m][0 .. R8*8) = tile rows . X[m] for MT activation rows (fp32, bf16, int8 weights). Even and
// odd k accumulate in separate registers (two fma dependency chains, summed at the end / per group):
// a fixed order for every row whatever MT is, so a row's result never depends on its batch.
template <int FMT, int R8, int MT>
void tile_dot(const Mat& A, int64_t tile, const float* const* X, float* const* out) {
  V8 acc[2][MT][R8];
  for (int p = 0; p < 2; ++p)
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < R8; ++r) acc[p][m][r] = v_zero();
  const int64_t kp = A.kp;
  if constexpr (FMT == FP32 || FMT == BF16 || FMT == BF16A) {
    using T = std::conditional_t<FMT == FP32, float, uint16_t>;
    const T* w = static_cast<const T*>(A.w) + tile * kp * R8 * 8;
    auto step = [&](int64_t k, V8 (*a)[R8]) {
      V8 wv[R8];
      for (int r = 0; r < R8; ++r) {
        if constexpr (FMT == FP32) wv[r] = v_load(w + (k * R8 + r) * 8);
        else wv[r] = load_bf16(w + (k * R8 + r) * 8);
      }
      for (int m = 0; m < MT; ++m) {
        V8 xb = v_bcast(X[m] + k);
        for (int r = 0; r < R8; ++r) a[m][r] = v_fma(wv[r], xb, a[m][r]);
      }
    };
    int64_t k = 0;
    for (; k + 2 <= kp; k += 2) {
      step(k, acc[0]);
      step(k + 1, acc[1]);
    }
    if (k < kp) step(k, acc[0]);
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < R8; ++r) acc[0][m][r] = v_add(acc[0][m][r], acc[1][m][r]);
  } else {
    static_assert(FMT == INT8, "int4 formats use tile_dot_w4a8");
    const int64_t gs = A.gs, ng = kp / gs;  // gs is even (kernels/formats.py)
    const uint16_t* sc = A.scales + tile * ng * R8 * 8;
    const int8_t* w8 = static_cast<const int8_t*>(A.w) + tile * kp * R8 * 8;
    for (int64_t g = 0; g < ng; ++g) {
      prefetch_ahead(w8 + g * gs * R8 * 8, gs * R8 * 8);
      V8 (*gacc)[R8] = acc[1];  // the group's partial sums (even k here, odd k in `odd`)
      V8 odd[MT][R8];
      for (int m = 0; m < MT; ++m)
        for (int r = 0; r < R8; ++r) gacc[m][r] = odd[m][r] = v_zero();
      for (int64_t k = g * gs; k < (g + 1) * gs; k += 2) {
        V8 we[R8], wo[R8];
        for (int r = 0; r < R8; ++r) {
          we[r] = load_i8(w8 + (k * R8 + r) * 8);
          wo[r] = load_i8(w8 + ((k + 1) * R8 + r) * 8);
        }
        for (int m = 0; m < MT; ++m) {
          V8 xe = v_bcast(X[m] + k), xo = v_bcast(X[m] + k + 1);
          for (int r = 0; r < R8; ++r) {
            gacc[m][r] = v_fma(we[r], xe, gacc[m][r]);
            odd[m][r] = v_fma(wo[r], xo, odd[m][r]);
          }
        }
      }
      for (int r = 0; r < R8; ++r) {
        V8 sv = load_f16(sc + (g * R8 + r) * 8);
        for (int m = 0; m < MT; ++m) acc[0][m][r] = v_fma(sv, v_add(gacc[m][r], odd[m][r]), acc[0][m][r]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R8; ++r) v_store(out[m] + r * 8, acc[0][m][r]);
}

// W4A8 (avx2, generic): out[m] = tile rows . dequant(q[m]) with q[m] int8 activations, sx[m] / qs[m]
// per-group activation scales and sums of q (as float). Integer partial sums are split over S
// accumulator sets (k-block parity when few rows leave the core idle) and added exactly.
template <int FMT, int R8, int MT>
void tile_dot_w4a8(const Mat& A, int64_t tile, const int8_t* const* q, const float* const* sx,
                   const float* const* qs, float* const* out) {
  constexpr int S = MT * R8 <= 2 ? 2 : 1;  // accumulator sets
  V8 acc[MT][R8];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R8; ++r) acc[m][r] = v_zero();
  const int64_t kp = A.kp, gs = A.gs, ng = kp / gs;
  const uint16_t* sc = A.scales + tile * ng * R8 * 8;
  const uint16_t* mn = FMT == INT4A ? A.mins + tile * ng * R8 * 8 : nullptr;
  const uint8_t* w4 = static_cast<const uint8_t*>(A.w) + tile * (kp / 8) * R8 * 32;
  for (int64_t g = 0; g < ng; ++g) {
    I8 isum[S][MT][R8];
    for (int p = 0; p < S; ++p)
      for (int m = 0; m < MT; ++m)
        for (int r = 0; r < R8; ++r) isum[p][m][r] = i_zero();
    // S blocks per step, block p into accumulator set p: the set index is a compile-time constant,
    // so the sums stay in registers (a set chosen at run time by kb parity spilled them to the stack).
    const int64_t kb1 = (g + 1) * gs / 8;
    int64_t kb = g * gs / 8;
    for (; kb + S <= kb1; kb += S) {
      prefetch_ahead(w4 + kb * R8 * 32, S * R8 * 32);
#pragma GCC unroll 2
      for (int p = 0; p < S; ++p) {
        U4 b[R8];
        for (int r = 0; r < R8; ++r) b[r] = load_u4(w4 + ((kb + p) * R8 + r) * 32);
        w4a8_block<R8, MT>(b, q, (kb + p) * 8, isum[p]);
      }
    }
    for (; kb < kb1; ++kb) {
      U4 b[R8];
      for (int r = 0; r < R8; ++r) b[r] = load_u4(w4 + (kb * R8 + r) * 32);
      w4a8_block<R8, MT>(b, q, kb * 8, isum[0]);
    }
    for (int p = 1; p < S; ++p)
      for (int m = 0; m < MT; ++m)
        for (int r = 0; r < R8; ++r) isum[0][m][r] = i_add(isum[0][m][r], isum[p][m][r]);
    for (int r = 0; r < R8; ++r) {
      V8 s = load_f16(sc + (g * R8 + r) * 8);
      if constexpr (FMT == INT4) {  // symmetric: s*sx*(sum(u q) - 8 sum(q)), the difference exact in fp32
        for (int m = 0; m < MT; ++m) {
          V8 d = v_sub(i_cvt(isum[0][m][r]), v_mul(v_set1(8.f), v_bcast(qs[m] + g)));
          acc[m][r] = v_fma_exact(v_mul(s, v_bcast(sx[m] + g)), d, acc[m][r]);
        }
      } else {
        V8 b = load_f16(mn + (g * R8 + r) * 8);
        for (int m = 0; m < MT; ++m) {
          V8 sxv = v_bcast(sx[m] + g);
          acc[m][r] = v_fma_exact(v_mul(s, sxv), i_cvt(isum[0][m][r]), acc[m][r]);
          acc[m][r] = v_fma_exact(v_mul(b, sxv), v_bcast(qs[m] + g), acc[m][r]);
        }
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

// Rows rows[0..n) of one expert through one tile, in chunks of up to kMaxMT activation rows.
// (fp32 activations: at most 2 rows at a time for gate_up tiles, so the 2 x MT x R8 accumulators fit
// in registers; the grouping of rows does not change any row's arithmetic.)
template <int FMT, int R8>
void tile_rows(const Mat& A, int64_t tile, const float* const* X, float* const* out, int n) {
  int i = 0;
  if constexpr (R8 == 1) {
    for (; i + 4 <= n; i += 4) tile_dot<FMT, R8, 4>(A, tile, X + i, out + i);
    if (n - i == 3) { tile_dot<FMT, R8, 3>(A, tile, X + i, out + i); return; }
  }
  for (; i + 2 <= n; i += 2) tile_dot<FMT, R8, 2>(A, tile, X + i, out + i);
  if (i < n) tile_dot<FMT, R8, 1>(A, tile, X + i, out + i);
}

// Symmetric per-group int8 quantization of a padded row: s = amax / 127, q = round_half_even(x / s);
// per group sx = s, qs = sum(q) as float and n8 = -8 * sum(q) (the int4 correction, as an integer).
// The AVX2 loop (gs is a multiple of 8 for int4 formats) computes the same bits as the plain one: max is
// exact, division and round-to-nearest-even are IEEE, the sums are integers.
#ifdef MOEGATE_ZMM
// quantize_row on zmm (gs a multiple of 16): the AVX2 loop's operations, 16 values per step where the order
// cannot matter. Every group's scale first, then the groups' quantization: one group's chain (max, scale,
// division, rounding) no longer waits for the one before it: 3.1 -> 1.6 cycles per value on one core at gs 32.
void quantize_row_zmm(const float* x, int64_t kp, int64_t gs, int8_t* q, float* sx, float* qs, int32_t* n8) {
  const int64_t ng = kp / gs;
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t g = 0; g < ng; ++g) {
    __m256 mx = _mm256_setzero_ps();
    for (int64_t k = g * gs; k < (g + 1) * gs; k += 8)
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
    // The AVX2 loop's scalar std::max skips NaN lanes: max(lane, 0) drops them too (vmaxps returns its second
    // operand when one is NaN), and the max of the rest, all >= 0, is the same in any order.
    mx = _mm256_max_ps(mx, _mm256_setzero_ps());
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    sx[g] = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))) / 127.f;
  }
  const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (int64_t g = 0; g < ng; ++g) {
    const float s = sx[g];
    const __m512 sv = _mm512_set1_ps(s);
    __m512i acc = _mm512_setzero_si512();
    for (int64_t k = g * gs; k < (g + 1) * gs; k += 16) {
      __m512 v = _mm512_setzero_ps();
      if (s > 0.f) {
        v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + k), sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(hi, _mm512_max_ps(lo, v));
      }
      const __m512i i32 = _mm512_cvtps_epi32(v);
      acc = _mm512_add_epi32(acc, i32);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtsepi32_epi8(i32));  // packs' saturation
    }
    const int32_t sum = _mm512_reduce_add_epi32(acc);
    qs[g] = (float)sum;
    n8[g] = -8 * sum;
  }
}
#endif

void quantize_row(const float* x, int64_t kp, int64_t gs, int8_t* q, float* sx, float* qs, int32_t* n8) {
#ifdef MOEGATE_ZMM
  if (gs % 16 == 0) return quantize_row_zmm(x, kp, gs, q, sx, qs, n8);
#endif
  for (int64_t g = 0; g < kp / gs; ++g) {
    const int64_t k0 = g * gs, k1 = (g + 1) * gs;
    float amax = 0.f;
    int32_t sum = 0;
#ifdef MOEGATE_AVX2
    if (gs % 8 == 0) {
      const __m256 sign = _mm256_set1_ps(-0.f);
      __m256 mx = _mm256_setzero_ps();
      for (int64_t k = k0; k < k1; k += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
      float lanes[8];
      _mm256_storeu_ps(lanes, mx);
      for (float v : lanes) amax = std::max(amax, v);
      const float s = amax / 127.f;
      const __m256 sv = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
      __m256i acc = _mm256_setzero_si256();
      for (int64_t k = k0; k < k1; k += 8) {
        __m256 v = _mm256_setzero_ps();
        if (s > 0.f) {
          v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + k), sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          v = _mm256_min_ps(hi, _mm256_max_ps(lo, v));
        }
        const __m256i i32 = _mm256_cvtps_epi32(v);
        acc = _mm256_add_epi32(acc, i32);
        const __m128i p16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_packs_epi16(p16, p16));
      }
      int32_t part[8];
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(part), acc);
      for (int32_t v : part) sum += v;
      sx[g] = s;
      qs[g] = (float)sum;
      n8[g] = -8 * sum;
      continue;
    }
#endif
    for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(x[k]));
    const float s = amax / 127.f;
    for (int64_t k = k0; k < k1; ++k) {
      const float v = s > 0.f ? std::nearbyint(x[k] / s) : 0.f;
      q[k] = (int8_t)std::min(127.f, std::max(-127.f, v));
      sum += q[k];
    }
    sx[g] = s;
    qs[g] = (float)sum;
    n8[g] = -8 * sum;
  }
}

constexpr int kMaxMT = 4;

}  // namespace

#include "w4a8_zmm.h"
#include "bf16_zmm.h"
#include "amx_bf16.h"
#include "fp_zmm.h"
#include "w8a8.h"
#include "amx_int8.h"

namespace {

#ifdef MOEGATE_ZMM
constexpr bool kZmm = true;
#else
constexpr bool kZmm = false;
// Never called: name the zmm entry points for the `if constexpr` branches of builds without them.
template <int FMT, int R8>
void zmm_unit_rows(const Mat&, int64_t, int64_t, int64_t, const ZmmActs&, float* const*, int) {}
template <int R8>
void zmm_bf16_unit_rows(const Mat&, int64_t, int64_t, int64_t, const uint16_t* const*, float* const*, int) {}
template <int R8>
void amx_bf16_unit_rows(const Mat&, int64_t, int64_t, int64_t, const uint16_t*, int64_t, float*, int64_t, int) {}
inline int64_t amx_bf16_kp(int64_t kp) { return kp; }
inline bool amx_bf16_used() { return false; }
template <int FMT, int R8>
void zmm_fp_unit_rows(const Mat&, int64_t, int64_t, int64_t, const float* const*, float* const*, int) {}
template <int FMT, int R8>
void zmm_fp_unit_chunks(const Mat&, int64_t, int64_t, int64_t, const FpActs&, float* const*, int) {}
template <int FMT, int R8>
void amx_unit_rows(const Mat&, int64_t, int64_t, int64_t, const AmxActs&, float*, int64_t, int64_t) {}
inline bool cpu_has_bf16_dot() { return false; }
#endif

}  // namespace

#include "activation.h"
#include "race_noise.h"  // (run_linear's race in the lm_head)

namespace {

// Threads for the activation preparation of a kernel call (padded copies, int8 quantization, interleaving) over
// `floats` activation values: the caller alone below ~32 rows of 1024 (waking a helper costs more than the work).
inline int prep_threads(int64_t floats, int nthreads) { return floats >= (int64_t(1) << 15) ? std::max(nthreads, 1) : 1; }

struct Problem {
  int64_t T, K, E, H, I, gs, h8, i8, hp, ip, hbuf;
  Mat gu, dn;
  const float* gu_bias = nullptr;  // [E][2][i8 * 8] or null
  const float* dn_bias = nullptr;  // [E][h8 * 8] or null
  Act act;
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
  constexpr bool w4a8 = FMT == INT4 || FMT == INT4A || FMT == I8A8;  // int8 activations (W4A8, W8A8)
  const int64_t hp = P.hp, ip = P.ip, hbuf = P.hbuf, ldy = P.h8 * 8;
  const int64_t ngh = w4a8 ? hp / P.gs : 0, ngi = w4a8 ? ip / P.gs : 0;
  // Padded copies: per token X [T, hp], per row H [S, hbuf], Y [S, h8*8]; for W4A8 also the int8
  // activations with their per-group scales and sums (xq / xsx / xqs, hq / hsx / hqs), and on zmm the
  // same per sorted row, interleaved per expert (xi: expert e's rows from row count[e]; hi likewise).
  // All of it from this thread's scratch (scratch.h); hb's columns past the gate_up tiles are zeroed.
  constexpr bool zmm = w4a8 && kZmm;
  constexpr bool interleave = zmm && FMT != I8A8;  // w4a8_zmm.h's ZmmActs (w8a8.h reads rows by pointer)
  moegate::Scratch& scratch = moegate::Scratch::local();
  scratch.reset();
  float* xp = scratch.take<float>(T * hp);
  float* hb = scratch.take<float>(S * hbuf + 1);
  float* y = scratch.take<float>(S * ldy + 1);
  for (int64_t r = 0; r < S; ++r) std::fill(hb + r * hbuf + P.i8 * 8, hb + (r + 1) * hbuf, 0.f);
  int8_t* xq = scratch.take<int8_t>(w4a8 ? T * hp : 1);
  int8_t* hq = scratch.take<int8_t>(w4a8 ? S * hbuf : 1);
  float* xsx = scratch.take<float>(T * ngh);
  float* xqs = scratch.take<float>(T * ngh);
  float* hsx = scratch.take<float>(S * ngi);
  float* hqs = scratch.take<float>(S * ngi);
  int32_t* xn8 = scratch.take<int32_t>(T * ngh);
  int32_t* hn8 = scratch.take<int32_t>(S * ngi);
  auto interleaved = [&](int64_t kp, int64_t ng) {
    const int64_t n = interleave ? S : 0;
    return ZmmActs{scratch.take<int8_t>(n * kp), scratch.take<float>(n * ng), scratch.take<float>(n * ng),
                   scratch.take<int32_t>(n * ng), kp, ng};
  };
  const ZmmActs xi = interleaved(hp, ngh), hi = interleaved(ip, ngi);
  // AMX int8 tiles (amx_int8.h) for experts with amx_int8_rows rows: their layer input rows gathered per sorted
  // row (xg / xgsx / xgqs; the down input hq already is).
  const bool amx = zmm && moegate::amx_int8_here();
  const int64_t amx_rows = amx ? amx_min_rows(FMT).load(std::memory_order_relaxed) : 0;  // read once per call
  auto amx_e = [&](int64_t e) { return amx && count[e + 1] - count[e] >= amx_rows; };
  int8_t* xg = scratch.take<int8_t>(amx ? S * hp : 0);
  float* xgsx = scratch.take<float>(amx ? S * ngh : 0);
  float* xgqs = scratch.take<float>(amx ? S * ngh : 0);
  // bf16_a16: activations rounded to bf16 (both projections' inputs); on AMX tdpbf16ps (amx_bf16.h) or
  // vdpbf16ps also as bf16 bits (xbits / hbits, rows of even length; on AMX hbits rows and the per sorted row
  // copies xa of xbits whole 32-k chunks, zero-padded).
  const bool amx16 = FMT == BF16A && kZmm && amx_bf16_used();
  const bool dot16 = FMT == BF16A && !amx16 && cpu_has_bf16_dot(), bits16 = amx16 || dot16;
  // fp32 activations on zmm FMA (fp_zmm.h); experts with more than kSequentialRows rows read theirs
  // interleaved (FpActs: xf per sorted row from row count[e], hf likewise).
  const bool fpz = kZmm && !w4a8 && !bits16;
  const FpActs xf{scratch.take<float>(fpz ? S * hp : 0), hp}, hf{scratch.take<float>(fpz ? S * ip : 0), ip};
  auto many = [&](int64_t e) { return fpz && count[e + 1] - count[e] > kSequentialRows; };
  const int64_t xbl = hp + (hp & 1), hbl = amx16 ? amx_bf16_kp(ip) : hbuf + 1, kah = amx_bf16_kp(hp);
  std::vector<uint16_t> xbits(bits16 ? T * xbl : 1), hbits(bits16 ? S * hbl : 1);
  uint16_t* xa = scratch.take<uint16_t>(amx16 ? S * kah : 0);
  auto& pool = moegate::WorkPool::instance();
  // The activations' copies, quantization and interleaving: token rows, then experts, over the pool at prefill
  // sizes (each row's bytes are the same whatever thread writes them).
  const int prep = prep_threads(T * hp, nthreads);
  pool.parallel_for(T, 4, prep, [&](int64_t t) {
    std::memcpy(&xp[t * hp], x + t * P.H, sizeof(float) * P.H);
    std::fill(xp + t * hp + P.H, xp + (t + 1) * hp, 0.f);
    if (w4a8) quantize_row(&xp[t * hp], hp, P.gs, &xq[t * hp], &xsx[t * ngh], &xqs[t * ngh], &xn8[t * ngh]);
    if (FMT == BF16A) round_row_bf16(&xp[t * hp], hp, bits16 ? &xbits[t * xbl] : nullptr);
  });
  pool.parallel_for(E, 1, interleave || fpz || amx || amx16 ? prep : 1, [&](int64_t e) {
    if (amx16)
      for (int64_t r = count[e]; r < count[e + 1]; ++r) {
        std::memcpy(&xa[r * kah], &xbits[src_token[r] * xbl], sizeof(uint16_t) * xbl);
        std::fill(&xa[r * kah] + xbl, &xa[(r + 1) * kah], uint16_t(0));
      }
    if (amx_e(e))
      for (int64_t r = count[e]; r < count[e + 1]; ++r) {
        const int64_t t = src_token[r];
        std::memcpy(&xg[r * hp], &xq[t * hp], hp);
        std::memcpy(&xgsx[r * ngh], &xsx[t * ngh], sizeof(float) * ngh);
        std::memcpy(&xgqs[r * ngh], &xqs[t * ngh], sizeof(float) * ngh);
      }
    else if constexpr (interleave)
      for (int64_t r = count[e]; r < count[e + 1]; ++r) {
        const int64_t t = src_token[r];
        xi.rows(count[e]).put(r - count[e], count[e + 1] - count[e], &xq[t * hp], &xsx[t * ngh], &xqs[t * ngh],
                              &xn8[t * ngh]);
      }
    if (many(e))
      for (int64_t r = count[e]; r < count[e + 1]; ++r)
        xf.rows(count[e]).put(r - count[e], count[e + 1] - count[e], &xp[src_token[r] * hp]);
  });
  // On zmm (W4A8, and bf16_a16 on AMX or vdpbf16ps) a down item is a unit of two 8-row tiles (w4a8_zmm.h),
  // a gate_up item one 16-row tile.
  const bool units = zmm || bits16 || fpz;
  const int64_t dn_items = units ? (P.h8 + 1) / 2 : P.h8;
  const int64_t n1 = na * P.i8, n2 = na * dn_items;
  // One job: items [0, n1) are gate_up tiles, [n1, n1 + n2) down tiles. A down item of expert e
  // waits until every gate_up item of e is done (they were all claimed earlier, so this terminates).
  std::unique_ptr<std::atomic<int64_t>[]> p1_left(new std::atomic<int64_t>[na]);
  std::unique_ptr<std::atomic<int>[]> ready(new std::atomic<int>[na]);
  for (int64_t a = 0; a < na; ++a) {
    p1_left[a].store(P.i8, std::memory_order_relaxed);
    ready[a].store(0, std::memory_order_relaxed);
  }
  constexpr int kRows = kMaxMT * 64;
  static_assert(kRows % kFpSegment == 0, "a block of rows holds whole FpActs segments");
  auto gate_up_item = [&](int64_t it) {
    const int64_t a = it / P.i8, e = active[a], tile = it % P.i8;
    const float* xr[kRows];
    const int8_t* qr[kRows];
    const float* sxr[kRows];
    const float* qsr[kRows];
    const int32_t* n8r[kRows];
    const uint16_t* br[kRows];
    float* orow[kRows];
    float tmp[kRows][16];
    for (int64_t r0 = count[e]; r0 < count[e + 1]; r0 += kRows) {
      const int n = (int)std::min<int64_t>(kRows, count[e + 1] - r0);
      for (int i = 0; i < n; ++i) {
        const int64_t t = src_token[r0 + i];
        xr[i] = &xp[t * hp];
        qr[i] = &xq[w4a8 ? t * hp : 0];
        sxr[i] = &xsx[t * ngh];
        qsr[i] = &xqs[t * ngh];
        n8r[i] = &xn8[t * ngh];
        br[i] = &xbits[dot16 ? t * xbl : 0];
        orow[i] = tmp[i];
      }
      // experts are contiguous runs of tiles: global tile = e * i8 + tile
      if (amx16) amx_bf16_unit_rows<2>(P.gu, e * P.i8, tile, P.i8, &xa[r0 * kah], kah, tmp[0], 16, n);
      else if (dot16) zmm_bf16_unit_rows<2>(P.gu, e * P.i8, tile, P.i8, br, orow, n);
      else if (amx_e(e))
        amx_unit_rows<FMT, 2>(P.gu, e * P.i8, tile, P.i8,
                              AmxActs{xg + r0 * hp, hp, xgsx + r0 * ngh, xgqs + r0 * ngh, ngh}, tmp[0], 16, n);
      else if constexpr (FMT == I8A8) w8a8_rows<2>(P.gu, e * P.i8, tile, P.i8, qr, sxr, qsr, orow, n);
      else if constexpr (zmm) zmm_unit_rows<FMT, 2>(P.gu, e * P.i8, tile, P.i8, xi.rows(r0), orow, n);
      else if constexpr (w4a8) tile_rows_w4a8<FMT, 2>(P.gu, e * P.i8 + tile, qr, sxr, qsr, orow, n);
      else if (many(e)) zmm_fp_unit_chunks<FMT, 2>(P.gu, e * P.i8, tile, P.i8, xf.rows(r0), orow, n);
      else if (fpz) zmm_fp_unit_rows<FMT, 2>(P.gu, e * P.i8, tile, P.i8, xr, orow, n);
      else tile_rows<FMT, 2>(P.gu, e * P.i8 + tile, xr, orow, n);
      const float* gb = P.gu_bias ? P.gu_bias + e * 2 * P.i8 * 8 + tile * 8 : nullptr;  // gate; up at + i8*8
      for (int i = 0; i < n; ++i) {
        V8 g = v_load(tmp[i]), u = v_load(tmp[i] + 8);
        if (gb) {
          g = v_add(g, v_load(gb));
          u = v_add(u, v_load(gb + P.i8 * 8));
        }
        v_store(&hb[(r0 + i) * hbuf + tile * 8], P.act(g, u));
      }
    }
    if (p1_left[a].fetch_sub(1, std::memory_order_acq_rel) == 1) {
      // Last gate_up tile of e: its H rows are complete (padding tiles give silu(0)*0 = 0, columns
      // past i8*8 stay 0). W4A8 down quantizes them once here.
      if constexpr (w4a8)
        for (int64_t r = count[e]; r < count[e + 1]; ++r) {
          quantize_row(&hb[r * hbuf], ip, P.gs, &hq[r * hbuf], &hsx[r * ngi], &hqs[r * ngi], &hn8[r * ngi]);
          if (interleave && !amx_e(e))
            hi.rows(count[e]).put(r - count[e], count[e + 1] - count[e], &hq[r * hbuf], &hsx[r * ngi],
                                  &hqs[r * ngi], &hn8[r * ngi]);
        }
      if constexpr (FMT == BF16A)
        for (int64_t r = count[e]; r < count[e + 1]; ++r) {
          round_row_bf16(&hb[r * hbuf], ip, bits16 ? &hbits[r * hbl] : nullptr);
          if (amx16) std::fill(&hbits[r * hbl + ip + (ip & 1)], &hbits[(r + 1) * hbl], uint16_t(0));
        }
      if (many(e))
        for (int64_t r = count[e]; r < count[e + 1]; ++r)
          hf.rows(count[e]).put(r - count[e], count[e + 1] - count[e], &hb[r * hbuf]);
      ready[a].store(1, std::memory_order_release);
    }
  };
  auto down_item = [&](int64_t it) {
    const int64_t a = it / dn_items, e = active[a], item = it % dn_items;
    const int64_t tile = units ? 2 * item : item;  // first tile of the item
    moegate::spin_until([&] { return ready[a].load(std::memory_order_acquire) != 0; });
    const float* xr[kRows];
    const int8_t* qr[kRows];
    const float* sxr[kRows];
    const float* qsr[kRows];
    const int32_t* n8r[kRows];
    const uint16_t* br[kRows];
    float* orow[kRows];
    for (int64_t r0 = count[e]; r0 < count[e + 1]; r0 += kRows) {
      const int n = (int)std::min<int64_t>(kRows, count[e + 1] - r0);
      for (int i = 0; i < n; ++i) {
        const int64_t r = r0 + i;
        xr[i] = &hb[r * hbuf];
        qr[i] = &hq[w4a8 ? r * hbuf : 0];
        sxr[i] = &hsx[r * ngi];
        qsr[i] = &hqs[r * ngi];
        n8r[i] = &hn8[r * ngi];
        br[i] = &hbits[dot16 ? r * hbl : 0];
        orow[i] = &y[r * ldy + tile * 8];
      }
      if (amx16)
        amx_bf16_unit_rows<1>(P.dn, e * P.h8, item, P.h8, &hbits[r0 * hbl], hbl, &y[r0 * ldy + tile * 8], ldy, n);
      else if (dot16) zmm_bf16_unit_rows<1>(P.dn, e * P.h8, item, P.h8, br, orow, n);
      else if (amx_e(e))
        amx_unit_rows<FMT, 1>(P.dn, e * P.h8, item, P.h8,
                              AmxActs{hq + r0 * hbuf, hbuf, hsx + r0 * ngi, hqs + r0 * ngi, ngi}, &y[r0 * ldy + tile * 8],
                              ldy, n);
      else if constexpr (FMT == I8A8) w8a8_rows<1>(P.dn, e * P.h8, item, P.h8, qr, sxr, qsr, orow, n);
      else if constexpr (zmm) zmm_unit_rows<FMT, 1>(P.dn, e * P.h8, item, P.h8, hi.rows(r0), orow, n);
      else if constexpr (w4a8) tile_rows_w4a8<FMT, 1>(P.dn, e * P.h8 + tile, qr, sxr, qsr, orow, n);
      else if (many(e)) zmm_fp_unit_chunks<FMT, 1>(P.dn, e * P.h8, item, P.h8, hf.rows(r0), orow, n);
      else if (fpz) zmm_fp_unit_rows<FMT, 1>(P.dn, e * P.h8, item, P.h8, xr, orow, n);
      else tile_rows<FMT, 1>(P.dn, e * P.h8 + tile, xr, orow, n);
    }
  };
  // ~16 claims per thread: a claim of a few tiles (~1 us at M = 1) made the shared counter's cache line
  // travel between cores for every few kilobytes of weights; 16 still balance the threads.
  const int64_t streamed = weight_bytes(FMT, na * (2 * P.i8 * 8 * hp + P.h8 * 8 * ip));
  const int threads = moegate::threads_for(streamed, nthreads);
  const int64_t chunk = std::max<int64_t>(1, (n1 + n2) / (16 * std::max(1, threads)));
  pool.parallel_for(n1 + n2, chunk, threads, [&](int64_t it) {
    if (it < n1) gate_up_item(it);
    else down_item(it - n1);
  });
  // out[t] = sum over slots in slot order of weight * (Y[row(t, slot)] + down bias of its expert).
  pool.parallel_for(T, 8, moegate::threads_for(4 * T * (K + 1) * ldy, nthreads), [&](int64_t t) {
    float* o = out + t * ldy;
    for (int64_t c = 0; c < ldy; c += 8) {
      V8 acc = v_zero();
      for (int64_t s = 0; s < K; ++s) {
        const int64_t r = row_of[t * K + s];
        if (r < 0) continue;
        V8 yv = v_load(&y[r * ldy + c]);
        if (P.dn_bias) yv = v_add(yv, v_load(P.dn_bias + ids[t * K + s] * ldy + c));
        acc = v_fma_exact(v_set1(wts[t * K + s]), yv, acc);
      }
      v_store(o + c, acc);
    }
  });
  return 0;
}

// The first largest of a row's values so far: the candidate (best, at) after the next n values, from column col.
// numpy's argmax: the first index of the max, a NaN counting as the max (the first NaN wins); at < 0: none yet.
// Whether any of v[0, n) is greater than best or NaN (not <= best): the block needs a look.
inline bool any_beats(const float* v, int64_t n, float best) {
#if defined(__AVX2__)
  if (n == 8 || n == 16) {  // a tile or a unit of two: one compare per 8 columns (NLE_UQ: true for NaN)
    const __m256 b = _mm256_set1_ps(best);
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v), b, _CMP_NLE_UQ));
    if (n == 16) mask |= _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + 8), b, _CMP_NLE_UQ));
    return mask != 0;
  }
#endif
  int beats = 0;
  for (int64_t i = 0; i < n; ++i) beats |= !(v[i] <= best);
  return beats != 0;
}

inline void first_max_update(const float* v, int64_t n, int64_t col, float& best, int64_t& at) {
  if (n <= 0 || (at >= 0 && best != best)) return;  // nothing to read, or a NaN already won
  if (at >= 0 && !any_beats(v, n, best)) return;
  for (int64_t i = 0; i < n; ++i) {
    const float f = v[i];
    if (f != f) {
      best = f;
      at = col + i;
      return;
    }
    if (at < 0 || f > best) {
      best = f;
      at = col + i;
    }
  }
}

// Dense y[M, N] = x[M, K] . W^T for one tiled projection (R8 = 1): the quantized dense layers of the
// exploration profile (attention projections, lm_head). Output tiles are claimed by the pool; each
// row's arithmetic is the same fixed sequence as in the MoE kernel, whatever M or the thread count.
// first_max (nullable, [M] int64): each row's first largest of its N real columns, as numpy's argmax of out[m, :N].
// Each claimed chunk of output tiles gets its own candidate per row, read from the columns its thread just wrote
// (hot in that core's cache); the caller combines the chunks' candidates in column order. race (with first_max):
// the rows it names race instead (race_span per chunk, race_merge in column order: moegate_race_sample's pick).
template <int FMT>
void run_linear(const Mat& A, const float* x, float* out, int64_t M, int64_t K, int64_t n8, int nthreads,
                int64_t N = 0, int64_t* first_max = nullptr, const HeadRace* race = nullptr) {
  constexpr bool w4a8 = FMT == INT4 || FMT == INT4A || FMT == I8A8;  // int8 activations (W4A8, W8A8)
  const int64_t kp = A.kp, ng = w4a8 ? kp / A.gs : 0, ldo = n8 * 8;
  constexpr bool zmm = w4a8 && kZmm;  // an item is a unit of two tiles (w4a8_zmm.h, bf16_zmm.h, fp_zmm.h)
  // AMX int8 tiles (amx_int8.h) from amx_int8_rows rows: the row-major int8 activations, not interleaved
  const bool amx = zmm && moegate::amx_int8_here() && amx_int8_rows(FMT, M);
  const bool interleave = zmm && FMT != I8A8 && !amx;
  // Padded copies, int8 activations and (zmm) their interleaved chunks from this thread's scratch.
  moegate::Scratch& scratch = moegate::Scratch::local();
  scratch.reset();
  const float* xrows = x;
  float* xp = scratch.take<float>(M * kp);
  const bool padded = kp != K || w4a8 || FMT == BF16A;  // padded copies (and int8 or bf16 activations)
  if (padded) xrows = xp;
  int8_t* xq = scratch.take<int8_t>(w4a8 ? M * kp : 1);
  float* xsx = scratch.take<float>(M * ng);
  float* xqs = scratch.take<float>(M * ng);
  int32_t* xn8 = scratch.take<int32_t>(M * ng);
  const int64_t nz = interleave ? M : 0;
  const ZmmActs xl{scratch.take<int8_t>(nz * kp), scratch.take<float>(nz * ng), scratch.take<float>(nz * ng),
                   scratch.take<int32_t>(nz * ng), kp, ng};
  // bf16_a16's bf16 bits (rows of even length; on AMX whole 32-k chunks, zero-padded)
  const bool amx16 = FMT == BF16A && kZmm && amx_bf16_used();
  const bool dot16 = FMT == BF16A && !amx16 && cpu_has_bf16_dot(), bits16 = amx16 || dot16;
  // fp32 activations on zmm FMA (fp_zmm.h): more than kSequentialRows rows interleaved (FpActs)
  const bool fpz = kZmm && !w4a8 && !bits16, many = fpz && M > kSequentialRows;
  const int64_t xbl = amx16 ? amx_bf16_kp(kp) : kp + (kp & 1);
  std::vector<uint16_t> xbits(bits16 ? M * xbl : 1);
  const FpActs xf{scratch.take<float>(many ? M * kp : 0), kp};
  // Each row's copy, int8 or bf16 activations and interleaved chunk: over the pool at prefill sizes (a row's
  // bytes are the same whatever thread writes them)
  moegate::WorkPool::instance().parallel_for(M, 4, prep_threads(M * kp, nthreads), [&](int64_t m) {
    if (padded) {
      std::memcpy(&xp[m * kp], x + m * K, sizeof(float) * K);
      std::fill(xp + m * kp + K, xp + (m + 1) * kp, 0.f);
    }
    if constexpr (w4a8) {
      quantize_row(&xp[m * kp], kp, A.gs, &xq[m * kp], &xsx[m * ng], &xqs[m * ng], &xn8[m * ng]);
      if (interleave) xl.put(m, M, &xq[m * kp], &xsx[m * ng], &xqs[m * ng], &xn8[m * ng]);
    }
    if constexpr (FMT == BF16A) {
      round_row_bf16(&xp[m * kp], kp, bits16 ? &xbits[m * xbl] : nullptr);
      if (amx16) std::fill(&xbits[m * xbl + kp + (kp & 1)], &xbits[(m + 1) * xbl], uint16_t(0));
    }
    if (many) xf.put(m, M, xrows + m * kp);
  });
  std::vector<const float*> xr(M);
  std::vector<const int8_t*> qr(M);
  std::vector<const float*> sxr(M), qsr(M);
  std::vector<const int32_t*> n8r(M);
  std::vector<const uint16_t*> br(M);
  for (int64_t m = 0; m < M; ++m) {
    xr[m] = xrows + m * kp;
    qr[m] = &xq[w4a8 ? m * kp : 0];
    sxr[m] = &xsx[m * ng];
    qsr[m] = &xqs[m * ng];
    n8r[m] = &xn8[m * ng];
    br[m] = &xbits[dot16 ? m * xbl : 0];
  }
  constexpr int kRows = kMaxMT * 16;
  static_assert(kRows % kFpSegment == 0, "a block of rows holds whole FpActs segments");
  const bool units = zmm || bits16 || fpz;
  const int64_t items = units ? (n8 + 1) / 2 : n8;
  // ~16 claims per thread, as in run(): few enough to keep the shared counter quiet, enough to balance
  const int threads = moegate::threads_for(weight_bytes(FMT, n8 * 8 * kp), nthreads);
  const int64_t chunk = std::max<int64_t>(1, items / (16 * std::max(1, threads)));
  // [chunks, M]: each chunk's candidate per row, a chunk's on cache lines of its own (no line shared by two threads)
  struct Cand {
    float best;
    int64_t at;
  };
  struct alignas(64) Line {
    Cand c[4];
  };
  const int64_t chunks = first_max ? (items + chunk - 1) / chunk : 0, lines = (M + 3) / 4;
  std::vector<Line> cands(chunks * lines);
  auto cand = [&](int64_t c, int64_t m) -> Cand& { return cands[c * lines + m / 4].c[m % 4]; };
  // The pool runs a claimed chunk's items in order on one thread: its columns are read once its last item is written
  // (read right behind each item's stores, the loads waited on them).
  moegate::WorkPool::instance().parallel_for(items, chunk, threads, [&](int64_t item) {
    const int64_t tile = units ? 2 * item : item;
    float* orow[kRows];
    if (amx16) amx_bf16_unit_rows<1>(A, 0, item, n8, xbits.data(), xbl, out + tile * 8, ldo, (int)M);
    if (amx) amx_unit_rows<FMT, 1>(A, 0, item, n8, AmxActs{xq, kp, xsx, xqs, ng}, out + tile * 8, ldo, M);
    for (int64_t m0 = 0; m0 < M && !amx16 && !amx; m0 += kRows) {
      const int n = (int)std::min<int64_t>(kRows, M - m0);
      for (int i = 0; i < n; ++i) orow[i] = out + (m0 + i) * ldo + tile * 8;
      if (dot16) zmm_bf16_unit_rows<1>(A, 0, item, n8, &br[m0], orow, n);
      else if constexpr (FMT == I8A8) w8a8_rows<1>(A, 0, item, n8, &qr[m0], &sxr[m0], &qsr[m0], orow, n);
      else if constexpr (zmm) zmm_unit_rows<FMT, 1>(A, 0, item, n8, xl.rows(m0), orow, n);
      else if constexpr (w4a8) tile_rows_w4a8<FMT, 1>(A, tile, &qr[m0], &sxr[m0], &qsr[m0], orow, n);
      else if (many) zmm_fp_unit_chunks<FMT, 1>(A, 0, item, n8, xf.rows(m0), orow, n);
      else if (fpz) zmm_fp_unit_rows<FMT, 1>(A, 0, item, n8, &xr[m0], orow, n);
      else tile_rows<FMT, 1>(A, tile, &xr[m0], orow, n);
    }
    if (first_max) {  // after a chunk's last item, its columns of each row (still in this core's cache)
      const int64_t c = item / chunk, end = std::min(items, (c + 1) * chunk);
      if (item + 1 == end) {
        const int64_t w = units ? 16 : 8, col0 = c * chunk * w, col1 = std::min(end * w, N);
        for (int64_t m = 0; m < M; ++m) {
          Cand& k = cand(c, m);
          k = Cand{0.f, -1};
          const float* row = out + m * ldo;
          if (race && race->temps[m] > 0.f) {
            const RacePick p = race_span(row, col0, col1, race->temps[m], race->k0[m], race->k1[m], race->floor[m]);
            k = Cand{p.score, p.id};
            continue;
          }
          for (int64_t col = col0; col < col1; col += 16)
            first_max_update(row + col, std::min<int64_t>(16, col1 - col), col, k.best, k.at);
        }
      }
    }
  });
  for (int64_t m = 0; m < M && first_max; ++m) {  // the chunks' candidates in column order
    float best = 0.f;
    int64_t at = -1;
    if (race && race->temps[m] > 0.f) {
      RacePick win{0.f, -1};
      for (int64_t c = 0; c < chunks; ++c) win = race_merge(win, RacePick{cand(c, m).best, cand(c, m).at});
      best = win.score;
      at = win.id;
    } else {
      for (int64_t c = 0; c < chunks; ++c)
        if (cand(c, m).at >= 0) first_max_update(&cand(c, m).best, 1, cand(c, m).at, best, at);
    }
    first_max[m] = at;
    if (race) race->best[m] = at >= 0 ? best : -std::numeric_limits<float>::infinity();
  }
}

// Group-padded K of a projection (quantized formats pad K to a multiple of the group size).
inline int64_t padded_k(int64_t k, int64_t fmt, int64_t gs) { return is_quantized(fmt) ? (k + gs - 1) / gs * gs : k; }

Problem make_problem(int64_t T, int64_t K, int64_t fmt, int64_t E, int64_t H, int64_t I, int64_t gs,
                     const void* gu_w, const uint16_t* gu_s, const uint16_t* gu_m, const void* dn_w,
                     const uint16_t* dn_s, const uint16_t* dn_m) {
  Problem P;
  P.T = T; P.K = K; P.E = E; P.H = H; P.I = I; P.gs = gs;
  P.h8 = (H + 7) / 8; P.i8 = (I + 7) / 8;
  P.hp = padded_k(H, fmt, gs);
  P.ip = padded_k(I, fmt, gs);
  P.hbuf = std::max(P.ip, P.i8 * 8);
  P.gu = Mat{gu_w, gu_s, gu_m, P.hp, gs};
  P.dn = Mat{dn_w, dn_s, dn_m, P.ip, gs};
  return P;
}

// Format dispatch: 0 on success, -1 for an expert id out of range (MoE), -2 for an unknown format.
int moe_dispatch(int64_t fmt, const Problem& P, const float* x, const int64_t* ids, const float* wts, float* out,
                 int nthreads) {
  switch (fmt) {
    case FP32: return run<FP32>(P, x, ids, wts, out, nthreads);
    case BF16: return run<BF16>(P, x, ids, wts, out, nthreads);
    case INT8: return run<INT8>(P, x, ids, wts, out, nthreads);
    case INT4: return run<INT4>(P, x, ids, wts, out, nthreads);
    case INT4A: return run<INT4A>(P, x, ids, wts, out, nthreads);
    case BF16A: return run<BF16A>(P, x, ids, wts, out, nthreads);
    case I8A8: return run<I8A8>(P, x, ids, wts, out, nthreads);
    default: return -2;
  }
}

int linear_dispatch(int64_t fmt, const Mat& A, const float* x, float* out, int64_t M, int64_t K, int64_t n8,
                    int nthreads, int64_t N = 0, int64_t* first_max = nullptr, const HeadRace* race = nullptr) {
  switch (fmt) {
    case FP32: run_linear<FP32>(A, x, out, M, K, n8, nthreads, N, first_max, race); return 0;
    case BF16: run_linear<BF16>(A, x, out, M, K, n8, nthreads, N, first_max, race); return 0;
    case INT8: run_linear<INT8>(A, x, out, M, K, n8, nthreads, N, first_max, race); return 0;
    case INT4: run_linear<INT4>(A, x, out, M, K, n8, nthreads, N, first_max, race); return 0;
    case INT4A: run_linear<INT4A>(A, x, out, M, K, n8, nthreads, N, first_max, race); return 0;
    case BF16A: run_linear<BF16A>(A, x, out, M, K, n8, nthreads, N, first_max, race); return 0;
    case I8A8: run_linear<I8A8>(A, x, out, M, K, n8, nthreads, N, first_max, race); return 0;
    default: return -2;
  }
}

}  // namespace

#include "attention.h"
#include "router.h"
#include "decode_layer.h"
#include "norm.h"
#include "logits_mask.h"

extern "C" {

// Returns 0 on success, -1 if an expert id is out of range, -2 for an unknown format or activation.
// x [T, H] fp32; ids [T, K] int64 (-1 = skip); wts [T, K] fp32; out [T, ceil(H/8)*8] fp32.
// gu_b [E][2][ceil(I/8)*8] and dn_b [E][ceil(H/8)*8] fp32 biases or null; act 0 SiLU, 1 clamped SwiGLU.
int moegate_fused_moe(const float* x, const int64_t* ids, const float* wts, float* out, int64_t T, int64_t K,
                      int64_t fmt, int64_t E, int64_t H, int64_t I, int64_t gs, const void* gu_w,
                      const uint16_t* gu_s, const uint16_t* gu_m, const void* dn_w, const uint16_t* dn_s,
                      const uint16_t* dn_m, int nthreads, const float* gu_b, const float* dn_b, int act,
                      float alpha, float limit) {
  if (act != ACT_SILU && act != ACT_SWIGLU_CLAMPED) return -2;
  if ((gu_b == nullptr) != (dn_b == nullptr)) return -2;
  Problem P = make_problem(T, K, fmt, E, H, I, gs, gu_w, gu_s, gu_m, dn_w, dn_s, dn_m);
  P.gu_bias = gu_b;
  P.dn_bias = dn_b;
  P.act = Act{act, alpha, limit};
  return moe_dispatch(fmt, P, x, ids, wts, out, std::max(nthreads, 1));
}

// y [M, ceil(N/8)*8] = x [M, K] . W^T, W tiled as one down-style projection ([N8, Kp, 1, 8]).
// Returns 0 on success, -2 for an unknown format.
int moegate_linear(const float* x, float* out, int64_t M, int64_t N, int64_t K, int64_t fmt, int64_t gs,
                   const void* w, const uint16_t* s, const uint16_t* mins, int nthreads) {
  const Mat A{w, s, mins, padded_k(K, fmt, gs), gs};
  return linear_dispatch(fmt, A, x, out, M, K, (N + 7) / 8, std::max(nthreads, 1));
}

// moegate_linear, and first_max [M] int64: each row's first largest logit among its N columns (numpy's argmax of
// out[m, :N]: a NaN counts as the largest, the first one wins), found by each thread over the columns it wrote.
int moegate_linear_first_max(const float* x, float* out, int64_t M, int64_t N, int64_t K, int64_t fmt, int64_t gs,
                             const void* w, const uint16_t* s, const uint16_t* mins, int nthreads,
                             int64_t* first_max) {
  const Mat A{w, s, mins, padded_k(K, fmt, gs), gs};
  return linear_dispatch(fmt, A, x, out, M, K, (N + 7) / 8, std::max(nthreads, 1), N, first_max);
}

// The lm_head with each row's pick among its first V columns (moegate_linear_race's work, below): the rows' race keys
// hashed and their floors set, then the projection with the races scored by the threads that write the columns.
static int linear_race(int64_t fmt, const Mat& A, const float* x, float* out, int64_t M, int64_t N, int64_t K,
                       int nthreads, int64_t V, const float* temps, const uint64_t* keys, const uint64_t* counters,
                       int64_t* picks, float* best) {
  if (V < 0 || V > N) return -2;
  std::vector<uint32_t> k0(M), k1(M);
  std::unique_ptr<std::atomic<uint32_t>[]> floor(new std::atomic<uint32_t>[M]);
  for (int64_t m = 0; m < M; ++m) {
    race_key(keys[m], counters[m], &k0[m], &k1[m]);
    floor[m].store(float_order(-std::numeric_limits<float>::infinity()), std::memory_order_relaxed);
  }
  const HeadRace race{temps, k0.data(), k1.data(), floor.get(), best};
  return linear_dispatch(fmt, A, x, out, M, K, (N + 7) / 8, std::max(nthreads, 1), V, picks, &race);
}

// A decode step's two kernel calls in one: moegate_decode_stack over rows [0, T) (every layer and the final norm into
// norm_out), then the lm_head over the first n rows of norm_out into logits, then the pool's helpers rest (no kernel
// call is coming before the next step). pick: 0 the lm_head alone (moegate_linear), 1 with each row's first largest
// logit into first_max (moegate_linear_first_max), 2 with the rows' races over their first V logits into picks and
// best (moegate_linear_race over the kept temps, keys and counters). The arguments are kept in one struct between
// steps (kernels/build.py DecodeStepArgs mirrors it), so a step passes T, n, pick and V.
// Returns the stack's code (-4: a slot or context outside the caches, nothing written), else -100 + the lm_head's.
struct DecodeStepArgs {  // mirrored by kernels/build.py (ctypes): keep in sync
  const DecodeLayerParams* layers;
  int64_t L;
  float* x;
  const float* cos;
  const float* sin;
  float* const* k_caches;
  float* const* v_caches;
  const int64_t* slot_mapping;
  const int64_t* ctx_slots;
  const int64_t* ctx_start;
  const int64_t* ctx_len;
  int64_t* topk_ids;
  int64_t* const* counts;
  const float* norm_w;
  double norm_eps;
  float* norm_out;
  int64_t nthreads, cache_slots, ctx_total;
  float* logits;  // [>= n, ceil(N/8)*8]
  int64_t N, K, fmt, gs;
  const void* w;
  const uint16_t* s;
  const uint16_t* mins;
  int64_t head_threads;
  int64_t* first_max;  // [>= n] (pick 1)
  const float* temps;  // [>= n] each, pick 2: the race's inputs (temperature > 0 races), then its outputs
  const uint64_t* keys;
  const uint64_t* counters;
  int64_t* picks;
  float* best;
};

int moegate_decode_step(const DecodeStepArgs* a, int64_t T, int64_t n, int pick, int64_t V) {
  int rc = moegate_decode_stack(a->layers, a->L, a->x, T, a->cos, a->sin, a->k_caches, a->v_caches, a->slot_mapping,
                                a->ctx_slots, a->ctx_start, a->ctx_len, a->topk_ids, a->counts, a->norm_w, a->norm_eps,
                                a->norm_out, (int)a->nthreads, a->cache_slots, a->ctx_total);
  if (rc == 0) {
    const Mat A{a->w, a->s, a->mins, padded_k(a->K, a->fmt, a->gs), a->gs};
    if (pick == 2)
      rc = linear_race(a->fmt, A, a->norm_out, a->logits, n, a->N, a->K, (int)a->head_threads, V, a->temps, a->keys,
                       a->counters, a->picks, a->best);
    else
      rc = linear_dispatch(a->fmt, A, a->norm_out, a->logits, n, a->K, (a->N + 7) / 8,
                           std::max((int)a->head_threads, 1), pick ? a->N : 0, pick ? a->first_max : nullptr);
    if (rc != 0) rc -= 100;
  }
  moegate::WorkPool::instance().rest();
  return rc;
}

// moegate_linear, and each row's pick among its first V columns (V <= N) into picks [M] int64 and best [M] fp32:
// where temps[m] > 0, the race at temperature temps[m] over the draw counters[m] of the stream keys[m] (the id and
// score of moegate_race_sample over out[m, :V], bit for bit: a NaN logit's row gets its first NaN), scored by
// each thread over the columns it just wrote; else the first largest logit (moegate_linear_first_max's over V
// columns, best its logit). No column: pick -1, best -inf. Returns 0, or -2 for an unknown format or V outside [0, N].
int moegate_linear_race(const float* x, float* out, int64_t M, int64_t N, int64_t K, int64_t fmt, int64_t gs,
                        const void* w, const uint16_t* s, const uint16_t* mins, int nthreads, int64_t V,
                        const float* temps, const uint64_t* keys, const uint64_t* counters, int64_t* picks,
                        float* best) {
  const Mat A{w, s, mins, padded_k(K, fmt, gs), gs};
  return linear_race(fmt, A, x, out, M, N, K, nthreads, V, temps, keys, counters, picks, best);
}

int moegate_is_avx2() {
#ifdef MOEGATE_AVX2
  return 1;
#else
  return 0;
#endif
}

// Whether bf16_a16 runs on AVX-512 BF16 vdpbf16ps here (the avx512 build on a CPU that has it).
int moegate_has_bf16_dot() { return cpu_has_bf16_dot() ? 1 : 0; }

// The path bf16_a16 takes now (under the path limit): 2 AMX tdpbf16ps, 1 vdpbf16ps, 0 fp32 FMA.
int moegate_bf16_a16_path() { return kZmm && amx_bf16_used() ? 2 : cpu_has_bf16_dot() ? 1 : 0; }

// The run-time path limit (paths.h: 2 = every path the CPU has, 1 = no AMX, 0 = plain zmm): set it where
// `level` >= 0; returns the previous limit.
int moegate_path_limit(int level) {
  return level >= 0 ? moegate::path_limit().exchange(level > 2 ? 2 : level) : moegate::path_limit().load();
}

// AMX here (CPU and OS permission, whatever the limit): bit 0 AMX-INT8, bit 1 AMX-BF16.
int moegate_has_amx() { return (moegate::amx_support().int8 ? 1 : 0) | (moegate::amx_support().bf16 ? 2 : 0); }

// Rows of an expert or dense batch from which format `fmt` (int4, int4_asym, int8_a8) runs on AMX int8 tiles where
// the CPU has them (amx_int8.h; the same bits as below it): set it where rows >= 1; returns the previous value.
int moegate_amx_min_rows(int fmt, int rows) {
  return rows >= 1 ? amx_min_rows(fmt).exchange(rows) : amx_min_rows(fmt).load();
}

// The SIMD path of this build, for logs and benchmark reports.
const char* moegate_simd_path() {
#if defined(MOEGATE_ZMM)
  // One sentence per state (AMX int8 on or off) x (bf16_a16 on AMX, on vdpbf16ps, on FMA), composed once.
  static const std::vector<std::string> paths = [] {
    std::vector<std::string> out;
    for (const bool amx8 : {false, true})
      for (const char* bf16 : {"fp32/bf16/int8/bf16_a16 zmm fma", "bf16_a16 zmm vdpbf16ps, fp32/bf16/int8 zmm fma",
                               "bf16_a16 AMX tdpbf16ps, fp32/bf16/int8 zmm fma"})
        out.push_back(std::string("avx512: W4A8 / W8A8 ") +
                      (amx8 ? "AMX int8 tiles (tdpbssd, 16 tokens x 16 rows) where an expert or batch has >= "
                              "moegate_amx_min_rows(fmt) rows (int8_a8: 32), else "
                            : "") +
                      "zmm vpdpbusd (16 rows x up to 8 tokens per weight block), " + bf16 +
                      " (16 rows x up to 15 tokens per weight vector)");
    return out;
  }();
  const int bf16 = amx_bf16_used() ? 2 : cpu_has_bf16_dot() ? 1 : 0;
  return paths[(moegate::amx_int8_here() ? 3 : 0) + bf16].c_str();
#elif defined(MOEGATE_VNNI)
  return "avx512: W4A8 ymm vpdpbusd";
#elif defined(MOEGATE_AVX2)
  return "avx2: W4A8 / W8A8 maddubs";
#else
  return "generic: plain loops";
#endif
}

int moegate_is_vnni() {
#ifdef MOEGATE_VNNI
  return 1;
#else
  return 0;
#endif
}

// The pool's sizing (work_pool.h threads_for) on (1, the default) or off (0: each job gets the threads it asks
// for); returns the previous setting.
int moegate_pool_sizing(int on) { return moegate::pool_sizing().exchange(on != 0) ? 1 : 0; }

// How long the pool's helpers spin for the next job before sleeping, in microseconds (>= 0: set it; < 0: leave
// it); returns the previous setting. moegate_pool_rest: the helpers sleep now (no kernel call is coming soon).
int64_t moegate_pool_spin(int64_t us) { return us >= 0 ? moegate::spin_us().exchange(us) : moegate::spin_us().load(); }
void moegate_pool_rest() { moegate::WorkPool::instance().rest(); }

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
