// Causal grouped-query attention over a paged fp32 KV cache, one (token, head) at a time: the attention of
// the one-call decode layer (decode_layer.h) and of the torch modules' CPU fp32 path (kernels/attention.py,
// prefill included). Each (token, head) is a fixed sequence of operations over its own context only
// (scores in key order, max, exp and sum in key order, p-weighted values summed in key order), so its
// bits never depend on the other tokens of the call, on how a prompt is cut into chunks, or on threads.
// The softmax's exp is activation.h's float `v_exp`, 8 keys at a time (until 2026-11-26 libm's expf, one key
// at a time; the float exp takes ~16% off a 128-token prefill's attention at D = 64, the value bits change
// within fp32 rounding). Scores are computed eight keys at a time (dot8) and the weighted values 64 lanes at a
// time held in registers across the keys, each score and each output lane by the same operations in the same
// order as one dot() per key and one running sum per lane: the bits are those of the one-key-at-a-time loop.
// Included by moe_cpu.cpp after activation.h, before decode_layer.h.
#pragma once

namespace {

// a . b over n floats: two 8-lane accumulators (a scalar fp32 reduction is latency-bound: ~4 cycles
// per element), then the lanes in a fixed order.
float dot(const float* a, const float* b, int64_t n) {
  V8 acc0 = v_zero(), acc1 = v_zero();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = v_fma(v_load(a + i), v_load(b + i), acc0);
    acc1 = v_fma(v_load(a + i + 8), v_load(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = v_fma(v_load(a + i), v_load(b + i), acc0);
  float lanes[8];
  v_store(lanes, v_add(acc0, acc1));
  float s = 0.f;
  for (int c = 0; c < 8; ++c) s += lanes[c];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// dot's per-lane sums (acc0 + acc1, before the lane sum and the tail past n / 8 * 8) of a against the four
// rows b_j, each by dot's own operations in dot's order: four independent chains (one dot alone waits on its
// fma latency).
// (On zmm acc0 and acc1 are the low and high halves of one register: the same fmas, half the instructions.)
void dot_lanes4(const float* a, const float* const* b, int64_t n, V8* u) {
  V8 acc0[4], acc1[4];
  int64_t i = 0;
#ifdef MOEGATE_ZMM
  __m512 acc[4];
  for (int j = 0; j < 4; ++j) acc[j] = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 a01 = _mm512_loadu_ps(a + i);
    for (int j = 0; j < 4; ++j) acc[j] = _mm512_fmadd_ps(a01, _mm512_loadu_ps(b[j] + i), acc[j]);
  }
  for (int j = 0; j < 4; ++j) {
    acc0[j].v = _mm512_castps512_ps256(acc[j]);
    acc1[j].v = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[j]), 1));
  }
#else
  for (int j = 0; j < 4; ++j) acc0[j] = acc1[j] = v_zero();
  for (; i + 16 <= n; i += 16) {
    const V8 a0 = v_load(a + i), a1 = v_load(a + i + 8);
    for (int j = 0; j < 4; ++j) {
      acc0[j] = v_fma(a0, v_load(b[j] + i), acc0[j]);
      acc1[j] = v_fma(a1, v_load(b[j] + i + 8), acc1[j]);
    }
  }
#endif
  for (; i + 8 <= n; i += 8) {
    const V8 a0 = v_load(a + i);
    for (int j = 0; j < 4; ++j) acc0[j] = v_fma(a0, v_load(b[j] + i), acc0[j]);
  }
  for (int j = 0; j < 4; ++j) u[j] = v_add(acc0[j], acc1[j]);
}

// dot(a, b_j, n) for the eight rows b_j, the same bits as eight dot calls: the per-lane sums transposed so
// that one vector add per lane sums lane c of all eight in dot's order (0 + lane 0 + ... + lane 7), then
// the tail elements one at a time.
void dot8(const float* a, const float* const* b, int64_t n, float* s) {
  V8 u[8];
  dot_lanes4(a, b, n, u);
  dot_lanes4(a, b + 4, n, u + 4);
  v_transpose8(u);
  V8 sum = v_zero();
  for (int c = 0; c < 8; ++c) sum = v_add(sum, u[c]);
  v_store(s, sum);
  for (int64_t i = n / 8 * 8; i < n; ++i)
    for (int j = 0; j < 8; ++j) s[j] += a[i] * b[j][i];
}

// out[d0 .. d0 + 8 NB) = sum over the keys in key order of p_j * v_j[d] (a product, then a sum:
// -ffp-contract=off), the 8 NB output lanes held in registers across all keys.
// On zmm (the avx512 build) two 8-lane blocks share one 16-lane register: the same products and sums.
template <int NB>
inline void weighted_values(const float* p, const float* v_cache, int64_t row, int64_t off, const int64_t* slots,
                            int64_t n, int64_t d0, float* out) {
#ifdef MOEGATE_ZMM
  if constexpr (NB % 2 == 0) {
    __m512 o[NB / 2];
    for (int c = 0; c < NB / 2; ++c) o[c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const float* vv = v_cache + slots[j] * row + off + d0;
      const __m512 pj = _mm512_set1_ps(p[j]);
      for (int c = 0; c < NB / 2; ++c) o[c] = _mm512_add_ps(o[c], _mm512_mul_ps(pj, _mm512_loadu_ps(vv + 16 * c)));
    }
    for (int c = 0; c < NB / 2; ++c) _mm512_storeu_ps(out + d0 + 16 * c, o[c]);
    return;
  }
#endif
  V8 o[NB];
  for (int c = 0; c < NB; ++c) o[c] = v_zero();
  for (int64_t j = 0; j < n; ++j) {
    const float* vv = v_cache + slots[j] * row + off + d0;
    const V8 pj = v_set1(p[j]);
    for (int c = 0; c < NB; ++c) o[c] = v_add(o[c], v_mul(pj, v_load(vv + 8 * c)));
  }
  for (int c = 0; c < NB; ++c) v_store(out + d0 + 8 * c, o[c]);
}

// out [D] = softmax(q . k_j * scale) . v_j over the keys at slots[0..n) (the last `window` of them when
// window > 0), k_j = k_cache + slot * row + off (and v_j likewise): one query head against its KV head.
void attend_head(const float* q, const float* k_cache, const float* v_cache, int64_t row, int64_t off,
                 const int64_t* slots, int64_t n, int64_t window, int64_t D, float scale, float* out) {
  if (window > 0 && n > window) {
    slots += n - window;
    n = window;
  }
  thread_local std::vector<float> scores;
  if ((int64_t)scores.size() < n) scores.resize(n);
  float* sc = scores.data();
  float mx = -INFINITY;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {  // eight keys at a time (dot8: each score's bits are dot's)
    const float* kj[8];
    for (int c = 0; c < 8; ++c) kj[c] = k_cache + slots[j + c] * row + off;
    float d8[8];
    dot8(q, kj, D, d8);
    for (int c = 0; c < 8; ++c) {
      sc[j + c] = d8[c] * scale;
      mx = std::max(mx, sc[j + c]);
    }
  }
  for (; j < n; ++j) {
    sc[j] = dot(q, k_cache + slots[j] * row + off, D) * scale;
    mx = std::max(mx, sc[j]);
  }
  // e^(s_j - max) 8 keys at a time by activation.h's v_exp (the tail padded: every key the same operations)
  const V8 vmx = v_set1(mx);
  for (j = 0; j + 8 <= n; j += 8) v_store(sc + j, v_exp(v_sub(v_load(sc + j), vmx)));
  if (j < n) {
    float tail[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    std::memcpy(tail, sc + j, sizeof(float) * (n - j));
    v_store(tail, v_exp(v_sub(v_load(tail), vmx)));
    std::memcpy(sc + j, tail, sizeof(float) * (n - j));
  }
  float sum = 0.f;
  for (j = 0; j < n; ++j) sum += sc[j];
  for (j = 0; j < n; ++j) sc[j] /= sum;  // p_j
  // out[d] = sum over the keys in key order of p_j * v_j[d]: 64, 32, then 8 lanes at a time, then one
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) weighted_values<8>(sc, v_cache, row, off, slots, n, d, out);
  for (; d + 32 <= D; d += 32) weighted_values<4>(sc, v_cache, row, off, slots, n, d, out);
  for (; d + 8 <= D; d += 8) weighted_values<1>(sc, v_cache, row, off, slots, n, d, out);
  for (; d < D; ++d) {
    float o = 0.f;
    for (j = 0; j < n; ++j) o += sc[j] * v_cache[slots[j] * row + off + d];
    out[d] = o;
  }
}

}  // namespace

// out [T, NH, D] (contiguous): token t's query head h (q + t * qst + h * qsh) attends over the cache rows
// ctx_slots[ctx_start[t] .. + ctx_len[t]) (k_cache / v_cache [slots, KV, D] fp32; query head h reads KV
// head h / (NH / KV)), the last `window` of them when window > 0. (token, head) pairs are split over
// `nthreads` (the pool; one thread for a small job: threads_for). Returns -3 for NH not a multiple of KV.
extern "C" int moegate_attention(const float* q, int64_t qst, int64_t qsh, const float* k_cache,
                                 const float* v_cache, const int64_t* ctx_slots, const int64_t* ctx_start,
                                 const int64_t* ctx_len, int64_t T, int64_t NH, int64_t KV, int64_t D,
                                 int64_t window, double scale, float* out, int nthreads) {
  if (KV <= 0 || NH % KV) return -3;
  const int64_t group = NH / KV;
  int64_t cached = 0;  // K and V floats the heads read
  for (int64_t t = 0; t < T; ++t) cached += 2 * NH * D * (window > 0 ? std::min(ctx_len[t], window) : ctx_len[t]);
  const int threads = moegate::threads_for(4 * cached, std::max(nthreads, 1));
  moegate::WorkPool::instance().parallel_for(T * NH, 4, threads, [&](int64_t item) {
    const int64_t t = item / NH, h = item % NH;
    attend_head(q + t * qst + h * qsh, k_cache, v_cache, KV * D, (h / group) * D, ctx_slots + ctx_start[t],
                ctx_len[t], window, D, (float)scale, out + (t * NH + h) * D);
  });
  return 0;
}
