// Sampled next tokens by inverse CDF, one row at a time in two passes over its logits and a third over one
// vector of them, nothing full-size written: the sampler's plain-temperature path (no top-k, top-p or min-p) without torch's five full-size
// intermediates (the scaled logits, their softmax, its fp64 copy, the cumulative sum, greedy tokens beside).
//
// Row r, logits x over V tokens, temperature T, uniform u in [0, 1):
// - m = max(x); weights w_i = exp((x_i - m) / T) (the softmax's numerators, in fp32, by ATen's exp_u20);
// - per vector of w (kLanes tokens) its sum in fp32; the row's total W = the fp64 sum of those, in order;
// - the token: the first i where the running fp64 sum of the vector sums, then of that vector's w one by one,
//   passes u * W (that vector's w computed again, the same bits). A token of weight 0 spans nothing and is
//   never drawn. Where rounding leaves the running sum of a vector's own w short of what its sum promised (the
//   two add in different orders), its last token of positive weight is taken (an earlier vector's, where it
//   has none).
// The same distribution as softmax-then-cumsum, to fp32 rounding of each weight. A row's token depends on its
// own logits and uniform only, never on the other rows or the thread count (one thread walks a row).
// A row with a NaN or an infinite logit (or only -inf) gets V - 1, as torch's softmax-then-searchsorted does.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#include "dtype_vec.h"

namespace {

using radixrt::kLanes;
using radixrt::Vec;

// The weights of vector b (kLanes tokens; the last may be a shorter tail) into w, the same bits each time.
void block_weights(const float* x, int64_t n, int64_t b, float m, float inv_t, float* w) {
  const int64_t begin = b * kLanes;
  if (begin + kLanes <= n) {
    ((Vec::loadu(x + begin) - Vec(m)) * Vec(inv_t)).exp_u20().store(w);  // 20 ulp: far below what a draw resolves
  } else {
    for (int64_t i = begin; i < n; ++i) w[i - begin] = std::exp((x[i] - m) * inv_t);
  }
}

int64_t sample_row(const float* x, int64_t n, float inv_t, double u, std::vector<float>& sums) {
  const int64_t whole = n - n % kLanes;
  const int64_t blocks = whole / kLanes + (whole < n ? 1 : 0);
  sums.resize(blocks);
  // pass 1: the maximum (NaN and +inf surface here)
  Vec top(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < whole; i += kLanes) top = at::vec::maximum(top, Vec::loadu(x + i));  // propagates NaN
  float m = whole ? at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, top)
                  : -std::numeric_limits<float>::infinity();
  bool nan = std::isnan(m);
  for (int64_t i = whole; i < n; ++i) {
    nan = nan || std::isnan(x[i]);
    m = std::max(m, x[i]);
  }
  if (nan || !std::isfinite(m)) return n - 1;
  // pass 2: each vector's sum of weights (the weights themselves are not kept); the row's total in fp64
  alignas(64) float w[kLanes];
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t width = std::min<int64_t>(kLanes, n - b * kLanes);
    block_weights(x, n, b, m, inv_t, w);
    float sum = 0.f;
    if (width == kLanes) {
      sum = at::vec::vec_reduce_all<float>([](Vec a, Vec c) { return a + c; }, Vec::loadu(w));
    } else {
      for (int64_t i = 0; i < width; ++i) sum += w[i];
    }
    sums[b] = sum;
    total += sum;
  }
  if (!(total > 0.0) || !std::isfinite(total)) return n - 1;
  const double point = u * total;
  // pass 3: the vector whose sum passes the point, then the token inside it (its weights computed again)
  double running = 0.0;
  int64_t b = 0;
  for (; b < blocks - 1; ++b) {
    if (running + sums[b] > point) break;
    running += sums[b];
  }
  for (; b >= 0; --b) {  // backwards only where rounding left a vector short: its last token of weight > 0
    const int64_t begin = b * kLanes, width = std::min<int64_t>(kLanes, n - begin);
    block_weights(x, n, b, m, inv_t, w);
    int64_t last_positive = -1;
    for (int64_t i = 0; i < width; ++i) {
      if (w[i] > 0.f) {
        last_positive = begin + i;
        running += w[i];
        if (running > point) return begin + i;
      }
    }
    if (last_positive >= 0) return last_positive;
  }
  return n - 1;
}

}  // namespace

// logits [rows, vocab] fp32 (rows may be strided), temperatures [rows] fp32 (> 0), uniforms [rows] fp64 in
// [0, 1) -> [rows] int64
at::Tensor sample_tokens(at::Tensor logits, at::Tensor temperatures, at::Tensor uniforms) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat, "logits must be fp32 on the CPU");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "logits must be [rows, vocab] with contiguous rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(temperatures.scalar_type() == at::kFloat && temperatures.is_contiguous() &&
                  temperatures.numel() == rows, "temperatures must be [rows] fp32");
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.is_contiguous() && uniforms.numel() == rows,
              "uniforms must be [rows] fp64");
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  const float* t = temperatures.data_ptr<float>();
  const double* u = uniforms.data_ptr<double>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(t[r] > 0.f, "temperatures must be > 0");
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / vocab), [&](int64_t begin, int64_t end) {
    std::vector<float> sums;
    for (int64_t r = begin; r < end; ++r) o[r] = sample_row(x + r * stride, vocab, 1.f / t[r], u[r], sums);
  });
  return out;
}
