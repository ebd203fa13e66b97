// bf16 weights x bf16 activations (format bf16_a16) on AMX tdpbf16ps, in the avx512 variant when the CPU has
// AMX-BF16, the OS granted tile data and the path limit allows it (paths.h amx_bf16_here; the functions carry
// their own target attribute). Included by moe_cpu.cpp after bf16_zmm.h, whose unit loads and pair permutes
// it reuses.
//
// A unit of 16 output lanes (a gate_up tile, two down / dense tiles, or the last single one) is cut into
// chunks of 32 k. tdpbf16ps wants B as [16 k pairs][16 lanes][2] (one (w[k], w[k+1]) dword per lane); the
// packed bf16 layout holds [k lanes 0..15][k+1 lanes 0..15], so each chunk is permuted (vpermw, as the
// vdpbf16ps path does per pair) into a 1 KiB B tile in a per-thread scratch, once per unit and call: the
// first pass over a unit's rows repacks chunk by chunk as it goes, later passes (more than 64 rows) reuse it.
// Activations come as contiguous rows of bf16 bits (`lda` elements apart, zero past kp up to the chunks'
// end); a pass takes up to 64 rows: three 16-row blocks in C tiles 0..2 and the last 1..16 rows in C tile 3,
// whose row count is part of the tile configuration (no row past the caller's is ever read or written).
//
// Batch invariance: every C tile starts at zero and takes the unit's chunks in k order, and tdpbf16ps
// computes each output row from its own A row alone, so a row's bits depend neither on M, nor on the other
// rows, nor on the block or tile it lands in. They are not the vdpbf16ps path's bits: tdpbf16ps rounds its
// sums its own way (no order of vdpbf16ps pairs, nor fp32 steps per product, nor one rounding of the exact
// sum reproduced it: docs/kernels.md "AMX bf16 tiles"), so where AMX is allowed bf16_a16 runs on it at
// every M, decode included.
#pragma once

#ifdef MOEGATE_ZMM

namespace {

#define MOEGATE_AMX_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16")))

constexpr int64_t kAmxK = 32;  // k per tile chunk (16 pairs)

// k rounded up to whole chunks: the row length (in bf16) AMX activation rows need.
inline int64_t amx_bf16_kp(int64_t kp) { return (kp + kAmxK - 1) / kAmxK * kAmxK; }

inline bool amx_bf16_used() { return moegate::amx_bf16_here(); }

// C 0..2 and A 4: full 16-row blocks; C 3 and A 5: the pass's last `last` rows; B 6.
inline moegate::TileConfig amx_bf16_config(int last) {
  moegate::TileConfig c;
  for (int t = 0; t < 3; ++t) c.set(t, 16, 64);
  c.set(3, last, 64);
  c.set(4, 16, 64);
  c.set(5, last, 64);
  c.set(6, 16, 64);
  return c;
}

// B tile of chunk kc: 16 (w[k], w[k+1]) dwords per pair row, zeros past kp.
template <int MODE>
MOEGATE_AMX_BF16_TARGET void amx_bf16_repack(const uint16_t* w0, const uint16_t* w1, int64_t stride, int64_t kp,
                                             int64_t kc, uint16_t* b) {
  const __m512i perm = bf16_pair_index<MODE>();
  for (int p = 0; p < 16; ++p) {
    const int64_t k = kc * kAmxK + 2 * p;
    __m512i v = _mm512_setzero_si512();
    if (k < kp) {
      __builtin_prefetch(w0 + k * stride + kPrefetch / 2, 0, 3);
      if constexpr (MODE == kPair) __builtin_prefetch(w1 + k * stride + kPrefetch / 2, 0, 3);
      v = _mm512_permutexvar_epi16(perm, bf16_load<MODE>(w0, w1, stride, k, k + 1 < kp));
    }
    _mm512_store_si512(b + p * 32, v);
  }
}

// One pass over NF full row blocks and a last block: C rows = a rows . unit, stored `ldc` floats apart from c
// (16 per row). `repack`: write each chunk's B tile into b first (the unit's first pass).
template <int MODE, int NF>
MOEGATE_AMX_BF16_TARGET void amx_bf16_pass(const uint16_t* w0, const uint16_t* w1, int64_t stride, int64_t kp,
                                           bool repack, uint16_t* b, const uint16_t* a, int64_t lda, float* c,
                                           int64_t ldc) {
  const int64_t nk = amx_bf16_kp(kp) / kAmxK, sa = lda * 2, sc = ldc * 4;
  if constexpr (NF >= 1) _tile_zero(0);
  if constexpr (NF >= 2) _tile_zero(1);
  if constexpr (NF >= 3) _tile_zero(2);
  _tile_zero(3);
  if (repack) amx_bf16_repack<MODE>(w0, w1, stride, kp, 0, b);
  for (int64_t kc = 0; kc < nk; ++kc) {
    uint16_t* bk = b + kc * 512;
    // one chunk ahead: tileloadd reads a B tile whose stores have had a chunk's time to reach L1
    if (repack && kc + 1 < nk) amx_bf16_repack<MODE>(w0, w1, stride, kp, kc + 1, bk + 512);
    asm volatile("" : : : "memory");  // the B tile's stores before tileloadd reads them
    _tile_loadd(6, bk, 64);
    const uint16_t* ak = a + kc * kAmxK;
    if constexpr (NF >= 1) {
      _tile_loadd(4, ak, sa);
      _tile_dpbf16ps(0, 4, 6);
    }
    if constexpr (NF >= 2) {
      _tile_loadd(4, ak + 16 * lda, sa);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (NF >= 3) {
      _tile_loadd(4, ak + 32 * lda, sa);
      _tile_dpbf16ps(2, 4, 6);
    }
    _tile_loadd(5, ak + NF * 16 * lda, sa);
    _tile_dpbf16ps(3, 5, 6);
  }
  if constexpr (NF >= 1) _tile_stored(0, c, sc);
  if constexpr (NF >= 2) _tile_stored(1, c + 16 * ldc, sc);
  if constexpr (NF >= 3) _tile_stored(2, c + 32 * ldc, sc);
  _tile_stored(3, c + NF * 16 * ldc, sc);
  asm volatile("" : : : "memory");  // the C stores before the caller reads them
}

// The calling thread's B scratch: at least n bf16, 64-byte aligned.
inline uint16_t* amx_bf16_scratch(int64_t n) {
  thread_local std::vector<uint16_t> buf;
  if ((int64_t)buf.size() < n + 32) buf.resize(n + 32);
  return reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
}

// out[i * ldo + 0 .. cols) = unit lanes . a[i * lda ..] for rows i in [0, n), cols 16 (8: kSingle).
template <int MODE>
void amx_bf16_rows(const uint16_t* w0, const uint16_t* w1, int64_t stride, int64_t kp, const uint16_t* a,
                   int64_t lda, float* out, int64_t ldo, int n) {
  constexpr int cols = MODE == kSingle ? 8 : 16;
  uint16_t* b = amx_bf16_scratch(amx_bf16_kp(kp) * 16);
  alignas(64) float cbuf[64 * 16];
  for (int r0 = 0; r0 < n; r0 += 64) {
    const int rows = std::min(64, n - r0), nf = (rows - 1) / 16;
    moegate::configure_tiles(amx_bf16_config(rows - 16 * nf));
    float* c = cols == 16 ? out + r0 * ldo : cbuf;
    const int64_t ldc = cols == 16 ? ldo : 16;
    const uint16_t* ar = a + r0 * lda;
    const bool repack = r0 == 0;
    switch (nf) {
      case 0: amx_bf16_pass<MODE, 0>(w0, w1, stride, kp, repack, b, ar, lda, c, ldc); break;
      case 1: amx_bf16_pass<MODE, 1>(w0, w1, stride, kp, repack, b, ar, lda, c, ldc); break;
      case 2: amx_bf16_pass<MODE, 2>(w0, w1, stride, kp, repack, b, ar, lda, c, ldc); break;
      default: amx_bf16_pass<MODE, 3>(w0, w1, stride, kp, repack, b, ar, lda, c, ldc); break;
    }
    if constexpr (cols != 16)
      for (int i = 0; i < rows; ++i) std::memcpy(out + (r0 + i) * ldo, cbuf + i * 16, sizeof(float) * cols);
  }
  moegate::release_tiles();  // no tile state left for the OS to save while this thread does other work
}

// Unit `u` of a tiled bf16 projection (as zmm_bf16_unit_rows): R8 = 2 the gate_up tile first + u, R8 = 1 the
// tiles first + 2u and first + 2u + 1 (if 2u + 1 < n8; else the last single tile, 8 columns).
template <int R8>
void amx_bf16_unit_rows(const Mat& M, int64_t first, int64_t u, int64_t n8, const uint16_t* a, int64_t lda,
                        float* out, int64_t ldo, int n) {
  const uint16_t* w = static_cast<const uint16_t*>(M.w);
  if constexpr (R8 == 2) {
    amx_bf16_rows<kContig>(w + (first + u) * M.kp * 16, nullptr, 16, M.kp, a, lda, out, ldo, n);
  } else {
    const uint16_t* w0 = w + (first + 2 * u) * M.kp * 8;
    if (2 * u + 1 < n8) amx_bf16_rows<kPair>(w0, w0 + M.kp * 8, 8, M.kp, a, lda, out, ldo, n);
    else amx_bf16_rows<kSingle>(w0, nullptr, 8, M.kp, a, lda, out, ldo, n);
  }
}

}  // namespace

#endif  // MOEGATE_ZMM
