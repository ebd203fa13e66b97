// W4A8 on 512-bit AVX-512 VNNI (the avx512 variant): 16 output rows per zmm, up to 8 activation rows
// per weight block. Included by moe_cpu.cpp after tile_dot_w4a8.
//
// A "unit" is 16 output lanes: a gate_up tile (its 8 gate rows and 8 up rows are one contiguous 64-byte
// block per k block) or two adjacent R8 = 1 tiles (down, dense layers: two 32-byte loads joined), or one
// R8 = 1 tile (the last of an odd count; the upper lanes compute zeros). Each weight block is loaded and
// unpacked once and used by MT activation rows (MT <= 8): at prefill sizes the weights stay in registers
// instead of being re-read and re-unpacked per row, and one vpdpbusd does 16 rows x 4 k.
//
// The int8 activations come interleaved (ZmmActs): a chunk of MT rows stores each k block's 8 bytes of
// its rows side by side, and each group's scale and sums row after row, so the tile loop reads all MT
// rows at fixed offsets from one pointer (per-row pointers cost general registers the loop then spilled
// and reloaded on every block).
//
// The arithmetic per row is the avx2 / generic path's, bit for bit: the integer sums are exact whatever
// the accumulator split, and each group adds fma(s * sx, sum(u q) - 8 sum(q), acc) (int4; the integer
// accumulator starts at -8 sum(q), so the converted value is the same exact integer) or
// fma(s * sx, sum(u q), acc) then fma(m * sx, sum(q), acc) (int4_asym), in group order. Nothing depends
// on MT or on which rows share the call, so a row's result is batch-invariant.
#pragma once

namespace {

constexpr int kZmmChunk = 8;  // activation rows per interleaved chunk (the tile loop's largest MT)

// Up to this many activation rows the bf16 units run a pair of 8-row tiles as two single tiles in sequence
// (the weights then stream from one address range) and the fp32-activation units take their few-row loops.
// W4A8 and W8A8 run a pair side by side at every row count: one tile alone left half of each vpdpbusd idle
// and made one row compute-bound (zmm_unit_rows).
constexpr int kSequentialRows = 2;

// int8 activations (with per-group scale sx, sum(q) as float qs and -8 sum(q) n8) of a set of N rows,
// in chunks of kZmmChunk rows from row 0 (the last chunk n = N mod 8 rows): chunk c holds
// q [kp / 8][n][8] at q + 8c * kp and sx / qs / n8 [ng][n] at + 8c * ng. rows(i) (i a multiple of 8)
// is the set from row i on, in the same layout.
struct ZmmActs {
  int8_t* q;
  float* sx;
  float* qs;
  int32_t* n8;
  int64_t kp, ng;

  ZmmActs rows(int64_t i) const { return ZmmActs{q + i * kp, sx + i * ng, qs + i * ng, n8 + i * ng, kp, ng}; }

  // Row i of the N-row set from one row's quantize_row output.
  void put(int64_t i, int64_t N, const int8_t* qr, const float* sxr, const float* qsr, const int32_t* n8r) const {
    const int64_t c0 = i / kZmmChunk * kZmmChunk, j = i - c0, n = std::min<int64_t>(kZmmChunk, N - c0);
    int8_t* cq = q + c0 * kp;
    for (int64_t kb = 0; kb < kp / 8; ++kb) std::memcpy(cq + (kb * n + j) * 8, qr + kb * 8, 8);
    for (int64_t g = 0; g < ng; ++g) {
      sx[c0 * ng + g * n + j] = sxr[g];
      qs[c0 * ng + g * n + j] = qsr[g];
      n8[c0 * ng + g * n + j] = n8r[g];
    }
  }
};

}  // namespace

#ifdef MOEGATE_ZMM

namespace {

enum ZmmUnit { kContig = 0, kPair = 1, kSingle = 2 };

// out[m][0 .. 16) = acc[m] for MT rows of a unit (kSingle: the low 8 lanes).
template <int MODE, int MT>
inline void store_unit_rows(const __m512* acc, float* const* out) {
  #pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) {
    if constexpr (MODE == kSingle) _mm256_storeu_ps(out[m], _mm512_castps512_ps256(acc[m]));
    else _mm512_storeu_ps(out[m], acc[m]);
  }
}

struct ZmmOperand {  // one 16-lane unit of a tiled int4 projection
  const uint8_t* w0;  // lanes 0-7 (kContig: all 16) weight blocks, wstride bytes apart per k block
  const uint8_t* w1;  // lanes 8-15 (kPair)
  const uint16_t* s0;  // fp16 scales of lanes 0-7 (kContig: 0-15), sstride apart per group
  const uint16_t* s1;
  const uint16_t* m0;  // int4_asym mins, same layout as the scales
  const uint16_t* m1;
  int64_t wstride, sstride, kp, gs;
  int64_t tile_bytes;  // bytes of one 8-row tile's weights (kPair prefetch)
};

template <int MODE>
inline __m512i zmm_weights(const ZmmOperand& A, int64_t kb) {
  if constexpr (MODE == kContig) return _mm512_loadu_si512(A.w0 + kb * A.wstride);
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(A.w0 + kb * A.wstride));
  if constexpr (MODE == kSingle) return _mm512_zextsi256_si512(lo);
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(A.w1 + kb * A.wstride)), 1);
}

template <int MODE>
inline __m512 zmm_f16(const uint16_t* p0, const uint16_t* p1) {
  if constexpr (MODE == kContig) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0)));
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p0));
  if constexpr (MODE == kSingle) return _mm512_cvtph_ps(_mm256_zextsi128_si256(lo));
  return _mm512_cvtph_ps(
      _mm256_inserti128_si256(_mm256_castsi128_si256(lo), _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1)), 1));
}

inline void zmm_prefetch(const uint8_t* p) { __builtin_prefetch(p + kPrefetch, 0, 3); }

// acc + vpdpbusd(w, the 4 int8 at p in every lane), the broadcast folded into the instruction's memory
// operand ({1to16}): the same instruction and sums as _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(..)),
// which GCC compiles to a separate vpbroadcastd per row and block (its vpdpbusd pattern takes no embedded
// broadcast). At 8 rows that broadcast was a third of the tile loop's instructions, and the front end,
// not the vpdpbusd port, set the pace.
typedef int32_t __attribute__((may_alias)) int8x4_t;  // 4 int8 read as one dword (aliases the int8 data)
inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int8x4_t*>(p)));
  return acc;
}

// A pair of tiles is two streams tile_bytes apart, and the tiles of consecutive units are contiguous
// (t, t+1 now; t+2, t+3 next). Each stream prefetches kPrefetch / 2 ahead of itself (the two together
// keep kPrefetch in flight, as one stream does); past its tile's end the target moves on to the same
// stream of the next unit (one tile further), not into the other stream's current tile: prefetching
// both at + kPrefetch fetched tile t+1 twice and tile t+3 never (measured: down at M = 1 stalled on
// every load of the second stream).
template <class T>
inline void pair_prefetch(const T* w0, const T* w1, int64_t off_bytes, int64_t tile_bytes) {
  int64_t y = off_bytes + kPrefetch / 2;
  if (y >= tile_bytes) y += tile_bytes;
  __builtin_prefetch(reinterpret_cast<const char*>(w0) + y, 0, 3);
  __builtin_prefetch(reinterpret_cast<const char*>(w1) + y, 0, 3);
}

// out[m][0 .. 16) (kSingle: [0 .. 8)) = unit rows . dequant(q row m) for one interleaved chunk of MT
// activation rows (ZmmActs): q [kb][MT][8] int8, sx / qs [g][MT] per-group scale and sum(q) as float,
// n8 [g][MT] per-group -8 * sum(q) (int32).
template <int FMT, int MODE, int MT>
void zmm_w4a8(const ZmmOperand& A, const int8_t* q, const float* sx, const float* qs, const int32_t* n8,
              float* const* out) {
  // Independent integer chains per row: lo / hi nibbles, and k-block parity for a single row, so that
  // the vpdpbusd latency (5 cycles) stays hidden (exact integer sums: the split never changes a result).
  constexpr int NC = MT >= 2 ? 2 : 4;
  const __m512i m15 = _mm512_set1_epi8(15);
  __m512 acc[MT];
  #pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t ng = A.kp / A.gs, bpg = A.gs / 8;  // groups, k blocks per group
  for (int64_t g = 0; g < ng; ++g) {
    __m512i isum[NC][MT];
    #pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) {
      isum[0][m] = FMT == INT4 ? _mm512_set1_epi32(n8[g * MT + m]) : _mm512_setzero_si512();
      #pragma GCC unroll 16
      for (int c = 1; c < NC; ++c) isum[c][m] = _mm512_setzero_si512();
    }
    // clo / chi (the accumulator sets) are compile-time constants: sums indexed at run time would spill
    auto block = [&](int64_t kb, auto clo_c, auto chi_c) {
      constexpr int clo = decltype(clo_c)::value, chi = decltype(chi_c)::value;
      if constexpr (MODE == kContig) zmm_prefetch(A.w0 + kb * A.wstride);
      else if (!(kb & 1)) {  // 32-byte blocks: one prefetch per 64-byte line of each stream
        if constexpr (MODE == kPair) pair_prefetch(A.w0, A.w1, kb * A.wstride, A.tile_bytes);
        else zmm_prefetch(A.w0 + kb * A.wstride);
      }
      const __m512i w = zmm_weights<MODE>(A, kb);
      const __m512i lo = _mm512_and_si512(w, m15), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m15);
      const int8_t* qb = q + kb * (MT * 8);
      #pragma GCC unroll 16
      for (int m = 0; m < MT; ++m) {
        isum[clo][m] = dpbusd_bcast(isum[clo][m], lo, qb + m * 8);
        isum[chi][m] = dpbusd_bcast(isum[chi][m], hi, qb + m * 8 + 4);
      }
    };
    const int64_t kb0 = g * bpg;
    int64_t j = 0;
    if constexpr (NC == 4) {
      for (; j + 2 <= bpg; j += 2) {
        block(kb0 + j, std::integral_constant<int, 0>{}, std::integral_constant<int, 1>{});
        block(kb0 + j + 1, std::integral_constant<int, 2>{}, std::integral_constant<int, 3>{});
      }
    }
    if (bpg == 4 && NC == 2) {  // the default group of 32 k: four blocks, unrolled (no register rotation)
      block(kb0, std::integral_constant<int, 0>{}, std::integral_constant<int, 1>{});
      block(kb0 + 1, std::integral_constant<int, 0>{}, std::integral_constant<int, 1>{});
      block(kb0 + 2, std::integral_constant<int, 0>{}, std::integral_constant<int, 1>{});
      block(kb0 + 3, std::integral_constant<int, 0>{}, std::integral_constant<int, 1>{});
      j = bpg;
    }
    for (; j < bpg; ++j) block(kb0 + j, std::integral_constant<int, 0>{}, std::integral_constant<int, NC >= 2 ? 1 : 0>{});
    #pragma GCC unroll 16
    for (int c = 1; c < NC; ++c)
      #pragma GCC unroll 16
      for (int m = 0; m < MT; ++m) isum[0][m] = _mm512_add_epi32(isum[0][m], isum[c][m]);
    const __m512 s = zmm_f16<MODE>(A.s0 + g * A.sstride, A.s1 + g * A.sstride);
    if constexpr (FMT == INT4) {
      #pragma GCC unroll 16
      for (int m = 0; m < MT; ++m)
        acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(sx[g * MT + m])), _mm512_cvtepi32_ps(isum[0][m]), acc[m]);
    } else {
      const __m512 b = zmm_f16<MODE>(A.m0 + g * A.sstride, A.m1 + g * A.sstride);
      #pragma GCC unroll 16
      for (int m = 0; m < MT; ++m) {
        const __m512 sxv = _mm512_set1_ps(sx[g * MT + m]);
        acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(s, sxv), _mm512_cvtepi32_ps(isum[0][m]), acc[m]);
        acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(b, sxv), _mm512_set1_ps(qs[g * MT + m]), acc[m]);
      }
    }
  }
  store_unit_rows<MODE, MT>(acc, out);
}

// Rows [0, n) of an interleaved set (chunks of 8 from row 0) through one unit.
template <int FMT, int MODE>
void zmm_rows(const ZmmOperand& A, const ZmmActs& X, float* const* out, int n) {
  for_row_chunks(n, [&](auto mt, int i) {
    const ZmmActs c = X.rows(i);
    zmm_w4a8<FMT, MODE, decltype(mt)::value>(A, c.q, c.sx, c.qs, c.n8, out + i);
  });
}

// Unit `u` of a tiled projection: for R8 = 2 the gate_up tile u (16 lanes, contiguous); for R8 = 1 the
// tiles 2u and 2u + 1 (the second only if it exists: n8 tiles in all, counted from `first` tile).
// X: the n activation rows, interleaved (ZmmActs).
template <int FMT, int R8>
void zmm_unit_rows(const Mat& M, int64_t first, int64_t u, int64_t n8, const ZmmActs& X, float* const* out, int n) {
  const int64_t ng = M.kp / M.gs, kb = M.kp / 8;
  const uint8_t* w = static_cast<const uint8_t*>(M.w);
  if constexpr (R8 == 2) {
    const int64_t t = first + u;
    const uint16_t* mn = FMT == INT4A ? M.mins + t * ng * 16 : nullptr;
    const ZmmOperand A{w + t * kb * 64, nullptr, M.scales + t * ng * 16, nullptr, mn, nullptr, 64, 16, M.kp, M.gs,
                       kb * 64};
    zmm_rows<FMT, kContig>(A, X, out, n);
  } else {
    const int64_t t = first + 2 * u;
    const bool pair = 2 * u + 1 < n8;
    const uint16_t* mn = FMT == INT4A ? M.mins + t * ng * 8 : nullptr;
    const ZmmOperand A{w + t * kb * 32, w + (t + 1) * kb * 32, M.scales + t * ng * 8, M.scales + (t + 1) * ng * 8,
                       mn, mn ? mn + ng * 8 : nullptr, 32, 8, M.kp, M.gs, kb * 32};
    // Both tiles side by side at every row count, their two streams prefetched by pair_prefetch. One tile
    // after the other at few rows left the upper 8 lanes of every vpdpbusd empty: one row on one core with
    // the weights in cache ran 12.4 GB/s (the DRAM share of a core is ~10), two tiles side by side 20.2.
    if (pair) zmm_rows<FMT, kPair>(A, X, out, n);
    else zmm_rows<FMT, kSingle>(A, X, out, n);
  }
}

}  // namespace

#endif  // MOEGATE_ZMM
