// RMSNorm entry points of the torch modules' fp32 CPU path (engine/models/layers.py RMSNorm), on decode_layer.h's
// row function `rms_norm`, so their bits equal moegate_rms_norm's: a residual add fused with the norm of its sum,
// and a per-head norm that reads strided head rows (q / k as views of the fused q/k/v projection) without a copy.
// Rows are split over the kernel's pool; each row's arithmetic is the same whatever the split. Included by
// moe_cpu.cpp after decode_layer.h.
#pragma once

// sum[t] = x[t] + y[t] (one float add per element: torch's x + y to the bit; sum may alias x or y), then
// out[t] = RMSNorm(sum[t]) * w for T rows of H (out may be null: the add alone).
extern "C" int moegate_add_rms_norm(const float* x, const float* y, float* sum, const float* w, float* out,
                                    int64_t T, int64_t H, double eps, int nthreads) {
  moegate::WorkPool::instance().parallel_for(T, 8, moegate::threads_for(12 * T * H, std::max(nthreads, 1)),
                                             [&](int64_t t) {
    const float* a = x + t * H;
    const float* b = y + t * H;
    float* s = sum + t * H;
    for (int64_t i = 0; i < H; ++i) s[i] = a[i] + b[i];
    if (out != nullptr) rms_norm(s, w, out + t * H, H, (float)eps);
  });
  return 0;
}

// out[t, h] = RMSNorm(x[t, h]) * w for x [T, heads, D] with rows at t * xst + h * xsh floats; out contiguous.
extern "C" int moegate_rms_norm_heads(const float* x, int64_t xst, int64_t xsh, const float* w, float* out, int64_t T,
                                      int64_t heads, int64_t D, double eps, int nthreads) {
  moegate::WorkPool::instance().parallel_for(T, 8, moegate::threads_for(8 * T * heads * D, std::max(nthreads, 1)),
                                             [&](int64_t t) {
    for (int64_t h = 0; h < heads; ++h) rms_norm(x + t * xst + h * xsh, w, out + (t * heads + h) * D, D, (float)eps);
  });
  return 0;
}
