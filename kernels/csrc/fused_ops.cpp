// Fused element-wise ops of a decoder layer for the CPU: each replaces a chain of 5-15 small torch ops that
// every read and write the whole activation, which at decode batch sizes costs more in dispatch and memory
// traffic than in arithmetic.
//
// Rounding follows the transformers reference step by step: where it rounds an intermediate to the model's
// dtype (bf16/fp16), so does this code (`round_to<T>`); the arithmetic itself is fp32, a vector at a time.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "dtype_vec.h"

namespace {

using radixrt::hsum;
using radixrt::kLanes;
using radixrt::Vec;
using radixrt::load_floats;
using radixrt::round_to;
using radixrt::store_floats;

// rows of `hidden` elements per parallel task: enough work to pay for waking a thread
inline int64_t grain_for(int64_t hidden) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(hidden, 1)); }


// One row: residual = round(x + residual) if there is one, then out = round(weight * round(h * inv)) of that
// row h, as transformers' LlamaRMSNorm in T (for fp32 every round is a no-op).
template <typename T, bool kRoundOnce>
void rms_norm_row(const T* x, T* res, const T* weight, T* o, int64_t hidden, float eps, float offset) {
  const int64_t whole = hidden - hidden % kLanes;
  Vec sums(0.f);
  float sum = 0.f;
  int64_t i = 0;
  for (; i < whole; i += kLanes) {
    Vec v = load_floats(x + i);
    if (res != nullptr) {
      v = round_to<T>(v + load_floats(res + i));
      store_floats(res + i, v);
    }
    sums = at::vec::fmadd(v, v, sums);
  }
  for (; i < hidden; ++i) {
    float v = static_cast<float>(x[i]);
    if (res != nullptr) {
      v = round_to<T>(v + static_cast<float>(res[i]));
      res[i] = static_cast<T>(v);
    }
    sum += v * v;
  }
  sum += hsum(sums);
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
  const T* h = res == nullptr ? x : res;
  const Vec vinv(inv);
  if constexpr (kRoundOnce) {  // Gemma, OLMo 2: (x * inv) * (offset + weight) in fp32, rounded once
    const Vec voffset(offset);
    for (i = 0; i < whole; i += kLanes) {
      store_floats(o + i, (load_floats(h + i) * vinv) * (voffset + load_floats(weight + i)));
    }
    for (; i < hidden; ++i) {
      o[i] = static_cast<T>((static_cast<float>(h[i]) * inv) * (offset + static_cast<float>(weight[i])));
    }
  } else {
    for (i = 0; i < whole; i += kLanes) store_floats(o + i, load_floats(weight + i) * round_to<T>(load_floats(h + i) * vinv));
    for (; i < hidden; ++i) {
      o[i] = static_cast<T>(static_cast<float>(weight[i]) * round_to<T>(static_cast<float>(h[i]) * inv));
    }
  }
}

template <typename T, bool kRoundOnce>
void rms_norm_kernel(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t hidden,
                     int64_t x_stride, int64_t out_stride, float eps, float offset) {
  at::parallel_for(0, rows, grain_for(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      rms_norm_row<T, kRoundOnce>(x + r * x_stride, residual == nullptr ? nullptr : residual + r * hidden, weight,
                                  out + r * out_stride, hidden, eps, offset);
    }
  });
}

// silu as torch computes it, x / (1 + exp(-x))
struct Silu {
  Vec operator()(const Vec& x) const { return x / (Vec(1.f) + x.neg().exp()); }
  float operator()(float x) const { return x / (1.f + std::exp(-x)); }
};

// gelu with torch's tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (Gemma's gate)
struct GeluTanh {
  static constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;  // sqrt(2 / pi), as torch's kernel
  Vec operator()(const Vec& x) const {
    const Vec inner = Vec(kBeta) * (x + Vec(kKappa) * x * x * x);
    return Vec(0.5f) * x * (Vec(1.f) + inner.tanh());
  }
  float operator()(float x) const { return 0.5f * x * (1.f + std::tanh(kBeta * (x + kKappa * x * x * x))); }
};

// act(gate) rounded to T, then times up, rounded again: where transformers rounds
template <typename T, typename Act>
void gated_kernel(const T* gate_up, T* out, int64_t rows, int64_t inter, Act act) {
  const int64_t whole = inter - inter % kLanes;
  at::parallel_for(0, rows, grain_for(2 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
      int64_t i = 0;
      for (; i < whole; i += kLanes) store_floats(o + i, round_to<T>(act(load_floats(g + i))) * load_floats(u + i));
      for (; i < inter; ++i) {
        o[i] = static_cast<T>(round_to<T>(act(static_cast<float>(g[i]))) * static_cast<float>(u[i]));
      }
    }
  });
}

// Neox-style rotation (rotate_half) of one head: x1, x2 its halves; cos/sin rows hold [freqs, freqs], already
// rounded to T. As the reference: out1 = x1*c1 - x2*s1, out2 = x2*c2 + x1*s2, each product rounded to T,
// then the sum. `src` and `dst` may be the same head (in place).
template <typename T>
inline void rotate_head(const T* src, T* dst, int64_t half, const float* cos, const float* sin) {
  int64_t j = 0;
  for (; j + kLanes <= half; j += kLanes) {
    const Vec x1 = load_floats(src + j), x2 = load_floats(src + j + half);
    const Vec c1 = Vec::loadu(cos + j), s1 = Vec::loadu(sin + j);
    const Vec c2 = Vec::loadu(cos + j + half), s2 = Vec::loadu(sin + j + half);
    store_floats(dst + j, round_to<T>(x1 * c1) - round_to<T>(x2 * s1));
    store_floats(dst + j + half, round_to<T>(x2 * c2) + round_to<T>(x1 * s2));
  }
  for (; j < half; ++j) {
    const float x1 = static_cast<float>(src[j]), x2 = static_cast<float>(src[j + half]);
    dst[j] = static_cast<T>(round_to<T>(x1 * cos[j]) - round_to<T>(x2 * sin[j]));
    dst[j + half] = static_cast<T>(round_to<T>(x2 * cos[j + half]) + round_to<T>(x1 * sin[j + half]));
  }
}

// one token's cos/sin rows rounded to T (as the reference casts the tables to the activations' dtype)
template <typename T>
inline void rounded_angles(const float* cos, const float* sin, int64_t dim, float* cos_out, float* sin_out) {
  int64_t j = 0;
  for (; j + kLanes <= dim; j += kLanes) {
    round_to<T>(Vec::loadu(cos + j)).store(cos_out + j);
    round_to<T>(Vec::loadu(sin + j)).store(sin_out + j);
  }
  for (; j < dim; ++j) {
    cos_out[j] = round_to<T>(cos[j]);
    sin_out[j] = round_to<T>(sin[j]);
  }
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

}  // namespace

// out = rmsnorm(x) * weight; with a residual: residual = x + residual (in place), out = rmsnorm(residual) * weight.
// x [T, H] (rows may be strided), residual [T, H] contiguous or undefined; returns out [T, H]. round_once (Gemma,
// OLMo 2): out = rmsnorm(x) * (weight_offset + weight), the product in fp32 and rounded once; else the normalised x
// is rounded first, as Llama's norm does (weight_offset must then be 0).
at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps,
                    bool round_once, double weight_offset) {
  TORCH_CHECK(round_once || weight_offset == 0.0, "a weight offset needs round_once");
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
    auto* r = res.defined() ? res.data_ptr<scalar_t>() : nullptr;
    if (round_once) {
      rms_norm_kernel<scalar_t, true>(x.data_ptr<scalar_t>(), r, weight.data_ptr<scalar_t>(),
                                      out.data_ptr<scalar_t>(), rows, hidden, x.stride(0), hidden,
                                      static_cast<float>(eps), static_cast<float>(weight_offset));
    } else {
      rms_norm_kernel<scalar_t, false>(x.data_ptr<scalar_t>(), r, weight.data_ptr<scalar_t>(),
                                       out.data_ptr<scalar_t>(), rows, hidden, x.stride(0), hidden,
                                       static_cast<float>(eps), 0.f);
    }
  });
  return out;
}

// gate_up [T, 2I] (gate then up) -> act(gate) * up [T, I], act silu or (gelu) gelu with the tanh approximation
at::Tensor gated_product(at::Tensor gate_up, bool gelu) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must hold two halves");
  gate_up = gate_up.contiguous();
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = at::empty({rows, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "gated_product", [&] {
    if (gelu) {
      gated_kernel<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, inter, GeluTanh{});
    } else {
      gated_kernel<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, inter, Silu{});
    }
  });
  return out;
}

at::Tensor silu_and_mul(at::Tensor gate_up) { return gated_product(gate_up, false); }

at::Tensor gelu_tanh_and_mul(at::Tensor gate_up) { return gated_product(gate_up, true); }

namespace {

// What one rotary call touches. Without slots k is rotated in place; with them the rotated k and a copy of v
// go to the caches' slot rows instead (slot < 0: not stored), and k is left as it was.
template <typename T>
struct RopeArgs {
  const int64_t* pos;
  const float *cos, *sin;  // [table rows, rot_dim]
  T* q;
  const T* k;
  const T* v;
  int64_t tokens, dim, rot_dim, heads, kv_heads, q_stride, k_stride, v_stride;
  const int64_t* slots;
  T *k_cache, *v_cache;  // [slots, kv_heads, dim]
};

// Each head's first rot_dim elements are rotated; the rest (a partial rotary, rot_dim < dim) pass unchanged.
template <typename T>
void rope_kernel(const RopeArgs<T>& a) {
  const int64_t dim = a.dim, rot = a.rot_dim, half = rot / 2, row = a.kv_heads * dim;
  at::parallel_for(0, a.tokens, grain_for((a.heads + 2 * a.kv_heads) * dim), [&](int64_t begin, int64_t end) {
    std::vector<float> angles(2 * rot);
    float *c = angles.data(), *s = angles.data() + rot;
    for (int64_t t = begin; t < end; ++t) {
      rounded_angles<T>(a.cos + a.pos[t] * rot, a.sin + a.pos[t] * rot, rot, c, s);
      T* q = a.q + t * a.q_stride;
      for (int64_t h = 0; h < a.heads; ++h) rotate_head(q + h * dim, q + h * dim, half, c, s);
      const T* k = a.k + t * a.k_stride;
      T* k_out = const_cast<T*>(k);
      if (a.slots != nullptr) {
        if (a.slots[t] < 0) continue;
        k_out = a.k_cache + a.slots[t] * row;
        std::memcpy(a.v_cache + a.slots[t] * row, a.v + t * a.v_stride, row * sizeof(T));
      }
      for (int64_t h = 0; h < a.kv_heads; ++h) {
        rotate_head(k + h * dim, k_out + h * dim, half, c, s);
        if (k_out != k && rot < dim) std::memcpy(k_out + h * dim + rot, k + h * dim + rot, (dim - rot) * sizeof(T));
      }
    }
  });
}

void check_heads(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2), name,
              " must be [T, heads, D] with contiguous heads");
}

// positions as int64, each checked to lie inside the tables; the tables' width (the rotary dim) is checked against
// the head dim: even, and no wider
at::Tensor checked_positions(at::Tensor positions, int64_t tokens, const at::Tensor& cos_cache,
                             const at::Tensor& sin_cache, int64_t dim) {
  TORCH_CHECK(cos_cache.scalar_type() == at::kFloat && sin_cache.scalar_type() == at::kFloat &&
                  cos_cache.is_contiguous() && sin_cache.is_contiguous() && cos_cache.dim() == 2 &&
                  cos_cache.sizes() == sin_cache.sizes() && cos_cache.size(1) <= dim && cos_cache.size(1) > 0 &&
                  cos_cache.size(1) % 2 == 0,
              "cos/sin caches must be contiguous fp32 [rows, rotary dim], the rotary dim even and at most D");
  positions = positions.to(at::kLong).contiguous();
  TORCH_CHECK(positions.numel() == tokens, "one position per token");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {  // a loop, not min()/max(): two reductions and syncs per layer cost more
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_cache.size(0), "positions must lie inside the rotary cache");
  }
  return positions;
}

}  // namespace

// Rotates q [T, H, D] and k [T, KH, D] in place (each head's D contiguous, tokens may be strided) at
// positions [T] (int64: rows of the tables) with cos/sin caches [rows, R] (fp32): each head's first R elements.
void rotary_embedding(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos_cache, at::Tensor sin_cache) {
  check_heads(q, "q");
  check_heads(k, "k");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.size(2) == q.size(2) && k.size(0) == q.size(0),
              "q and k must share a dtype, tokens and head_dim");
  positions = checked_positions(positions, q.size(0), cos_cache, sin_cache, q.size(2));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_embedding", [&] {
    RopeArgs<scalar_t> args{positions.data_ptr<int64_t>(), cos_cache.data_ptr<float>(), sin_cache.data_ptr<float>(),
                            q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), nullptr, q.size(0), q.size(2),
                            cos_cache.size(1), q.size(1), k.size(1), q.stride(0), k.stride(0), 0, nullptr, nullptr,
                            nullptr};
    rope_kernel(args);
  });
}

// rotary_embedding of q (in place) and k, with the rotated k and v [T, KH, D] written straight into their slot
// rows of the paged caches [P, S, KH, D] (slots [T] int64, flat page * S + offset; < 0: not stored); k itself
// is left unrotated. One pass instead of rotating, then two index_copy_ calls reading k and v again.
void rope_and_store(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor cos_cache,
                    at::Tensor sin_cache, at::Tensor slots, at::Tensor k_cache, at::Tensor v_cache) {
  check_heads(q, "q");
  check_heads(k, "k");
  check_heads(v, "v");
  const int64_t tokens = q.size(0), dim = q.size(2), kv_heads = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == tokens && k.size(2) == dim, "k and v must be [T, KH, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == kv_heads && k_cache.size(3) == dim,
              "the caches must be contiguous [P, S, KH, D] matching k");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && v.scalar_type() == q.scalar_type() &&
                  k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q, k, v and the caches must share a dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.numel() == tokens,
              "slots must be int64 [T]");
  slots = slots.contiguous();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(slot[t] < num_slots, "slots must lie inside the caches");
  positions = checked_positions(positions, tokens, cos_cache, sin_cache, dim);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rope_and_store", [&] {
    RopeArgs<scalar_t> args{positions.data_ptr<int64_t>(), cos_cache.data_ptr<float>(), sin_cache.data_ptr<float>(),
                            q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), tokens, dim,
                            cos_cache.size(1), q.size(1), kv_heads, q.stride(0), k.stride(0), v.stride(0), slot,
                            k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>()};
    rope_kernel(args);
  });
}
