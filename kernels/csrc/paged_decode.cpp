// Paged decode attention for the CPU, reading K/V pages where they lie in the pool.
//
// Work items are (chunk of requests, kv head). Each query row keeps an online softmax (fp32) over the pages it
// walks, so every key and value is read in place and nothing is copied. A chunk may carry a shared prefix
// (cascade attention): the pages that all its requests begin with are walked once for all of the chunk's query
// rows while they sit in cache, then each request walks its own pages; there is nothing to merge, since one
// online softmax runs over both parts. Without chunks every request is its own chunk.
// The arithmetic is at::vec fp32 (keys and values converted as they load). A head_dim of 8 or 16 vectors is
// unrolled at compile time: with AVX2 the scores come four keys at a time (eight FMA chains, one transposing
// reduction), and at 8 vectors the accumulator row stays in registers while the values stream past. Any other
// head_dim runs the same code with a run-time width and a scalar tail.
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

// The online-softmax state of one query row.
struct RowState {
  float* acc;  // [head_dim], unnormalised
  float m;     // running max of the scores
  float l;     // running sum of exp(score - m)
};

// One query row `qg` (pre-scaled fp32) over tokens [lo, hi) of one page of one kv head.
// kChunks = head_dim / lanes when known at compile time (registers), 0 = `chunks` at run time.
template <typename T, int kChunks>
inline void attend_page(const float* qg, RowState& row, const T* k_page, const T* v_page, int64_t lo, int64_t hi,
                        int64_t token_stride, int64_t head_dim, int64_t run_chunks, float* s) {
  const int64_t chunks = kChunks > 0 ? kChunks : run_chunks;
  float top = row.m;
  int64_t t = lo;
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (kChunks > 0 && kLanes == 8) {
    // four keys at a time: eight independent FMA chains, then one transposing reduction for the four dots
    for (; t + 4 <= hi; t += 4) {
      const T* k = k_page + t * token_stride;
      Vec a[4] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
      Vec b[4] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
      for (int64_t c = 0; c < kChunks; c += 2) {
        const Vec q0 = Vec::loadu(qg + c * kLanes), q1 = Vec::loadu(qg + (c + 1) * kLanes);
        for (int i = 0; i < 4; ++i) {
          a[i] = at::vec::fmadd(q0, load_float(k + i * token_stride + c * kLanes), a[i]);
          b[i] = at::vec::fmadd(q1, load_float(k + i * token_stride + (c + 1) * kLanes), b[i]);
        }
      }
      const __m256 h01 = _mm256_hadd_ps(a[0] + b[0], a[1] + b[1]);
      const __m256 h23 = _mm256_hadd_ps(a[2] + b[2], a[3] + b[3]);
      const __m256 h = _mm256_hadd_ps(h01, h23);
      const __m128 dots = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
      _mm_storeu_ps(s + t, dots);
      top = std::max(top, std::max(std::max(s[t], s[t + 1]), std::max(s[t + 2], s[t + 3])));
    }
  }
#endif
  for (; t < hi; ++t) {
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
  const float rescale = std::exp(row.m - top);  // 0 on the first page (m = -inf)
  const Vec vtop(top);
  t = lo;
  Vec vsum(0.f);
  for (; t + kLanes <= hi; t += kLanes) {
    const Vec p = (Vec::loadu(s + t) - vtop).exp();
    p.store(s + t);
    vsum = vsum + p;
  }
  float sum = row.l * rescale + hsum(vsum);
  for (; t < hi; ++t) {
    s[t] = std::exp(s[t] - top);
    sum += s[t];
  }
  float* a = row.acc;
  const Vec vrescale(rescale);
  if constexpr (kChunks == 8) {  // the whole accumulator row in registers, each weight broadcast once
    Vec r[8];
    for (int c = 0; c < 8; ++c) r[c] = Vec::loadu(a + c * kLanes) * vrescale;
    for (int64_t u = lo; u < hi; ++u) {
      const Vec w(s[u]);
      const T* v = v_page + u * token_stride;
      for (int c = 0; c < 8; ++c) r[c] = at::vec::fmadd(w, load_float(v + c * kLanes), r[c]);
    }
    for (int c = 0; c < 8; ++c) r[c].store(a + c * kLanes);
  } else {
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
  }
  for (int64_t d = chunks * kLanes; d < head_dim; ++d) {
    float x = a[d] * rescale;
    for (int64_t u = lo; u < hi; ++u) x += s[u] * static_cast<float>(v_page[u * token_stride + d]);
    a[d] = x;
  }
  row.m = top;
  row.l = sum;
}

template <typename T>
struct Args {
  const T *q, *k_cache, *v_cache;
  const int32_t *table, *lens;  // each request's own pages and how many keys they hold
  T* out;
  float* lse;
  int64_t batch, heads, kv_heads, head_dim, page_size, table_width, window;
  float scale;
  // chunks (nullptr rows: every request alone): rows[offsets[c] .. offsets[c + 1]) share the pages
  // shared_table[chunk_group[c]][0 .. shared_pages[chunk_group[c]]) unless chunk_group[c] < 0
  const int32_t *rows, *offsets, *chunk_group, *shared_table, *shared_pages;
  int64_t num_chunks, max_chunk, shared_width;
};

template <typename T, int kChunks>
void decode_kernel(const Args<T>& a) {
  const int64_t group = a.heads / a.kv_heads, head_dim = a.head_dim, page_size = a.page_size;
  const int64_t run_chunks = head_dim / kLanes;
  const int64_t token_stride = a.kv_heads * head_dim;
  const int64_t page_stride = page_size * token_stride;
  const int64_t num_chunks = a.rows ? a.num_chunks : a.batch;
  const int64_t max_rows = (a.rows ? a.max_chunk : 1) * group;
  at::parallel_for(0, num_chunks * a.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(max_rows * head_dim), acc(max_rows * head_dim), scores(page_size + kLanes);
    std::vector<RowState> state(max_rows);
    std::vector<int64_t> members(a.rows ? a.max_chunk : 1);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item / a.kv_heads, kh = item % a.kv_heads;
      int64_t n = 1;
      if (a.rows) {
        n = a.offsets[chunk + 1] - a.offsets[chunk];
        for (int64_t i = 0; i < n; ++i) members[i] = a.rows[a.offsets[chunk] + i];
      } else {
        members[0] = chunk;
      }
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t j = i * group + g;
          const T* src = a.q + (members[i] * a.heads + kh * group + g) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) qf[j * head_dim + d] = static_cast<float>(src[d]) * a.scale;
          state[j] = RowState{acc.data() + j * head_dim, -std::numeric_limits<float>::infinity(), 0.f};
        }
      }
      std::fill(acc.begin(), acc.begin() + n * group * head_dim, 0.f);
      const int64_t shared = a.rows && a.chunk_group[chunk] >= 0 ? a.chunk_group[chunk] : -1;
      if (shared >= 0) {
        for (int64_t p = 0; p < a.shared_pages[shared]; ++p) {
          const int64_t page = a.shared_table[shared * a.shared_width + p];
          const T* k_page = a.k_cache + page * page_stride + kh * head_dim;
          const T* v_page = a.v_cache + page * page_stride + kh * head_dim;
          for (int64_t j = 0; j < n * group; ++j) {
            attend_page<T, kChunks>(qf.data() + j * head_dim, state[j], k_page, v_page, 0, page_size, token_stride,
                                    head_dim, run_chunks, scores.data());
          }
        }
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t b = members[i], len = a.lens[b];
        const int64_t first = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
        for (int64_t start = first - first % page_size; start < len; start += page_size) {
          const int64_t page = a.table[b * a.table_width + start / page_size];
          const int64_t lo = std::max(start, first) - start, hi = std::min(start + page_size, len) - start;
          const T* k_page = a.k_cache + page * page_stride + kh * head_dim;
          const T* v_page = a.v_cache + page * page_stride + kh * head_dim;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t j = i * group + g;
            attend_page<T, kChunks>(qf.data() + j * head_dim, state[j], k_page, v_page, lo, hi, token_stride,
                                    head_dim, run_chunks, scores.data());
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          const RowState& row = state[i * group + g];
          const int64_t out_row = b * a.heads + kh * group + g;
          const float inv = 1.f / row.l;
          for (int64_t d = 0; d < head_dim; ++d) a.out[out_row * head_dim + d] = static_cast<T>(row.acc[d] * inv);
          a.lse[out_row] = row.m + std::log(row.l);
        }
      }
    }
  });
}

// The kernel trusts its tables, so they are checked here, in one pass over the entries it will read.
void check_tables(const int32_t* table, const int32_t* lens, int64_t batch, int64_t width, int64_t page_size,
                  int64_t num_pages) {
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lens[b];
    TORCH_CHECK(len >= 1 && len <= width * page_size, "seq_lens must lie in 1 .. page_table width * page_size");
    for (int64_t p = 0; p < (len + page_size - 1) / page_size; ++p) {
      const int64_t page = table[b * width + p];
      TORCH_CHECK(page >= 0 && page < num_pages, "page ids must index the cache");
    }
  }
}

torch::Tensor int32_contiguous(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kInt32, name, " must be int32");
  return t.contiguous();
}

}  // namespace

// q [B, H, D]; caches [P, S, KH, D] (same dtype as q); page_table [B, W] int32; seq_lens [B] int32 (>= 1).
// Returns (out [B, H, D], lse [B, H] fp32); window > 0 keeps only the last `window` keys.
// Cascade (all of chunk_rows .. shared_pages given, window 0): chunk_rows [B] int32 lists every request once,
// chunk c being chunk_rows[chunk_offsets[c] .. chunk_offsets[c + 1]); chunk_group [C] names the row of
// shared_table [G, SW] (with shared_pages [G] full pages) its requests all begin with, or -1. Then page_table
// and seq_lens describe each request's keys after its shared pages.
std::vector<torch::Tensor> paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                        torch::Tensor page_table, torch::Tensor seq_lens, double scale,
                                        int64_t window, c10::optional<torch::Tensor> chunk_rows,
                                        c10::optional<torch::Tensor> chunk_offsets,
                                        c10::optional<torch::Tensor> chunk_group,
                                        c10::optional<torch::Tensor> shared_table,
                                        c10::optional<torch::Tensor> shared_pages) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q must be [B, H, D] and the caches [P, S, KH, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  q = q.contiguous();
  page_table = int32_contiguous(page_table, "page_table");
  seq_lens = int32_contiguous(seq_lens, "seq_lens");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t page_size = k_cache.size(1), kv_heads = k_cache.size(2), num_pages = k_cache.size(0);
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == head_dim, "head counts or head_dim disagree");
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == batch && seq_lens.numel() == batch,
              "one page-table row and length per request");
  check_tables(page_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), batch, page_table.size(1), page_size,
               num_pages);
  const int given = chunk_rows.has_value() + chunk_offsets.has_value() + chunk_group.has_value() +
                    shared_table.has_value() + shared_pages.has_value();
  TORCH_CHECK(given == 0 || given == 5, "the cascade needs all of chunk_rows, chunk_offsets, chunk_group, "
              "shared_table and shared_pages");
  torch::Tensor rows, offsets, groups, shared, shared_count;
  int64_t num_chunks = 0, max_chunk = 0;
  if (given == 5) {
    TORCH_CHECK(window == 0, "the cascade has no sliding window");
    rows = int32_contiguous(*chunk_rows, "chunk_rows");
    offsets = int32_contiguous(*chunk_offsets, "chunk_offsets");
    groups = int32_contiguous(*chunk_group, "chunk_group");
    shared = int32_contiguous(*shared_table, "shared_table");
    shared_count = int32_contiguous(*shared_pages, "shared_pages");
    num_chunks = groups.numel();
    TORCH_CHECK(rows.numel() == batch && offsets.numel() == num_chunks + 1 && shared.dim() == 2 &&
                    shared_count.numel() == shared.size(0), "cascade tables disagree in size");
    const int32_t* off = offsets.data_ptr<int32_t>();
    TORCH_CHECK(off[0] == 0 && off[num_chunks] == batch, "chunk_offsets must run from 0 to the batch size");
    std::vector<char> seen(batch, 0);
    for (int64_t c = 0; c < num_chunks; ++c) {
      TORCH_CHECK(off[c + 1] >= off[c], "chunk_offsets must not decrease");
      max_chunk = std::max<int64_t>(max_chunk, off[c + 1] - off[c]);
      const int64_t g = groups.data_ptr<int32_t>()[c];
      TORCH_CHECK(g >= -1 && g < shared.size(0), "chunk_group must name a row of shared_table or be -1");
    }
    for (int64_t i = 0; i < batch; ++i) {
      const int64_t r = rows.data_ptr<int32_t>()[i];
      TORCH_CHECK(r >= 0 && r < batch && !seen[r], "chunk_rows must list every request once");
      seen[r] = 1;
    }
    for (int64_t g = 0; g < shared.size(0); ++g) {
      TORCH_CHECK(shared_count.data_ptr<int32_t>()[g] >= 0, "shared_pages must not be negative");
      for (int64_t p = 0; p < shared_count.data_ptr<int32_t>()[g]; ++p) {
        TORCH_CHECK(p < shared.size(1), "shared_pages exceeds the shared_table width");
        const int64_t page = shared.data_ptr<int32_t>()[g * shared.size(1) + p];
        TORCH_CHECK(page >= 0 && page < num_pages, "page ids must index the cache");
      }
    }
  }
  auto out = torch::empty_like(q);
  auto lse = torch::empty({batch, heads}, q.options().dtype(torch::kFloat32));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    Args<scalar_t> args{q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                        page_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(),
                        lse.data_ptr<float>(), batch, heads, kv_heads, head_dim, page_size, page_table.size(1),
                        window, static_cast<float>(scale),
                        given ? rows.data_ptr<int32_t>() : nullptr, given ? offsets.data_ptr<int32_t>() : nullptr,
                        given ? groups.data_ptr<int32_t>() : nullptr, given ? shared.data_ptr<int32_t>() : nullptr,
                        given ? shared_count.data_ptr<int32_t>() : nullptr, num_chunks, max_chunk,
                        given ? shared.size(1) : 0};
    if (head_dim == 8 * kLanes) decode_kernel<scalar_t, 8>(args);
    else if (head_dim == 16 * kLanes) decode_kernel<scalar_t, 16>(args);
    else decode_kernel<scalar_t, 0>(args);
  });
  return {out, lse};
}
