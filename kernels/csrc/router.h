// Top-k routing of one token row: the router of the one-call decode layer (decode_layer.h) and of the torch
// Router's CPU fp32 path (kernels/router.py, prefill included). Each row is a fixed sequence of operations on
// that row alone (logits by `dot`, then softmax and selection in expert order), so its bits never depend on
// the other rows of the call. The logits eight experts at a time (attention.h's dot8: the bits of eight `dot`
// calls, without waiting on one dot's fma chain per expert). Included by moe_cpu.cpp after attention.h (for `dot`,
// `dot8`), before decode_layer.h.
#pragma once

enum RouterKind : int64_t {
  ROUTE_SOFTMAX = 0,       // top-k of softmax(logits), optionally renormalised (Qwen-MoE, OLMoE, Mixtral)
  ROUTE_TOPK_SOFTMAX = 1,  // softmax over the top-k of logits + bias (GPT-OSS)
};

namespace {

// x [H] . w [E, H] (+ bias [E]) -> top-k weights wts [K] (descending) and ids [K] (ties -> lower expert id);
// logits [E] written when not null. scratch: E floats.
void route_row(const float* x, const float* w, const float* bias, int64_t H, int64_t E, int64_t K, int64_t kind,
               bool norm_topk, float* logits, float* scratch, float* wts, int64_t* ids) {
  float* probs = scratch;
  float mx = -INFINITY;
  int64_t e0 = 0;
  for (; e0 + 8 <= E; e0 += 8) {  // eight experts at a time: dot8, each logit dot's bits (attention.h)
    const float* w8[8];
    for (int c = 0; c < 8; ++c) w8[c] = w + (e0 + c) * H;
    dot8(x, w8, H, probs + e0);
  }
  for (; e0 < E; ++e0) probs[e0] = dot(x, w + e0 * H, H);
  for (int64_t e = 0; e < E; ++e) {
    if (bias != nullptr) probs[e] += bias[e];
    mx = std::max(mx, probs[e]);
  }
  if (logits != nullptr) std::memcpy(logits, probs, sizeof(float) * E);
  if (kind == ROUTE_TOPK_SOFTMAX) {
    for (int64_t k = 0; k < K; ++k) {  // top-k logits, descending
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (probs[e] != -INFINITY && (best < 0 || probs[e] > probs[best])) best = e;
      ids[k] = best;
      wts[k] = probs[best];
      probs[best] = -INFINITY;
    }
    float sum = 0.f;  // softmax over them: wts[0] is their max
    const float top = wts[0];
    for (int64_t k = 0; k < K; ++k) sum += (wts[k] = std::exp(wts[k] - top));
    for (int64_t k = 0; k < K; ++k) wts[k] /= sum;
    return;
  }
  float sum = 0.f;
  for (int64_t e = 0; e < E; ++e) sum += (probs[e] = std::exp(probs[e] - mx));
  for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
  float wsum = 0.f;
  for (int64_t k = 0; k < K; ++k) {  // top-k by weight, descending; ties -> lower expert id
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e)
      if (probs[e] >= 0.f && (best < 0 || probs[e] > probs[best])) best = e;
    ids[k] = best;
    wts[k] = probs[best];
    wsum += probs[best];
    probs[best] = -1.f;
  }
  if (norm_topk)
    for (int64_t k = 0; k < K; ++k) wts[k] /= wsum;
}

}  // namespace

// For T rows of x [T, H]: logits [T, E] (null: not written), top-k weights [T, K] and ids [T, K] of the
// router w [E, H] fp32 (bias [E] or null) by `route_row`. Rows are split over `nthreads` (the pool; one
// thread for a small job: threads_for).
// Returns -2 for an unknown kind, -3 for K outside [1, E].
extern "C" int moegate_router(const float* x, const float* w, const float* bias, int64_t T, int64_t H, int64_t E,
                              int64_t K, int64_t kind, int64_t norm_topk, float* logits, float* wts, int64_t* ids,
                              int nthreads) {
  if (kind != ROUTE_SOFTMAX && kind != ROUTE_TOPK_SOFTMAX) return -2;
  if (K < 1 || K > E) return -3;
  const int threads = moegate::threads_for(4 * T * E * H, std::max(nthreads, 1));  // router bytes read
  moegate::WorkPool::instance().parallel_for(T, 4, threads, [&](int64_t t) {
    thread_local std::vector<float> scratch;
    if ((int64_t)scratch.size() < E) scratch.resize(E);
    route_row(x + t * H, w, bias, H, E, K, kind, norm_topk != 0, logits == nullptr ? nullptr : logits + t * E,
              scratch.data(), wts + t * K, ids + t * K);
  });
  return 0;
}
