// SIMD primitives for the MoE kernel: 8 fp32 lanes (V8), 8 int32 lanes (I8), an 8-row x 8-k int4
// block (U4). AVX2 + FMA + F16C intrinsics when compiled with them, plain loops otherwise; both
// compute the same values (the generic fma is a*b+c, not contracted: -ffp-contract=off).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define MOEGATE_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define MOEGATE_VNNI 1  // the avx512 variant
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define MOEGATE_ZMM 1  // 512-bit W4A8 units (w4a8_zmm.h): 16 output rows per vpdpbusd, up to 8 rows per block
#endif
#endif
#endif

namespace {

// Rows [0, n) in chunks of up to 8 for kernels unrolled per row count: f(std::integral_constant<int, MT>{}, i)
// for rows [i, i + MT), chunks of 8 from row 0, then the rest as one chunk.
template <class F>
inline void for_row_chunks(int n, F&& f) {
  int i = 0;
  for (; i + 8 <= n; i += 8) f(std::integral_constant<int, 8>{}, i);
  switch (n - i) {
    case 7: f(std::integral_constant<int, 7>{}, i); break;
    case 6: f(std::integral_constant<int, 6>{}, i); break;
    case 5: f(std::integral_constant<int, 5>{}, i); break;
    case 4: f(std::integral_constant<int, 4>{}, i); break;
    case 3: f(std::integral_constant<int, 3>{}, i); break;
    case 2: f(std::integral_constant<int, 2>{}, i); break;
    case 1: f(std::integral_constant<int, 1>{}, i); break;
    default: break;
  }
}

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
inline V8 v_add(V8 a, V8 b) { return {_mm256_add_ps(a.v, b.v)}; }
inline V8 v_sub(V8 a, V8 b) { return {_mm256_sub_ps(a.v, b.v)}; }
// r[i].v[j] <- r[j].v[i] (an 8 x 8 transpose: moves only)
inline void v_transpose8(V8* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i].v, r[i + 1].v);
    t[i + 1] = _mm256_unpackhi_ps(r[i].v, r[i + 1].v);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i].v = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4].v = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}
inline V8 v_fma(V8 a, V8 b, V8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline V8 v_fma_exact(V8 a, V8 b, V8 c) { return v_fma(a, b, c); }  // single rounding
inline V8 v_div(V8 a, V8 b) { return {_mm256_div_ps(a.v, b.v)}; }
inline V8 v_min(V8 a, V8 b) { return {_mm256_min_ps(a.v, b.v)}; }
inline V8 v_max(V8 a, V8 b) { return {_mm256_max_ps(a.v, b.v)}; }
inline V8 v_round(V8 a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }  // half even
inline V8 v_pow2(V8 n) {  // 2^n for integer-valued n in [-126, 127], from the exponent bits
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23))};
}
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
inline I8 i_add(I8 a, I8 b) { return {_mm256_add_epi32(a.v, b.v)}; }
inline V8 i_cvt(I8 a) { return {_mm256_cvtepi32_ps(a.v)}; }
// acc[row] += sum over the 8 k of u[row][k] * q[k]; q = 8 int8 activations for this k block (exact
// integer sums). The avx512 build runs W4A8 on zmm instead (w4a8_zmm.h).
template <int R8, int MT>
inline void w4a8_block(const U4* w, const int8_t* const* q, int64_t off, I8 (*acc)[R8]) {
  const __m256i m15 = _mm256_set1_epi8(15);
  const __m256i ones = _mm256_set1_epi16(1);
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
inline V8 v_add(V8 a, V8 b) { V8 r; for (int i = 0; i < 8; ++i) r.v[i] = a.v[i] + b.v[i]; return r; }
inline V8 v_sub(V8 a, V8 b) { V8 r; for (int i = 0; i < 8; ++i) r.v[i] = a.v[i] - b.v[i]; return r; }
inline void v_transpose8(V8* r) {  // r[i].v[j] <- r[j].v[i]
  for (int i = 0; i < 8; ++i)
    for (int j = i + 1; j < 8; ++j) std::swap(r[i].v[j], r[j].v[i]);
}
inline V8 v_fma(V8 a, V8 b, V8 c) {
  V8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i];  // not contracted: -ffp-contract=off
  return r;
}
inline V8 v_fma_exact(V8 a, V8 b, V8 c) {  // single rounding, bitwise equal to the AVX2 fma
  V8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return r;
}
inline float bits_to_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline V8 v_div(V8 a, V8 b) { V8 r; for (int i = 0; i < 8; ++i) r.v[i] = a.v[i] / b.v[i]; return r; }
inline V8 v_min(V8 a, V8 b) { V8 r; for (int i = 0; i < 8; ++i) r.v[i] = a.v[i] < b.v[i] ? a.v[i] : b.v[i]; return r; }
inline V8 v_max(V8 a, V8 b) { V8 r; for (int i = 0; i < 8; ++i) r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i]; return r; }
inline V8 v_round(V8 a) { V8 r; for (int i = 0; i < 8; ++i) r.v[i] = std::nearbyint(a.v[i]); return r; }  // half even
inline V8 v_pow2(V8 n) {
  V8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = bits_to_f32((uint32_t)((int32_t)n.v[i] + 127) << 23);
  return r;
}
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
inline I8 i_add(I8 a, I8 b) { I8 r; for (int i = 0; i < 8; ++i) r.v[i] = a.v[i] + b.v[i]; return r; }
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

}  // namespace
