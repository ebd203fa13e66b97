// One decoder layer of the exploration fast path in a single call, for small batches (decode steps):
// RMSNorm -> fused q/k/v projection (quantized, moegate_linear) -> per-head q/k RMSNorm -> RoPE
// (rotate-half) -> KV-cache write -> attention over each token's paged context -> o projection ->
// residual -> RMSNorm -> router (fp32 softmax, top-k, optional renormalisation) -> routed experts
// (the fused MoE kernel) -> residual. The torch modules in engine/models/ are the reference; this
// replaces ~60 small torch operations per layer with one call. Included by moe_cpu.cpp.
#pragma once

struct DecodeLayerParams {  // mirrored by kernels/build.py (ctypes): keep in sync
  int64_t H, NH, KV, D, E, topk, I;
  int64_t norm_topk;  // 1: top-k weights renormalised to sum to 1
  int64_t qk_norm;    // 0: none, 1: RMSNorm per head (Qwen3)
  int64_t window;     // sliding window (0: none)
  double eps, scale;
  const float* ln1;
  const float* ln2;
  const float* qn;
  const float* kn;
  int64_t dense_fmt, dense_gs;
  const void* qkv_w;
  const uint16_t* qkv_s;
  const uint16_t* qkv_m;
  const void* o_w;
  const uint16_t* o_s;
  const uint16_t* o_m;
  const float* router;  // [E, H] fp32
  int64_t exp_fmt, exp_gs;
  const void* gu_w;
  const uint16_t* gu_s;
  const uint16_t* gu_m;
  const void* dn_w;
  const uint16_t* dn_s;
  const uint16_t* dn_m;
};

namespace {

void rms_norm(const float* x, const float* w, float* out, int64_t n, float eps) {
  const float ss = dot(x, x, n);
  const float r = 1.f / std::sqrt(ss / (float)n + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

void rope(float* v, const float* cos, const float* sin, int64_t d) {  // rotate-half layout, in place
  const int64_t h = d / 2;
  float tmp[1024];
  for (int64_t i = 0; i < h; ++i) {
    tmp[i] = v[i] * cos[i] - v[i + h] * sin[i];
    tmp[i + h] = v[i + h] * cos[i + h] + v[i] * sin[i + h];
  }
  std::memcpy(v, tmp, sizeof(float) * d);
}

}  // namespace

// out[t] = RMSNorm(x[t]) * w for T rows of H: each row alone (the final norm of the execution path).
extern "C" int moegate_rms_norm(const float* x, const float* w, float* out, int64_t T, int64_t H, double eps) {
  for (int64_t t = 0; t < T; ++t) rms_norm(x + t * H, w, out + t * H, H, (float)eps);
  return 0;
}

// out[t, h] = rotate-half RoPE of x[t, h] ([T, heads, D]; x rows at t * xst + h * xsh floats, out contiguous),
// cos / sin [T, D]: lo = x_lo * cos_lo - x_hi * sin_lo, hi = x_hi * cos_hi + x_lo * sin_hi, each product
// rounded, then one add: torch's x * cos + cat(-x_hi, x_lo) * sin to the bit (kernels/rope.py). Tokens are
// split over `nthreads` (the pool); each element's arithmetic is the same whatever the split.
extern "C" int moegate_rope(const float* x, const float* cos, const float* sin, float* out, int64_t T, int64_t heads,
                            int64_t D, int64_t xst, int64_t xsh, int nthreads) {
  if (D % 2) return -2;
  const int64_t h2 = D / 2;
  moegate::WorkPool::instance().parallel_for(T, 8, moegate::threads_for(8 * T * heads * D, std::max(nthreads, 1)),
                                             [&](int64_t t) {
    const float* c = cos + t * D;
    const float* s = sin + t * D;
    for (int64_t h = 0; h < heads; ++h) {
      const float* v = x + t * xst + h * xsh;
      float* o = out + (t * heads + h) * D;
      for (int64_t i = 0; i < h2; ++i) {
        o[i] = v[i] * c[i] - v[i + h2] * s[i];
        o[i + h2] = v[i + h2] * c[i + h2] + v[i] * s[i + h2];
      }
    }
  });
  return 0;
}

// One layer (moegate_decode_layer without the checks: its slots are checked once per call of the entry points).
inline int decode_layer(const DecodeLayerParams* p, float* x, int64_t T, const float* cos, const float* sin,
                        float* k_cache, float* v_cache, const int64_t* slot_mapping, const int64_t* ctx_slots,
                        const int64_t* ctx_start, const int64_t* ctx_len, int64_t* topk_ids_out, int nthreads) {
  const int64_t H = p->H, NH = p->NH, KV = p->KV, D = p->D, E = p->E, K = p->topk;
  const int64_t nq = NH * D, nkv = KV * D, nqkv = nq + 2 * nkv, group = NH / KV;
  const float eps = (float)p->eps, scale = (float)p->scale;
  if (D > 1024 || NH % KV) return -3;
  const Mat qkv{p->qkv_w, p->qkv_s, p->qkv_m, padded_k(H, p->dense_fmt, p->dense_gs), p->dense_gs};
  const Mat om{p->o_w, p->o_s, p->o_m, padded_k(nq, p->dense_fmt, p->dense_gs), p->dense_gs};
  const int64_t n8_qkv = (nqkv + 7) / 8, n8_h = (H + 7) / 8;
  std::vector<float> xn(T * H), q(T * n8_qkv * 8), att(T * nq), o(T * n8_h * 8);
  // 1. attention block
  for (int64_t t = 0; t < T; ++t) rms_norm(x + t * H, p->ln1, &xn[t * H], H, eps);
  int rc = linear_dispatch(p->dense_fmt, qkv, xn.data(), q.data(), T, H, n8_qkv, nthreads);
  if (rc) return rc;
  for (int64_t t = 0; t < T; ++t) {
    float* row = &q[t * n8_qkv * 8];  // [q heads | k heads | v heads]
    for (int64_t h = 0; h < NH + KV; ++h) {
      float* v = row + h * D;
      if (p->qk_norm) rms_norm(v, h < NH ? p->qn : p->kn, v, D, eps);
      rope(v, cos + t * D, sin + t * D, D);
    }
    const int64_t s = slot_mapping[t];
    std::memcpy(k_cache + s * nkv, row + nq, sizeof(float) * nkv);
    std::memcpy(v_cache + s * nkv, row + nq + nkv, sizeof(float) * nkv);
  }
  auto attend = [&](int64_t item) {  // one (token, head): attention.h
    const int64_t t = item / NH, h = item % NH;
    attend_head(&q[t * n8_qkv * 8 + h * D], k_cache, v_cache, nkv, (h / group) * D, ctx_slots + ctx_start[t],
                ctx_len[t], p->window, D, scale, &att[t * nq + h * D]);
  };
  int64_t cached = 0;  // K and V floats the heads read
  for (int64_t t = 0; t < T; ++t) cached += 2 * NH * D * (p->window > 0 ? std::min(ctx_len[t], p->window) : ctx_len[t]);
  moegate::WorkPool::instance().parallel_for(T * NH, 4, moegate::threads_for(4 * cached, nthreads), attend);
  rc = linear_dispatch(p->dense_fmt, om, att.data(), o.data(), T, nq, n8_h, nthreads);
  if (rc) return rc;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < H; ++i) x[t * H + i] += o[t * n8_h * 8 + i];
  // 2. MoE block
  std::vector<float> wts(T * K), probs(E);
  for (int64_t t = 0; t < T; ++t) {
    rms_norm(x + t * H, p->ln2, &xn[t * H], H, eps);
    route_row(&xn[t * H], p->router, nullptr, H, E, K, ROUTE_SOFTMAX, p->norm_topk != 0, nullptr, probs.data(),
              &wts[t * K], &topk_ids_out[t * K]);  // router.h
  }
  const Problem P = make_problem(T, K, p->exp_fmt, E, H, p->I, p->exp_gs, p->gu_w, p->gu_s, p->gu_m, p->dn_w,
                                 p->dn_s, p->dn_m);
  rc = moe_dispatch(p->exp_fmt, P, xn.data(), topk_ids_out, wts.data(), o.data(), nthreads);
  if (rc) return rc;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < H; ++i) x[t * H + i] += o[t * n8_h * 8 + i];
  return 0;
}

// -4 unless every token's new slot and context slot lies in the cache ([0, cache_slots)) and every context range
// [ctx_start[t], ctx_start[t] + ctx_len[t]) in ctx_slots ([0, ctx_total)): a bad table raises in the caller instead
// of writing or reading outside the cache. One pass over the contexts' ids, before anything is written.
inline int check_decode_slots(int64_t T, const int64_t* slot_mapping, const int64_t* ctx_slots,
                              const int64_t* ctx_start, const int64_t* ctx_len, int64_t cache_slots,
                              int64_t ctx_total) {
  for (int64_t t = 0; t < T; ++t) {
    const int64_t b = ctx_start[t], n = ctx_len[t];
    if (slot_mapping[t] < 0 || slot_mapping[t] >= cache_slots || b < 0 || n < 0 || b > ctx_total - n) return -4;
    int bad = 0;
    for (int64_t i = b; i < b + n; ++i) bad |= ctx_slots[i] < 0 || ctx_slots[i] >= cache_slots;
    if (bad) return -4;
  }
  return 0;
}

extern "C" int moegate_decode_layer(const DecodeLayerParams* p, float* x, int64_t T, const float* cos,
                                    const float* sin, float* k_cache, float* v_cache, const int64_t* slot_mapping,
                                    const int64_t* ctx_slots, const int64_t* ctx_start, const int64_t* ctx_len,
                                    int64_t* topk_ids_out, int nthreads, int64_t cache_slots, int64_t ctx_total) {
  if (check_decode_slots(T, slot_mapping, ctx_slots, ctx_start, ctx_len, cache_slots, ctx_total)) return -4;
  return decode_layer(p, x, T, cos, sin, k_cache, v_cache, slot_mapping, ctx_slots, ctx_start, ctx_len,
                      topk_ids_out, nthreads);
}

// The whole decoder stack of a forward in one call: moegate_decode_layer for layers 0..L-1 in order (layer l
// with k_caches[l] / v_caches[l]), then each layer's top-k expert ids added to its routing counts
// (counts[l] [E] int64; a null entry counts nothing), then, if norm_w is given, the final RMSNorm of each row
// into norm_out [T, H] (moegate_rms_norm's arithmetic). topk_ids [T, K] int64 is scratch, holding the last
// layer's ids on return. cache_slots: the slots of every layer's cache (the fewest); ctx_total: ctx_slots' length;
// -4 (nothing written) where a slot or context range lies outside them (check_decode_slots). Each layer's
// arithmetic is moegate_decode_layer's, so the bytes are those of L calls.
extern "C" int moegate_decode_stack(const DecodeLayerParams* layers, int64_t L, float* x, int64_t T,
                                    const float* cos, const float* sin, float* const* k_caches,
                                    float* const* v_caches, const int64_t* slot_mapping, const int64_t* ctx_slots,
                                    const int64_t* ctx_start, const int64_t* ctx_len, int64_t* topk_ids,
                                    int64_t* const* counts, const float* norm_w, double norm_eps, float* norm_out,
                                    int nthreads, int64_t cache_slots, int64_t ctx_total) {
  if (check_decode_slots(T, slot_mapping, ctx_slots, ctx_start, ctx_len, cache_slots, ctx_total)) return -4;
  for (int64_t l = 0; l < L; ++l) {
    const int rc = decode_layer(&layers[l], x, T, cos, sin, k_caches[l], v_caches[l], slot_mapping, ctx_slots,
                                ctx_start, ctx_len, topk_ids, nthreads);
    if (rc) return rc;
    if (counts[l] == nullptr) continue;
    for (int64_t i = 0; i < T * layers[l].topk; ++i)
      if (topk_ids[i] >= 0 && topk_ids[i] < layers[l].E) ++counts[l][topk_ids[i]];
  }
  if (norm_w != nullptr && L > 0) moegate_rms_norm(x, norm_w, norm_out, T, layers[0].H, norm_eps);
  return 0;
}
