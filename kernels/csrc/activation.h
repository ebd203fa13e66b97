// The experts' gated activation (kernels/formats.py Activation), 8 lanes at a time. Included by moe_cpu.cpp.
//
// SiLU(g) * u in float: SiLU(g) = g / (1 + exp(-g)) with exp as Cephes' expf (the argument clamped to
// [-87, 88], range reduction by a two-part ln 2, a degree-6 polynomial, 2^n built from the exponent bits).
// Every step is one IEEE operation (no fma, -ffp-contract=off), so the avx512 / avx2 builds (ymm), the
// generic build (plain loops) and the torch reference (kernels/silu.py) give the same bits. It replaced a
// scalar SiLU in double (libm exp and a double division: ~20% of an M = 128 int4 MoE call); the result
// differs from the double one by a few float ulps of SiLU (the exp's error, ~1e-7 relative).
// GPT-OSS's clamped SwiGLU keeps its sigmoid in double, rounded once, lane by lane.
#pragma once

namespace {

// e^x (float), x clamped to [-87, 88] so that n = round(x log2 e) stays in [-126, 127] (a normal 2^n).
inline V8 v_exp(V8 x) {
  x = v_min(v_max(x, v_set1(-87.f)), v_set1(88.f));
  const V8 n = v_round(v_mul(x, v_set1(1.44269504088896341f)));
  const V8 r = v_sub(v_sub(x, v_mul(n, v_set1(0.693359375f))), v_mul(n, v_set1(-2.12194440e-4f)));
  V8 p = v_set1(1.9875691500e-4f);
  p = v_add(v_mul(p, r), v_set1(1.3981999507e-3f));
  p = v_add(v_mul(p, r), v_set1(8.3334519073e-3f));
  p = v_add(v_mul(p, r), v_set1(4.1665795894e-2f));
  p = v_add(v_mul(p, r), v_set1(1.6666665459e-1f));
  p = v_add(v_mul(p, r), v_set1(5.0000001201e-1f));
  p = v_add(v_add(v_mul(p, v_mul(r, r)), r), v_set1(1.f));
  return v_mul(p, v_pow2(n));
}

inline V8 v_silu(V8 g) { return v_div(g, v_add(v_set1(1.f), v_exp(v_sub(v_zero(), g)))); }

enum ActKind { ACT_SILU = 0, ACT_SWIGLU_CLAMPED = 1 };

struct Act {
  int kind = ACT_SILU;
  float alpha = 1.f, limit = 0.f;

  // act(gate, up) for 8 lanes
  V8 operator()(V8 g, V8 u) const {
    if (kind == ACT_SILU) return v_mul(v_silu(g), u);
    float gs[8], us[8];
    v_store(gs, g);
    v_store(us, u);
    for (int c = 0; c < 8; ++c) {
      const float gc = std::min(gs[c], limit), uc = std::min(limit, std::max(-limit, us[c]));
      gs[c] = (uc + 1.f) * (float)((double)gc / (1.0 + std::exp(-(double)alpha * (double)gc)));
    }
    return v_load(gs);
  }
};

}  // namespace
