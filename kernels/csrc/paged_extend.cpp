// Prefill (extend) attention for the CPU over bf16 K/V pages read in place: each request's new tokens attend
// causally (and within a sliding window, if any) to all of its keys, the cached prefix and themselves.
//
// Work items are (request, kv head, block of new tokens): the block's query rows (tokens x the heads sharing
// the kv head, at most 48) meet the keys a span of 64 at a time, one online-softmax step a span. Scores are
// computed transposed, a vector per key over the rows: the rows' queries are packed once per item as 32-bit pairs
// of dims ([D/2][rows]), so one pair of a key's dims, broadcast, times a packed row gives 16 rows' partial sums,
// and a key's scores are D/2 pair dot products with no horizontal sum. The softmax then runs across keys lane by
// lane (a row per lane), its weights stored as bf16 pairs of keys per row ([pairs][rows]). Values are packed per
// span as pairs of keys ([pairs][D]: rows 2j and 2j+1 interleaved by 16-bit unpacks, which leaves the dims of each
// 32 in a fixed permutation that the output undoes), and the output accumulates transposed too ([D][rows]): a
// pair's weights, loaded as rows' vectors, times a dim's value pair, broadcast, gives 16 rows' partial sums of
// that dim. Against a softmax step per block of 16 keys and rows accumulated four at a time: 1.03-1.13x on a
// 2-vCPU Zen 4, level at 32 x 64 new tokens (python -m radixrt.bench.kernel_ab --base REV --extend ...).
// A pair dot product multiplies two bf16 pairs exactly and adds both products in fp32 (bf16_pairs.h):
// vdpbf16ps on CPUs with AVX512-BF16, two FMAs on other AVX-512 CPUs, scalar code elsewhere (for the tests of
// every CPU; on those CPUs the runtime keeps torch's attention). The softmax is fp32, its weights rounded to bf16
// before they meet the values, as torch's bf16 flash attention rounds them.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "bf16_pairs.h"
#include "dtype_vec.h"

namespace {

using bf16 = c10::BFloat16;
using namespace radixrt::pairs;
constexpr int64_t kBlock = 16;  // keys a block holds
constexpr int64_t kSpan = 64;   // keys one softmax step takes: four blocks
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

constexpr int64_t kMaxRows = 48;  // query rows a work item holds: three vectors of 16

struct Item {
  int64_t request, kv_head, first_token, tokens;
};

struct Args {
  const bf16 *q, *k_cache, *v_cache;
  const int32_t* table;
  const int64_t *prefix, *q_start;  // per request: cached keys, first row of q
  bf16* out;
  int64_t q_stride, heads, kv_heads, head_dim, page_size, table_width, window;
  float scale;
};

// One work item's buffers: its packed queries and state, and the block of keys being read.
struct Scratch {
  std::vector<uint32_t> queries;  // [D/2][rows]: pair i of row r at i * rows + r
  std::vector<float> pos;         // [rows] each row's position (padding rows see every key)
  std::vector<float> scores;      // [span keys][rows]
  std::vector<uint32_t> weights;  // [span / 2][rows]: bf16 weights of keys 2j and 2j + 1 of row r
  std::vector<float> m, l, rescale;
  std::vector<uint32_t> values;   // [span / 2][D]: key pair j, dims in unpack order
  std::vector<float> acc;         // [D][rows] unnormalised outputs, transposed (dims in unpack order)
  Scratch(int64_t rows, int64_t head_dim)
      : queries(head_dim / 2 * rows), pos(rows), scores(kSpan * rows), weights(kSpan / 2 * rows), m(rows),
        l(rows), rescale(rows), values(kSpan / 2 * head_dim), acc(rows * head_dim) {}
};

const bf16 kZeroRow[256] = {};

// The flat cache row of key `pos` of request b at kv head kh.
inline int64_t key_offset(const Args& a, int64_t b, int64_t kh, int64_t pos) {
  const int64_t page = a.table[b * a.table_width + pos / a.page_size];
  return ((page * a.page_size + pos % a.page_size) * a.kv_heads + kh) * a.head_dim;
}

// Asks for the keys and values [first, first + n) into L2 while the block before them is computed.
inline void prefetch_block(const Args& a, int64_t b, int64_t kh, int64_t first, int64_t n) {
  for (int64_t t = 0; t < n; ++t) {
    const int64_t offset = key_offset(a, b, kh, first + t);
    for (int64_t byte = 0; byte < a.head_dim * 2; byte += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(a.k_cache + offset) + byte, 0, 2);
      __builtin_prefetch(reinterpret_cast<const char*>(a.v_cache + offset) + byte, 0, 2);
    }
  }
}

// Values of keys [first, first + n) as pairs of keys, `keys` of them; missing keys are zero.
void pack_values(const Args& a, int64_t b, int64_t kh, int64_t first, int64_t n, int64_t keys, Scratch& w) {
  const int64_t D = a.head_dim;
  for (int64_t j = 0; j < keys / 2; ++j) {
    const bf16* v0 = 2 * j < n ? a.v_cache + key_offset(a, b, kh, first + 2 * j) : kZeroRow;
    const bf16* v1 = 2 * j + 1 < n ? a.v_cache + key_offset(a, b, kh, first + 2 * j + 1) : kZeroRow;
    uint32_t* dst = w.values.data() + j * D;
    for (int64_t c = 0; c < D; c += 32) {
#if defined(CPU_CAPABILITY_AVX512)
      const __m512i x = _mm512_loadu_si512(v0 + c), y = _mm512_loadu_si512(v1 + c);
      _mm512_storeu_si512(dst + c, _mm512_unpacklo_epi16(x, y));
      _mm512_storeu_si512(dst + c + 16, _mm512_unpackhi_epi16(x, y));
#else
      for (int64_t lane = 0; lane < 4; ++lane) {  // what the unpacks do, 128 bits at a time
        for (int64_t e = 0; e < 4; ++e) {
          const int64_t lo = c + lane * 8 + e;
          dst[c + lane * 4 + e] = static_cast<uint32_t>(v0[lo].x) | static_cast<uint32_t>(v1[lo].x) << 16;
          dst[c + 16 + lane * 4 + e] = static_cast<uint32_t>(v0[lo + 4].x) | static_cast<uint32_t>(v1[lo + 4].x) << 16;
        }
      }
#endif
    }
  }
}

// Scores of keys [first + k0, first + k0 + 8) for every row (kVecs vectors of 16 rows), scaled, into
// w.scores; missing keys read a zero row.
template <int kDim, int kVecs>
inline void score_keys(const Args& a, int64_t b, int64_t kh, int64_t first, int64_t k0, int64_t n, Scratch& w) {
  constexpr int64_t kKeys = 8, rows = kVecs * 16;
  const bf16* k[kKeys];
  for (int64_t t = 0; t < kKeys; ++t) k[t] = k0 + t < n ? a.k_cache + key_offset(a, b, kh, first + k0 + t) : kZeroRow;
  F16 s[kKeys][kVecs];
  for (int64_t t = 0; t < kKeys; ++t) {
    for (int v = 0; v < kVecs; ++v) s[t][v] = zeros();
  }
  for (int64_t i = 0; i < kDim / 2; ++i) {
    const uint32_t* qp = w.queries.data() + i * rows;
    for (int64_t t = 0; t < kKeys; ++t) {
      const uint32_t pair = pair_at(k[t] + 2 * i);
      for (int v = 0; v < kVecs; ++v) s[t][v] = dot2(s[t][v], qp + 16 * v, pair);
    }
  }
  for (int64_t t = 0; t < kKeys; ++t) {
    for (int v = 0; v < kVecs; ++v) store16(w.scores.data() + (k0 + t) * rows + 16 * v, scale16(s[t][v], a.scale));
  }
}

// The online softmax over the span's keys [first, first + keys), a row per lane: masks what a row may not see,
// folds the span into m and l, leaves each row's rescale and its weights as bf16 pairs of keys.
template <int kVecs>
inline void softmax_span(const Args& a, int64_t first, int64_t keys, Scratch& w) {
  using radixrt::Vec;
  constexpr int64_t rows = kVecs * 16;
  const Vec neg_inf(kNegInf), zero(0.f);
  for (int64_t r = 0; r < rows; r += radixrt::kLanes) {
    const Vec pos = Vec::loadu(w.pos.data() + r);
    Vec top = Vec::loadu(w.m.data() + r);
    for (int64_t t = 0; t < keys; ++t) {
      const Vec key(static_cast<float>(first + t));
      Vec visible = key <= pos;
      if (a.window > 0) visible = visible & (key > pos - Vec(static_cast<float>(a.window)));
      const Vec s = Vec::blendv(neg_inf, Vec::loadu(w.scores.data() + t * rows + r), visible);
      s.store(w.scores.data() + t * rows + r);
      top = at::vec::maximum(top, s);
    }
    const Vec seen = top != neg_inf;  // rows that have seen a key: else all their exps stay 0
    const Vec base = Vec::blendv(zero, top, seen);
    const Vec old = Vec::loadu(w.m.data() + r);
    const Vec rescale = (old - base).exp_u20();
    Vec sum(0.f);
    for (int64_t t = 0; t < keys; t += 2) {
      const Vec p0 = (Vec::loadu(w.scores.data() + t * rows + r) - base).exp_u20();
      const Vec p1 = (Vec::loadu(w.scores.data() + (t + 1) * rows + r) - base).exp_u20();
      sum = sum + p0 + p1;
      radixrt::store_bf16_pairs(w.weights.data() + t / 2 * rows + r, p0, p1);
    }
    (Vec::loadu(w.l.data() + r) * rescale + sum).store(w.l.data() + r);
    top.store(w.m.data() + r);
    rescale.store(w.rescale.data() + r);
  }
}

// acc[., d] = acc[., d] * rescale + weights . values[., d] for every row at once: the accumulator is kept
// transposed ([D][rows], a vector per dim over 16 rows), the weights of a key pair are loaded as rows' vectors and
// each dim's value pair is broadcast, 8 dims at a time, so a key pair costs a load per row vector, a broadcast
// per dim and nothing else beside its products.
template <int kDim, int kVecs>
inline void accumulate_span(int64_t keys, Scratch& w) {
  constexpr int64_t rows = kVecs * 16, kDims = kDim < 8 ? kDim : 8;
  F16 rescale[kVecs];
  for (int v = 0; v < kVecs; ++v) rescale[v] = load16(w.rescale.data() + 16 * v);
  for (int64_t d0 = 0; d0 < kDim; d0 += kDims) {
    F16 o[kDims][kVecs];
    for (int d = 0; d < kDims; ++d) {
      for (int v = 0; v < kVecs; ++v) o[d][v] = mul16(load16(w.acc.data() + (d0 + d) * rows + 16 * v), rescale[v]);
    }
    for (int64_t j = 0; j < keys / 2; ++j) {
      const uint32_t* weights = w.weights.data() + j * rows;
      const uint32_t* values = w.values.data() + j * kDim + d0;
      for (int d = 0; d < kDims; ++d) {
        for (int v = 0; v < kVecs; ++v) o[d][v] = dot2(o[d][v], weights + 16 * v, values[d]);
      }
    }
    for (int d = 0; d < kDims; ++d) {
      for (int v = 0; v < kVecs; ++v) store16(w.acc.data() + (d0 + d) * rows + 16 * v, o[d][v]);
    }
  }
}

template <int kDim, int kVecs>
void attend_item(const Args& a, const Item& item, Scratch& w) {
  constexpr int64_t rows = kVecs * 16;
  const int64_t b = item.request, kh = item.kv_head, group = a.heads / a.kv_heads;
  const int64_t n_rows = item.tokens * group, first_pos = a.prefix[b] + item.first_token;
  for (int64_t r = 0; r < rows; ++r) {  // pack the queries; padding rows are zero and see every key
    const bf16* q = r < n_rows ? a.q + (a.q_start[b] + item.first_token + r / group) * a.q_stride +
                                     (kh * group + r % group) * kDim
                               : kZeroRow;
    for (int64_t i = 0; i < kDim / 2; ++i) w.queries[i * rows + r] = pair_at(q + 2 * i);
    w.pos[r] = r < n_rows ? static_cast<float>(first_pos + r / group) : 3.0e38f;
  }
  std::fill(w.acc.begin(), w.acc.begin() + rows * kDim, 0.f);
  std::fill(w.m.begin(), w.m.begin() + rows, kNegInf);
  std::fill(w.l.begin(), w.l.begin() + rows, 0.f);
  const int64_t last_pos = first_pos + item.tokens - 1;
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, first_pos - a.window + 1) : 0;
  for (int64_t first = lo - lo % kBlock; first <= last_pos; first += kSpan) {
    const int64_t n = std::min(kSpan, last_pos + 1 - first);
    const int64_t keys = (n + kBlock - 1) / kBlock * kBlock;  // keys past n read zero rows and are masked
    if (first + kSpan <= last_pos) prefetch_block(a, b, kh, first + kSpan, std::min(kSpan, last_pos + 1 - first - kSpan));
    for (int64_t k0 = 0; k0 < keys; k0 += 8) score_keys<kDim, kVecs>(a, b, kh, first, k0, n, w);
    softmax_span<kVecs>(a, first, keys, w);
    pack_values(a, b, kh, first, n, keys, w);
    accumulate_span<kDim, kVecs>(keys, w);
  }
  for (int64_t r = 0; r < n_rows; ++r) {
    const float inv = 1.f / w.l[r];
    bf16* o = a.out + ((a.q_start[b] + item.first_token + r / group) * a.heads + kh * group + r % group) * kDim;
    for (int64_t d = 0; d < kDim; ++d) o[d] = static_cast<bf16>(w.acc[permuted_dim(d) * rows + r] * inv);
  }
}

// Orders the items so that the threads' contiguous shares cost about the same: by cost (keys seen), heaviest and
// lightest alternating. Causal items differ a lot (a prompt's last block sees all of it, its first block little).
void balance(std::vector<Item>& items, const int64_t* prefix, int64_t window) {
  auto cost = [&](const Item& it) {
    const int64_t keys = prefix[it.request] + it.first_token + it.tokens;
    return it.tokens * (window > 0 ? std::min(keys, window + it.tokens) : keys);
  };
  std::stable_sort(items.begin(), items.end(), [&](const Item& x, const Item& y) { return cost(x) > cost(y); });
  std::vector<Item> order;
  order.reserve(items.size());
  for (size_t lo = 0, hi = items.size(); lo < hi;) {
    order.push_back(items[lo++]);
    if (lo < hi) order.push_back(items[--hi]);
  }
  items.swap(order);
}

template <int kDim>
void extend_kernel(const Args& a, const std::vector<Item>& items, int64_t vecs) {
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch w(vecs * 16, kDim);
    for (int64_t it = begin; it < end; ++it) {
      if (vecs == 1) attend_item<kDim, 1>(a, items[it], w);
      else if (vecs == 2) attend_item<kDim, 2>(a, items[it], w);
      else attend_item<kDim, 3>(a, items[it], w);
    }
  });
}

}  // namespace

// Whether paged_extend runs a vector at a time here (an AVX-512 build) rather than on its scalar fallback.
bool paged_extend_vectorized() {
#if defined(CPU_CAPABILITY_AVX512)
  return true;
#else
  return false;
#endif
}

// q [T, H, D] bf16 (each head contiguous, tokens may be strided): the new tokens of every request back to
// back; caches [P, S, KH, D] bf16; page_table [B, W] int32; prefix_lens, extend_lens [B] (the new tokens'
// K/V already stored). Returns out [T, H, D]. window > 0 keeps only the last `window` keys of each query.
at::Tensor paged_extend(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor page_table,
                        at::Tensor prefix_lens, at::Tensor extend_lens, double scale, int64_t window) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16, "paged_extend takes bf16 q and caches");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [T, H, D], heads contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(), "the caches must be contiguous [P, S, KH, D]");
  const int64_t heads = q.size(1), head_dim = q.size(2), kv_heads = k_cache.size(2), page_size = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == head_dim && heads % kv_heads == 0, "head counts or head_dim disagree");
  TORCH_CHECK(head_dim == 64 || head_dim == 128 || head_dim == 32, "paged_extend takes head_dim 32, 64 or 128");
  page_table = page_table.to(at::kInt).contiguous();
  auto prefix = prefix_lens.to(at::kLong).contiguous(), extend = extend_lens.to(at::kLong).contiguous();
  const int64_t batch = prefix.numel(), width = page_table.size(1);
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == batch && extend.numel() == batch,
              "one page-table row, prefix and extend length per request");
  const int64_t group = heads / kv_heads;
  TORCH_CHECK(group <= kMaxRows, "at most 48 query heads a kv head");
  const int64_t tokens_per_item = kMaxRows / group, vecs = (tokens_per_item * group + 15) / 16;
  std::vector<int64_t> q_start(batch);
  std::vector<Item> items;
  int64_t total = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t p = prefix.data_ptr<int64_t>()[b], e = extend.data_ptr<int64_t>()[b];
    TORCH_CHECK(p >= 0 && e >= 0 && p + e <= width * page_size, "prefix + extend must fit the page table");
    for (int64_t pg = 0; pg < (p + e + page_size - 1) / page_size; ++pg) {
      const int64_t page = page_table.data_ptr<int32_t>()[b * width + pg];
      TORCH_CHECK(page >= 0 && page < k_cache.size(0), "page ids must index the cache");
    }
    q_start[b] = total;
    total += e;
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
      for (int64_t t0 = 0; t0 < e; t0 += tokens_per_item) {
        items.push_back(Item{b, kh, t0, std::min(tokens_per_item, e - t0)});
      }
    }
  }
  TORCH_CHECK(total == q.size(0), "q must hold every request's new tokens");
  balance(items, prefix.data_ptr<int64_t>(), window);
  auto out = at::empty({total, heads, head_dim}, q.options());
  const Args args{reinterpret_cast<const bf16*>(q.data_ptr()), reinterpret_cast<const bf16*>(k_cache.data_ptr()),
                  reinterpret_cast<const bf16*>(v_cache.data_ptr()), page_table.data_ptr<int32_t>(),
                  prefix.data_ptr<int64_t>(), q_start.data(),
                  reinterpret_cast<bf16*>(out.data_ptr()), q.stride(0), heads, kv_heads, head_dim, page_size, width,
                  window, static_cast<float>(scale)};
  if (head_dim == 64) extend_kernel<64>(args, items, vecs);
  else if (head_dim == 128) extend_kernel<128>(args, items, vecs);
  else extend_kernel<32>(args, items, vecs);
  return out;
}
