// AMX int8 tiles for the a8 formats (int8_a8, int4, int4_asym): tdpbssd (s8 x s8 -> s32) computes each group's
// integer sum(q_w q_x) for 16 tokens x 16 output rows at once. Included by moe_cpu.cpp after w8a8.h (it reuses
// w4a8_zmm.h's ZmmOperand, zmm_f16 and unit modes).
//
// A unit (16 output lanes, as zmm_unit_rows: a gate_up tile, or two 8-row tiles side by side, or one) is first
// laid out as a B panel [kp / 4][16][4] int8: one 64-byte row per 4 k, exactly one AMX B-tile row. W8A8 gate_up
// tiles already are that ([Kp / 4][16][4]) and are read in place; W8A8 tile pairs are interleaved, int4 nibbles
// unpacked (int4: u - 8 in [-8, 7], so the sum is sum(u q) - 8 sum(q), the zmm path's corrected integer;
// int4_asym: u in [0, 15]). The panel is built once per call and read by every 16-token block of it.
//
// Per block of up to 16 token rows and per group of gs: C = sum over the group's k chunks (kc <= 64 bytes each)
// of A (16 rows x kc int8 activations) . B (kc / 4 panel rows), stored, then per row the zmm path's epilogue:
// acc = fma(s * s_x, float(C), acc) (int4_asym: then fma(m * s_x, sum(q), acc)), in group order. C holds the
// same exact integer as the zmm path's accumulator and every float operation is the same, so the output is
// bitwise the zmm path's for every row count, tail and thread count. Groups go through the tiles four at a time
// (amx_block), their epilogue one batch behind.
#pragma once

namespace {

constexpr int kAmxNever = 1 << 30;

// Per format code (int4, int4_asym, int8_a8), the rows of an expert (or a dense projection's batch) from which
// the AMX path runs instead of zmm vpdpbusd; measured (docs/kernels.md "AMX int8 tiles"): int8_a8 from 32 rows
// (below, the tiles' fixed cost per group of 32 loses to vpdpbusd); int4's zmm path (two nibble chains over
// interleaved rows) ran as fast as the tiles at every row count, so int4 formats stay on zmm unless asked
// (moegate_amx_min_rows, for tests and benchmarks).
inline std::atomic<int>& amx_min_rows(int fmt) {
  static std::atomic<int> rows[7] = {{kAmxNever}, {kAmxNever}, {kAmxNever}, {kAmxNever}, {kAmxNever}, {kAmxNever},
                                     {32}};
  return rows[fmt >= 0 && fmt < 7 ? fmt : 0];
}

// Whether n rows of an a8 projection in format fmt take the AMX path (where the CPU has it:
// moegate::amx_int8_here()).
inline bool amx_int8_rows(int fmt, int64_t n) { return n >= amx_min_rows(fmt).load(std::memory_order_relaxed); }

// The k chunk of one tdpbssd: the largest divisor of gs that is a multiple of 4 and at most 64 (gs is a multiple
// of 8: kernels/formats.py check_format).
inline int amx_chunk(int64_t gs) {
  for (int d = 64; d >= 4; d -= 4)
    if (gs % d == 0) return d;
  return 4;
}

// Int8 activations of n rows, row m at q + m * ldq (kp bytes) with its per-group scales and sums of q
// (as float) at sx / qs + m * ldg.
struct AmxActs {
  const int8_t* q;
  int64_t ldq;
  const float* sx;
  const float* qs;
  int64_t ldg;
};

}  // namespace

#ifdef MOEGATE_ZMM

namespace {

inline int8_t* amx_panel_buffer(int64_t bytes) {
  thread_local std::vector<int8_t> buf;
  if ((int64_t)buf.size() < bytes) buf.resize(bytes);
  return buf.data();
}

// The unit's B panel [kp / 4][64] (see the header comment); W8A8 kContig returns the weights themselves.
template <int FMT, int MODE>
const int8_t* amx_panel(const ZmmOperand& A) {
  const int64_t kb4 = A.kp / 4;
  if constexpr (FMT == I8A8 && MODE == kContig) return reinterpret_cast<const int8_t*>(A.w0);
  int8_t* p = amx_panel_buffer(kb4 * 64);
  if constexpr (FMT == I8A8) {
    for (int64_t kb = 0; kb < kb4; ++kb) {
      if (!(kb & 1)) {  // one prefetch per 64-byte line of each stream (w4a8_zmm.h pair_prefetch)
        if constexpr (MODE == kPair) pair_prefetch(A.w0, A.w1, kb * 32, A.tile_bytes);
        else zmm_prefetch(A.w0 + kb * 32);
      }
      std::memcpy(p + kb * 64, A.w0 + kb * 32, 32);
      if constexpr (MODE == kPair) std::memcpy(p + kb * 64 + 32, A.w1 + kb * 32, 32);
      else std::memset(p + kb * 64 + 32, 0, 32);
    }
  } else {
    const __m512i m15 = _mm512_set1_epi8(15), off = _mm512_set1_epi8(FMT == INT4 ? 8 : 0);
    for (int64_t kb = 0; kb < A.kp / 8; ++kb) {
      if constexpr (MODE == kContig) zmm_prefetch(A.w0 + kb * 64);
      else if (!(kb & 1)) {
        if constexpr (MODE == kPair) pair_prefetch(A.w0, A.w1, kb * 32, A.tile_bytes);
        else zmm_prefetch(A.w0 + kb * 32);
      }
      const __m512i w = zmm_weights<MODE>(A, kb);  // kSingle: upper lanes 0 (their outputs are not stored)
      const __m512i lo = _mm512_and_si512(w, m15), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m15);
      _mm512_storeu_si512(p + kb * 128, _mm512_sub_epi8(lo, off));
      _mm512_storeu_si512(p + kb * 128 + 64, _mm512_sub_epi8(hi, off));
    }
  }
  return p;
}

// out rows [0, rows) (row m at out + m * ldo, 16 floats; kSingle 8) = unit . dequant(activation rows), rows <= 16.
// Groups go in batches of 4: C tiles 0-3 (A tiles 4, 5 and B tiles 6, 7 by group parity) stored into one half of
// cbuf while the previous batch's epilogue reads the other half, so the epilogue's loads never wait on a tile
// store just issued (one group at a time, each epilogue waiting on its tilestored: ~1.4x slower).
template <int FMT, int MODE, bool FULL>
__attribute__((target("amx-tile,amx-int8"))) void amx_block(const int8_t* panel, const ZmmOperand& A,
                                                            const AmxActs& X, float* out, int64_t ldo, int rows,
                                                            int kc) {
  const int64_t ng = A.kp / A.gs, steps = A.gs / kc;
  alignas(64) int32_t cbuf[2][4][16][16];
  __m512 acc[16];
  #pragma GCC unroll 16
  for (int m = 0; m < 16; ++m) acc[m] = _mm512_setzero_ps();
  // Group g's integer sums into C tile c (GCC's tile macros take literal tile numbers).
  auto sums = [&](int64_t g, auto c_c) {
    constexpr int c = decltype(c_c)::value;
    for (int64_t j = 0, k = g * A.gs; j < steps; ++j, k += kc) {
      if constexpr (FMT == I8A8 && MODE == kContig) prefetch_ahead(panel + k * 16, kc * 16);  // the weights
      if constexpr (c % 2 == 0) {
        _tile_loadd(4, X.q + k, X.ldq);
        _tile_loadd(6, panel + k * 16, 64);
      } else {
        _tile_loadd(5, X.q + k, X.ldq);
        _tile_loadd(7, panel + k * 16, 64);
      }
      if constexpr (c == 0) _tile_dpbssd(0, 4, 6);
      else if constexpr (c == 1) _tile_dpbssd(1, 5, 7);
      else if constexpr (c == 2) _tile_dpbssd(2, 4, 6);
      else _tile_dpbssd(3, 5, 7);
    }
  };
  // Groups [g0, g0 + cnt) (cnt <= 4) into cbuf[half].
  auto issue = [&](int64_t g0, int cnt, int half) {
    _tile_zero(0);
    sums(g0, std::integral_constant<int, 0>{});
    _tile_stored(0, cbuf[half][0], 64);
    if (cnt > 1) {
      _tile_zero(1);
      sums(g0 + 1, std::integral_constant<int, 1>{});
      _tile_stored(1, cbuf[half][1], 64);
    }
    if (cnt > 2) {
      _tile_zero(2);
      sums(g0 + 2, std::integral_constant<int, 2>{});
      _tile_stored(2, cbuf[half][2], 64);
    }
    if (cnt > 3) {
      _tile_zero(3);
      sums(g0 + 3, std::integral_constant<int, 3>{});
      _tile_stored(3, cbuf[half][3], 64);
    }
  };
  auto epilogue = [&](int64_t g0, int cnt, int half) {
    for (int i = 0; i < cnt; ++i) {
      const int64_t g = g0 + i;
      const __m512 s = zmm_f16<MODE>(A.s0 + g * A.sstride, A.s1 + g * A.sstride);
      if constexpr (FMT == INT4A) {
        const __m512 b = zmm_f16<MODE>(A.m0 + g * A.sstride, A.m1 + g * A.sstride);
        #pragma GCC unroll 16
        for (int m = 0; m < 16; ++m)
          if (FULL || m < rows) {
            const __m512 sxv = _mm512_set1_ps(X.sx[m * X.ldg + g]);
            const __m512i ci = _mm512_load_si512(cbuf[half][i][m]);
            acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(s, sxv), _mm512_cvtepi32_ps(ci), acc[m]);
            acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(b, sxv), _mm512_set1_ps(X.qs[m * X.ldg + g]), acc[m]);
          }
      } else {
        #pragma GCC unroll 16
        for (int m = 0; m < 16; ++m)
          if (FULL || m < rows) {
            const __m512i ci = _mm512_load_si512(cbuf[half][i][m]);
            acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(X.sx[m * X.ldg + g])), _mm512_cvtepi32_ps(ci),
                                     acc[m]);
          }
      }
    }
  };
  int half = 0;
  for (int64_t g0 = 0; g0 < ng; g0 += 4, half ^= 1) {  // batch g0 issued, then the epilogue of the one before
    issue(g0, (int)std::min<int64_t>(4, ng - g0), half);
    if (g0) epilogue(g0 - 4, 4, half ^ 1);
  }
  const int64_t last = (ng - 1) / 4 * 4;
  epilogue(last, (int)(ng - last), half ^ 1);
  #pragma GCC unroll 16
  for (int m = 0; m < 16; ++m)
    if (FULL || m < rows) {
      if constexpr (MODE == kSingle) _mm256_storeu_ps(out + m * ldo, _mm512_castps512_ps256(acc[m]));
      else _mm512_storeu_ps(out + m * ldo, acc[m]);
    }
}

template <int FMT, int MODE>
void amx_rows(const ZmmOperand& A, const AmxActs& X, float* out, int64_t ldo, int64_t n) {
  const int8_t* panel = amx_panel<FMT, MODE>(A);
  const int kc = amx_chunk(A.gs);
  for (int64_t m0 = 0; m0 < n; m0 += 16) {
    const int rows = (int)std::min<int64_t>(16, n - m0);
    moegate::TileConfig cfg;
    for (int c = 0; c < 2; ++c) {
      cfg.set(c, rows, 64);
      cfg.set(2 + c, rows, 64);
      cfg.set(4 + c, rows, kc);
      cfg.set(6 + c, kc / 4, 64);
    }
    moegate::configure_tiles(cfg);
    const AmxActs Xb{X.q + m0 * X.ldq, X.ldq, X.sx + m0 * X.ldg, X.qs + m0 * X.ldg, X.ldg};
    if (rows == 16) amx_block<FMT, MODE, true>(panel, A, Xb, out + m0 * ldo, ldo, rows, kc);
    else amx_block<FMT, MODE, false>(panel, A, Xb, out + m0 * ldo, ldo, rows, kc);
  }
  moegate::release_tiles();  // the OS need not save tile data on a context switch from here on
}

// Unit `u` of a tiled a8 projection (zmm_unit_rows' units: R8 = 2 the gate_up tile first + u; R8 = 1 the tiles
// first + 2u and first + 2u + 1 if 2u + 1 < n8) over n activation rows; row m's 16 (single tile: 8) outputs at
// out + m * ldo.
template <int FMT, int R8>
void amx_unit_rows(const Mat& M, int64_t first, int64_t u, int64_t n8, const AmxActs& X, float* out, int64_t ldo,
                   int64_t n) {
  if constexpr (FMT == I8A8 || FMT == INT4 || FMT == INT4A) {
    const int64_t ng = M.kp / M.gs, kb = FMT == I8A8 ? M.kp / 4 : M.kp / 8;  // weight blocks of 4 (int4: 8) k
    const uint8_t* w = static_cast<const uint8_t*>(M.w);
    if constexpr (R8 == 2) {
      const int64_t t = first + u;
      const uint16_t* mn = FMT == INT4A ? M.mins + t * ng * 16 : nullptr;
      const ZmmOperand A{w + t * kb * 64, nullptr, M.scales + t * ng * 16, nullptr, mn, nullptr, 64, 16, M.kp,
                         M.gs, kb * 64};
      amx_rows<FMT, kContig>(A, X, out, ldo, n);
    } else {
      const int64_t t = first + 2 * u;
      const uint16_t* mn = FMT == INT4A ? M.mins + t * ng * 8 : nullptr;
      const ZmmOperand A{w + t * kb * 32, w + (t + 1) * kb * 32, M.scales + t * ng * 8,
                         M.scales + (t + 1) * ng * 8, mn, mn ? mn + ng * 8 : nullptr, 32, 8, M.kp, M.gs, kb * 32};
      if (2 * u + 1 < n8) amx_rows<FMT, kPair>(A, X, out, ldo, n);
      else amx_rows<FMT, kSingle>(A, X, out, ldo, n);
    }
  }
}

}  // namespace

#endif  // MOEGATE_ZMM
