// The logits mask of constrained decoding (kernels/bindings.py). Included by moe_cpu.cpp.
#pragma once

extern "C" {

// Token bitmask (bit j of word w allows id 32*w + j) applied to fp32 logits rows in place: a
// disallowed id becomes -inf. Whole words are the common case (all allowed inside a free string,
// none allowed in most of the vocabulary at a structural position), so they cost one test each.
int moegate_apply_bitmask(float* logits, const uint32_t* mask, int64_t rows, int64_t vocab,
                          int64_t logits_stride, int64_t mask_stride) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t words = (vocab + 31) / 32;
  for (int64_t r = 0; r < rows; ++r) {
    float* row = logits + r * logits_stride;
    const uint32_t* m = mask + r * mask_stride;
    for (int64_t w = 0; w < words; ++w) {
      const uint32_t bits = m[w];
      if (bits == 0xFFFFFFFFu) continue;
      const int64_t base = w * 32;
      const int n = static_cast<int>(std::min<int64_t>(32, vocab - base));
      float* out = row + base;
      if (bits == 0) {
        std::fill_n(out, n, ninf);
      } else {
        for (int j = 0; j < n; ++j) out[j] = ((bits >> j) & 1u) ? out[j] : ninf;  // branch-free
      }
    }
  }
  return 0;
}

}  // extern "C"
