// Fused element-wise ops of a decoder layer for the CPU: each replaces a chain of 5-15 small torch ops that
// every read and write the whole activation, which at decode batch sizes costs more in dispatch and memory
// traffic than in arithmetic.
//
// Rounding follows the transformers reference step by step: where it rounds an intermediate to the model's
// dtype (bf16/fp16), so does this code (`round_to`); the arithmetic itself is fp32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// rows of `hidden` elements per parallel task: enough work to pay for waking a thread
inline int64_t grain_for(int64_t hidden) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(hidden, 1)); }

// fp32 needs no intermediate rounding, so the row is read, summed and scaled a vector at a time.
void rms_norm_fp32(const float* x, float* residual, const float* weight, float* out, int64_t rows, int64_t hidden,
                   int64_t x_stride, int64_t out_stride, float eps) {
  const int64_t whole = hidden - hidden % Vec::size();
  at::parallel_for(0, rows, grain_for(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * x_stride;
      float* res = residual == nullptr ? nullptr : residual + r * hidden;
      const float* h = res == nullptr ? xr : res;  // the normalized row: x, or residual after residual += x
      Vec sums(0.f);
      float sum = 0.f;
      int64_t i = 0;
      for (; i < whole; i += Vec::size()) {
        Vec v = Vec::loadu(xr + i);
        if (res != nullptr) {
          v = v + Vec::loadu(res + i);
          v.store(res + i);
        }
        sums = at::vec::fmadd(v, v, sums);
      }
      for (; i < hidden; ++i) {
        float v = xr[i];
        if (res != nullptr) v = res[i] = v + res[i];
        sum += v * v;
      }
      sum += at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sums);
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
      const Vec vinv(inv);
      float* o = out + r * out_stride;
      for (i = 0; i < whole; i += Vec::size()) (Vec::loadu(weight + i) * (Vec::loadu(h + i) * vinv)).store(o + i);
      for (; i < hidden; ++i) o[i] = weight[i] * (h[i] * inv);
    }
  });
}

template <typename T>
void rms_norm_kernel(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t hidden,
                     int64_t x_stride, int64_t out_stride, float eps) {
  if constexpr (std::is_same_v<T, float>) {
    rms_norm_fp32(x, residual, weight, out, rows, hidden, x_stride, out_stride, eps);
    return;
  }
  at::parallel_for(0, rows, grain_for(hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> h(hidden);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* res = residual == nullptr ? nullptr : residual + r * hidden;
      float sum = 0.f;
      for (int64_t i = 0; i < hidden; ++i) {
        float v = static_cast<float>(xr[i]);
        if (res != nullptr) {  // residual = x + residual, in the model's dtype
          v = round_to<T>(v + static_cast<float>(res[i]));
          res[i] = static_cast<T>(v);
        }
        h[i] = v;
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
      T* o = out + r * out_stride;
      for (int64_t i = 0; i < hidden; ++i) {
        o[i] = static_cast<T>(static_cast<float>(weight[i]) * round_to<T>(h[i] * inv));
      }
    }
  });
}

template <typename T>
void silu_and_mul_kernel(const T* gate_up, T* out, int64_t rows, int64_t inter) {
  const Vec one(1.f);
  if constexpr (std::is_same_v<T, float>) {  // no intermediate rounding: straight from the rows to the output
    at::parallel_for(0, rows, grain_for(2 * inter), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* g = gate_up + r * 2 * inter;
        const float* u = g + inter;
        float* o = out + r * inter;
        int64_t i = 0;
        for (; i + Vec::size() <= inter; i += Vec::size()) {
          const Vec x = Vec::loadu(g + i);
          ((x / (one + x.neg().exp())) * Vec::loadu(u + i)).store(o + i);
        }
        for (; i < inter; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
      }
    });
    return;
  }
  at::parallel_for(0, rows, grain_for(2 * inter), [&](int64_t begin, int64_t end) {
    std::vector<float> gate(inter), up(inter);
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * inter;
      const T* u = g + inter;
      for (int64_t i = 0; i < inter; ++i) {
        gate[i] = static_cast<float>(g[i]);
        up[i] = static_cast<float>(u[i]);
      }
      int64_t i = 0;
      for (; i + Vec::size() <= inter; i += Vec::size()) {  // silu as torch computes it: x / (1 + exp(-x))
        const Vec x = Vec::loadu(gate.data() + i);
        (x / (one + x.neg().exp())).store(gate.data() + i);
      }
      for (; i < inter; ++i) gate[i] = gate[i] / (1.f + std::exp(-gate[i]));
      T* o = out + r * inter;
      for (int64_t j = 0; j < inter; ++j) o[j] = static_cast<T>(round_to<T>(gate[j]) * up[j]);
    }
  });
}

// Neox-style rotation (rotate_half) of every head of one token, in place; cos/sin rows hold [freqs, freqs].
template <typename T>
inline void rotate_heads(T* x, int64_t heads, int64_t head_stride, int64_t half, const float* cos, const float* sin) {
  for (int64_t h = 0; h < heads; ++h) {
    T* v = x + h * head_stride;
    for (int64_t j = 0; j < half; ++j) {
      const float x1 = static_cast<float>(v[j]), x2 = static_cast<float>(v[j + half]);
      const float c1 = round_to<T>(cos[j]), s1 = round_to<T>(sin[j]);
      const float c2 = round_to<T>(cos[j + half]), s2 = round_to<T>(sin[j + half]);
      v[j] = static_cast<T>(round_to<T>(x1 * c1) + round_to<T>(-x2 * s1));
      v[j + half] = static_cast<T>(round_to<T>(x2 * c2) + round_to<T>(x1 * s2));
    }
  }
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

}  // namespace

// out = rmsnorm(x) * weight; with a residual: residual = x + residual (in place), out = rmsnorm(residual) * weight.
// x [T, H] (rows may be strided), residual [T, H] contiguous or undefined; returns out [T, H].
at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden && weight.scalar_type() == x.scalar_type(),
              "weight must be [hidden] in x's dtype");
  weight = weight.contiguous();
  at::Tensor res;
  if (residual.has_value() && residual->defined()) {
    res = *residual;
    TORCH_CHECK(res.is_contiguous() && res.sizes() == x.sizes() && res.scalar_type() == x.scalar_type(),
                "residual must be contiguous, with x's shape and dtype");
  }
  auto out = at::empty({rows, hidden}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), res.defined() ? res.data_ptr<scalar_t>() : nullptr,
                              weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, hidden, x.stride(0),
                              hidden, static_cast<float>(eps));
  });
  return out;
}

// gate_up [T, 2I] (gate then up) -> silu(gate) * up [T, I]
at::Tensor silu_and_mul(at::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must hold two halves");
  gate_up = gate_up.contiguous();
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = at::empty({rows, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_kernel<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, inter);
  });
  return out;
}

// Rotates q [T, H, D] and k [T, KH, D] in place (each head's D contiguous, tokens may be strided) at
// positions [T] (int64) with cos/sin caches [max_positions, D] (fp32).
void rotary_embedding(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos_cache, at::Tensor sin_cache) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) &&
                  k.stride(1) == k.size(2),
              "q and k must be [T, heads, D] with contiguous heads");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q and k must share a dtype");
  TORCH_CHECK(cos_cache.scalar_type() == at::kFloat && sin_cache.scalar_type() == at::kFloat &&
                  cos_cache.is_contiguous() && sin_cache.is_contiguous() && cos_cache.size(1) == q.size(2) &&
                  k.size(2) == q.size(2) && q.size(2) % 2 == 0,
              "cos/sin caches must be contiguous fp32 [max_positions, D]");
  positions = positions.to(at::kLong).contiguous();
  const int64_t tokens = q.size(0), dim = q.size(2);
  TORCH_CHECK(positions.numel() == tokens && k.size(0) == tokens, "one position per token");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {  // a loop, not min()/max(): two reductions and syncs per layer cost more
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_cache.size(0), "positions must lie inside the rotary cache");
  }
  const float* cos = cos_cache.data_ptr<float>();
  const float* sin = sin_cache.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_embedding", [&] {
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, grain_for((q.size(1) + k.size(1)) * dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* c = cos + pos[t] * dim;
        const float* s = sin + pos[t] * dim;
        rotate_heads(qp + t * q.stride(0), q.size(1), dim, dim / 2, c, s);
        rotate_heads(kp + t * k.stride(0), k.size(1), dim, dim / 2, c, s);
      }
    });
  });
}
