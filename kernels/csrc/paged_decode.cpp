// Paged decode attention for the CPU, reading K/V pages where they lie in the pool.
//
// One work item per (request, kv head): its `group` query heads walk the request's pages a page at a time
// with an online softmax (fp32), so every key and value is read once per step and nothing is copied. The
// arithmetic is at::vec fp32 (keys and values converted as they load); a head_dim of 8 or 16 vectors keeps the
// query and accumulator rows in registers, any other runs the same code with a run-time width and a scalar tail.
// Layout as in torch_ref.py: caches are [num_pages, page_size, kv_heads, head_dim].
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

template <typename T>
inline Vec load_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else if constexpr (at::is_reduced_floating_point_v<T>) {
    Vec out;
    at::vec::load_to_float(p, out);
    return out;
  } else {  // double
    float tmp[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) tmp[i] = static_cast<float>(p[i]);
    return Vec::loadu(tmp);
  }
}

inline float hsum(Vec v) { return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v); }

// kChunks = head_dim / lanes when known at compile time (registers), 0 = read it at run time.
template <typename T, int kChunks>
void decode_kernel(const T* q, const T* k_cache, const T* v_cache, const int32_t* table, const int32_t* lens,
                   T* out, float* lse, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                   int64_t page_size, int64_t table_width, float scale, int64_t window) {
  const int64_t group = heads / kv_heads;
  const int64_t chunks = kChunks > 0 ? kChunks : head_dim / kLanes;
  const int64_t token_stride = kv_heads * head_dim;
  const int64_t page_stride = page_size * token_stride;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores(page_size + kLanes);
    std::vector<float> m(group), l(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, kh = item % kv_heads;
      const int64_t len = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      for (int64_t g = 0; g < group; ++g) {
        const T* src = q + (b * heads + kh * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = static_cast<float>(src[d]) * scale;
        m[g] = -std::numeric_limits<float>::infinity();
        l[g] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = first - first % page_size; start < len; start += page_size) {
        const int64_t page = table[b * table_width + start / page_size];
        const int64_t lo = std::max(start, first) - start, hi = std::min(start + page_size, len) - start;
        const T* k_page = k_cache + page * page_stride + kh * head_dim;
        const T* v_page = v_cache + page * page_stride + kh * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float* s = scores.data();
          float top = m[g];
          for (int64_t t = lo; t < hi; ++t) {
            const T* k = k_page + t * token_stride;
            Vec a0(0.f), a1(0.f);
            int64_t c = 0;
            for (; c + 1 < chunks; c += 2) {
              a0 = at::vec::fmadd(Vec::loadu(qg + c * kLanes), load_float(k + c * kLanes), a0);
              a1 = at::vec::fmadd(Vec::loadu(qg + (c + 1) * kLanes), load_float(k + (c + 1) * kLanes), a1);
            }
            if (c < chunks) a0 = at::vec::fmadd(Vec::loadu(qg + c * kLanes), load_float(k + c * kLanes), a0);
            float dot = hsum(a0 + a1);
            for (int64_t d = chunks * kLanes; d < head_dim; ++d) dot += qg[d] * static_cast<float>(k[d]);
            s[t] = dot;
            top = std::max(top, dot);
          }
          const float rescale = std::exp(m[g] - top);  // 0 on the first page (m = -inf)
          const Vec vtop(top);
          int64_t t = lo;
          Vec vsum(0.f);
          for (; t + kLanes <= hi; t += kLanes) {
            const Vec p = (Vec::loadu(s + t) - vtop).exp();
            p.store(s + t);
            vsum = vsum + p;
          }
          float sum = l[g] * rescale + hsum(vsum);
          for (; t < hi; ++t) {
            s[t] = std::exp(s[t] - top);
            sum += s[t];
          }
          float* a = acc.data() + g * head_dim;
          const Vec vrescale(rescale);
          for (int64_t c = 0; c < chunks; ++c) {
            Vec r0 = Vec::loadu(a + c * kLanes) * vrescale;
            Vec r1(0.f);
            int64_t u = lo;
            for (; u + 1 < hi; u += 2) {
              r0 = at::vec::fmadd(Vec(s[u]), load_float(v_page + u * token_stride + c * kLanes), r0);
              r1 = at::vec::fmadd(Vec(s[u + 1]), load_float(v_page + (u + 1) * token_stride + c * kLanes), r1);
            }
            if (u < hi) r0 = at::vec::fmadd(Vec(s[u]), load_float(v_page + u * token_stride + c * kLanes), r0);
            (r0 + r1).store(a + c * kLanes);
          }
          for (int64_t d = chunks * kLanes; d < head_dim; ++d) {
            float x = a[d] * rescale;
            for (int64_t u = lo; u < hi; ++u) x += s[u] * static_cast<float>(v_page[u * token_stride + d]);
            a[d] = x;
          }
          m[g] = top;
          l[g] = sum;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const int64_t row = b * heads + kh * group + g;
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < head_dim; ++d) out[row * head_dim + d] = static_cast<T>(acc[g * head_dim + d] * inv);
        lse[row] = m[g] + std::log(l[g]);
      }
    }
  });
}

}  // namespace

// q [B, H, D]; caches [P, S, KH, D] (same dtype as q); page_table [B, W] int32; seq_lens [B] int32 (>= 1).
// Returns (out [B, H, D], lse [B, H] fp32); window > 0 keeps only the last `window` keys.
std::vector<torch::Tensor> paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                        torch::Tensor page_table, torch::Tensor seq_lens, double scale,
                                        int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q must be [B, H, D] and the caches [P, S, KH, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(page_table.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "page_table and seq_lens must be int32");
  q = q.contiguous();
  page_table = page_table.contiguous();
  seq_lens = seq_lens.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t page_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == head_dim, "head counts or head_dim disagree");
  TORCH_CHECK(page_table.size(0) == batch && seq_lens.size(0) == batch, "one page-table row and length per request");
  if (batch > 0) {  // the kernel trusts these, so a bad table must fail here rather than read out of bounds
    TORCH_CHECK(seq_lens.min().item<int32_t>() >= 1 &&
                    seq_lens.max().item<int64_t>() <= page_table.size(1) * page_size,
                "seq_lens must lie in 1 .. page_table width * page_size");
    TORCH_CHECK(page_table.min().item<int32_t>() >= 0 && page_table.max().item<int64_t>() < k_cache.size(0),
                "page ids must index the cache");
  }
  auto out = torch::empty_like(q);
  auto lse = torch::empty({batch, heads}, q.options().dtype(torch::kFloat32));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    auto run = [&](auto kernel) {
      kernel(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
             page_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(),
             lse.data_ptr<float>(), batch, heads, kv_heads, head_dim, page_size, page_table.size(1),
             static_cast<float>(scale), window);
    };
    if (head_dim == 8 * kLanes) run(decode_kernel<scalar_t, 8>);
    else if (head_dim == 16 * kLanes) run(decode_kernel<scalar_t, 16>);
    else run(decode_kernel<scalar_t, 0>);
  });
  return {out, lse};
}
