// W8A8 (int8_a8): int8 weights times int8 activations, llama.cpp Q8_0's arithmetic. Included by moe_cpu.cpp
// after w4a8_zmm.h, whose zmm pieces (ZmmOperand, zmm_weights, zmm_f16, the prefetches) it reuses.
//
// Weights: per row and group of gs along K an fp16 scale s, q_w in [-127, 127]; tiles hold blocks of 4 k,
// one dword per row ([N8][Kp / 4][R8][8][4] int8, byte c = k0 + c). Activations: the W4A8 quantizer
// (quantize_row: per token and group of gs, symmetric, s_x = amax / 127, round half to even), so a group's
// dot product is one exact integer sum(q_w q_x) and each group adds fma(s * s_x, sum(q_w q_x), acc) in
// group order. The integer sum is exact on every path, so all paths give the same bits:
//  - zmm (avx512 VNNI): vpdpbusd multiplies u8 x s8, so the weights are offset to u = q_w + 128 (a xor
//    with 0x80) and the accumulator starts at -128 * sum(q_x) (the activation-side correction, as W4A8's
//    -8 * sum(q)): sum(u q_x) - 128 sum(q_x) = sum(q_w q_x). 16 output rows x 4 k per instruction, up to 8
//    activation rows per weight block.
//  - avx2: maddubs(|q_w|, sign(q_x, q_w)): |products| <= 127 * 127, so a pair sum never saturates int16.
//  - generic: plain integer loops.
#pragma once

namespace {

// acc[m][r] += sum over the 4 k of block `w` (R8 row sets of 8 dwords) times q[m][off .. off + 4).
template <int R8, int MT>
inline void w8a8_block(const int8_t* w, const int8_t* const* q, int64_t off, I8 (*acc)[R8]) {
#ifdef MOEGATE_AVX2
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i wv[R8], wa[R8];
  for (int r = 0; r < R8; ++r) {
    wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * 32));
    wa[r] = _mm256_abs_epi8(wv[r]);
  }
  for (int m = 0; m < MT; ++m) {
    int32_t a;
    std::memcpy(&a, q[m] + off, 4);
    const __m256i xa = _mm256_set1_epi32(a);
    for (int r = 0; r < R8; ++r) {
      const __m256i p = _mm256_maddubs_epi16(wa[r], _mm256_sign_epi8(xa, wv[r]));
      acc[m][r].v = _mm256_add_epi32(acc[m][r].v, _mm256_madd_epi16(p, ones));
    }
  }
#else
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R8; ++r)
      for (int i = 0; i < 8; ++i) {
        int32_t sum = 0;
        for (int c = 0; c < 4; ++c) sum += (int32_t)w[r * 32 + 4 * i + c] * q[m][off + c];
        acc[m][r].v[i] += sum;
      }
#endif
}

// out[m] = tile rows . dequant(q[m]) (avx2, generic), sx[m] the per-group activation scales. Integer sums
// are split over S accumulator sets (block parity when few rows leave the core idle) and added exactly.
template <int R8, int MT>
void tile_dot_w8a8(const Mat& A, int64_t tile, const int8_t* const* q, const float* const* sx, float* const* out) {
  constexpr int S = MT * R8 <= 2 ? 2 : 1;
  V8 acc[MT][R8];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R8; ++r) acc[m][r] = v_zero();
  const int64_t kp = A.kp, gs = A.gs, ng = kp / gs, bpg = gs / 4;  // gs is a multiple of 8: bpg even
  const uint16_t* sc = A.scales + tile * ng * R8 * 8;
  const int8_t* w = static_cast<const int8_t*>(A.w) + tile * kp * R8 * 8;
  for (int64_t g = 0; g < ng; ++g) {
    I8 isum[S][MT][R8];
    for (int p = 0; p < S; ++p)
      for (int m = 0; m < MT; ++m)
        for (int r = 0; r < R8; ++r) isum[p][m][r] = i_zero();
    for (int64_t kb = g * bpg; kb < (g + 1) * bpg; kb += S) {
      prefetch_ahead(w + kb * R8 * 32, S * R8 * 32);
#pragma GCC unroll 2
      for (int p = 0; p < S; ++p) w8a8_block<R8, MT>(w + (kb + p) * R8 * 32, q, (kb + p) * 4, isum[p]);
    }
    for (int p = 1; p < S; ++p)
      for (int m = 0; m < MT; ++m)
        for (int r = 0; r < R8; ++r) isum[0][m][r] = i_add(isum[0][m][r], isum[p][m][r]);
    for (int r = 0; r < R8; ++r) {
      const V8 s = load_f16(sc + (g * R8 + r) * 8);
      for (int m = 0; m < MT; ++m)
        acc[m][r] = v_fma_exact(v_mul(s, v_bcast(sx[m] + g)), i_cvt(isum[0][m][r]), acc[m][r]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R8; ++r) v_store(out[m] + r * 8, acc[m][r]);
}

template <int R8>
void tile_rows_w8a8(const Mat& A, int64_t tile, const int8_t* const* q, const float* const* sx, float* const* out,
                    int n) {
  int i = 0;
  for (; i + 4 <= n; i += 4) tile_dot_w8a8<R8, 4>(A, tile, q + i, sx + i, out + i);
  switch (n - i) {
    case 3: tile_dot_w8a8<R8, 3>(A, tile, q + i, sx + i, out + i); break;
    case 2: tile_dot_w8a8<R8, 2>(A, tile, q + i, sx + i, out + i); break;
    case 1: tile_dot_w8a8<R8, 1>(A, tile, q + i, sx + i, out + i); break;
    default: break;
  }
}

#ifdef MOEGATE_ZMM

// out[m][0 .. 16) (kSingle: [0 .. 8)) = unit rows . dequant(q[m]) for MT activation rows on vpdpbusd;
// qs[m]: per-group sum(q) as float (an exact integer).
template <int MODE, int MT>
void zmm_w8a8(const ZmmOperand& A, const int8_t* const* q, const float* const* sx, const float* const* qs,
              float* const* out) {
  // Independent integer chains per row (block index mod NC) when few rows would leave the vpdpbusd latency
  // exposed: exact integer sums, the split never changes a result.
  constexpr int NC = MT >= 4 ? 1 : MT >= 2 ? 2 : 4;
  const __m512i flip = _mm512_set1_epi8((char)0x80);  // q_w -> q_w + 128 as u8
  __m512 acc[MT];
  #pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t ng = A.kp / A.gs, bpg = A.gs / 4;  // groups, 4-k blocks per group
  for (int64_t g = 0; g < ng; ++g) {
    __m512i isum[NC][MT];
    #pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) {
      isum[0][m] = _mm512_set1_epi32(-128 * (int32_t)qs[m][g]);
      #pragma GCC unroll 16
      for (int c = 1; c < NC; ++c) isum[c][m] = _mm512_setzero_si512();
    }
    auto block = [&](int64_t kb, auto c_c) {  // c: a compile-time chain index (run-time ones spill)
      constexpr int c = decltype(c_c)::value;
      if constexpr (MODE == kContig) zmm_prefetch(A.w0 + kb * A.wstride);
      else if (!(kb & 1)) {  // 32-byte blocks: one prefetch per 64-byte line of each stream
        if constexpr (MODE == kPair) pair_prefetch(A.w0, A.w1, kb * A.wstride, A.tile_bytes);
        else zmm_prefetch(A.w0 + kb * A.wstride);
      }
      const __m512i w = _mm512_xor_si512(zmm_weights<MODE>(A, kb), flip);
      #pragma GCC unroll 16
      for (int m = 0; m < MT; ++m) isum[c][m] = dpbusd_bcast(isum[c][m], w, q[m] + kb * 4);
    };
    const int64_t kb0 = g * bpg;
    int64_t j = 0;
    if constexpr (NC == 4)
      for (; j + 4 <= bpg; j += 4) {
        block(kb0 + j, std::integral_constant<int, 0>{});
        block(kb0 + j + 1, std::integral_constant<int, 1>{});
        block(kb0 + j + 2, std::integral_constant<int, 2>{});
        block(kb0 + j + 3, std::integral_constant<int, 3>{});
      }
    if constexpr (NC >= 2)
      for (; j + 2 <= bpg; j += 2) {
        block(kb0 + j, std::integral_constant<int, 0>{});
        block(kb0 + j + 1, std::integral_constant<int, NC - 1>{});
      }
    for (; j < bpg; ++j) block(kb0 + j, std::integral_constant<int, 0>{});
    #pragma GCC unroll 16
    for (int c = 1; c < NC; ++c)
      #pragma GCC unroll 16
      for (int m = 0; m < MT; ++m) isum[0][m] = _mm512_add_epi32(isum[0][m], isum[c][m]);
    const __m512 s = zmm_f16<MODE>(A.s0 + g * A.sstride, A.s1 + g * A.sstride);
    #pragma GCC unroll 16
    for (int m = 0; m < MT; ++m)
      acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(sx[m][g])), _mm512_cvtepi32_ps(isum[0][m]), acc[m]);
  }
  store_unit_rows<MODE, MT>(acc, out);
}

template <int MODE>
void zmm_rows_w8a8(const ZmmOperand& A, const int8_t* const* q, const float* const* sx, const float* const* qs,
                   float* const* out, int n) {
  for_row_chunks(n, [&](auto mt, int i) { zmm_w8a8<MODE, decltype(mt)::value>(A, q + i, sx + i, qs + i, out + i); });
}

#endif  // MOEGATE_ZMM

// Item `u` of a tiled int8_a8 projection, `n` activation rows. On zmm an item is a unit as in
// zmm_unit_rows (R8 = 2: the gate_up tile first + u; R8 = 1: tiles first + 2u and first + 2u + 1 if
// 2u + 1 < n8); elsewhere the tile first + u.
template <int R8>
void w8a8_rows(const Mat& M, int64_t first, int64_t u, int64_t n8, const int8_t* const* q, const float* const* sx,
               const float* const* qs, float* const* out, int n) {
#ifdef MOEGATE_ZMM
  const int64_t ng = M.kp / M.gs, kb = M.kp / 4;
  const uint8_t* w = static_cast<const uint8_t*>(M.w);
  if constexpr (R8 == 2) {
    const int64_t t = first + u;
    const ZmmOperand A{w + t * kb * 64, nullptr, M.scales + t * ng * 16, nullptr, nullptr, nullptr, 64, 16, M.kp,
                       M.gs, kb * 64};
    zmm_rows_w8a8<kContig>(A, q, sx, qs, out, n);
  } else {
    const int64_t t = first + 2 * u;
    const bool pair = 2 * u + 1 < n8;
    const ZmmOperand A{w + t * kb * 32, w + (t + 1) * kb * 32, M.scales + t * ng * 8, M.scales + (t + 1) * ng * 8,
                       nullptr, nullptr, 32, 8, M.kp, M.gs, kb * 32};
    // Both tiles side by side at every row count (as W4A8, zmm_unit_rows): one tile alone left half of each
    // vpdpbusd idle (one row on one core in cache: 16.4 GB/s, side by side 22.3).
    if (pair) zmm_rows_w8a8<kPair>(A, q, sx, qs, out, n);
    else zmm_rows_w8a8<kSingle>(A, q, sx, qs, out, n);
  }
#else
  (void)n8;
  (void)qs;
  tile_rows_w8a8<R8>(M, first + u, q, sx, out, n);
#endif
}

}  // namespace
