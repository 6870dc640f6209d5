// Paged decode attention for the CPU, reading K/V pages where they lie in the pool.
//
// Work items are (chunk of requests, kv head). Each query row keeps an online softmax (fp32) over the pages it
// walks, so every key and value is read in place and nothing is copied. A chunk may carry a shared prefix
// (cascade attention): the pages that all its requests begin with are walked once for all of the chunk's query
// rows while they sit in cache, then each request walks its own pages; there is nothing to merge, since one
// online softmax runs over both parts. Without chunks every request is its own chunk.
//
// Scores come a vector's width of keys at a time (a block: 16 keys with AVX-512, 8 with AVX2): one partial-sum
// vector per key, folded into one vector of scores by a transposing reduction. Two ways to multiply, chosen per call:
// - bf16 dot (bf16 caches, head_dim a multiple of 32, a CPU with AVX512-BF16): q stays bf16 and each
//   `vdpbf16ps` multiplies 32 bf16 pairs into fp32 (products exact, as a bf16 GEMM's); the weights of the
//   values are rounded to bf16, as torch's bf16 flash attention rounds them, and two value rows at a time are
//   interleaved into pairs, so the accumulator holds its dims in a fixed permutation, undone at the end. A part's
//   pages are gathered into blocks and walked a span of 8 blocks at a time: one softmax rescale per span and row,
//   the next span prefetched while this one is computed. A GQA group stays together in one tile of rows (a group
//   of 3 is one tile of 3), so each key and value is loaded once for the group. Against a walk page by page with
//   a softmax step per block, a decode step of batch 32 at 340-700 keys (30 layers) went from 40.5 ms to 20.8
//   ms (radixrt.bench.decode_attention_bench). On a CPU with AMX (decode_tiles_usable) the spans' products run
//   on tiles instead (attend_amx.h), up to 16 query rows a tile: there a chunk's requests that read the same pages
//   (a verify step's rows of one request) walk them together, each row masked at its own length, and each row
//   gets the bits it gets walked alone;
// - portable (every dtype and CPU): keys and values widened to fp32 as they load, q pre-scaled in fp32, one softmax
//   step per block, pages prefetched a few ahead (from DRAM the kernel otherwise ran at half its speed from
//   cache), rows in tiles of up to four.
// Layout as in torch_ref.py: caches are [num_pages, page_size, kv_heads, head_dim].
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "attend_amx.h"
#include "bf16_pairs.h"
#include "dtype_vec.h"

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define RADIXRT_BF16_DOT 1
#endif

namespace {

using radixrt::hmax;
using radixrt::hsum;
using radixrt::kLanes;
using radixrt::load_floats;
using radixrt::Vec;
using radixrt::pairs::permuted_dim;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();


// Lane t of the result is the sum of the lanes of part[t]: kLanes horizontal sums for the price of about three
// shuffles and adds a key (pairs, then quads, then 128-bit lanes are folded together).
inline Vec hsum_each(const Vec* part) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 quads[4];
  for (int i = 0; i < 4; ++i) {
    __m512 pairs[2];
    for (int h = 0; h < 2; ++h) {
      const __m512 a = part[4 * i + 2 * h], b = part[4 * i + 2 * h + 1];
      pairs[h] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    }
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  __m512 octs[2];
  for (int i = 0; i < 2; ++i) {
    octs[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(octs[0], octs[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(octs[0], octs[1], _MM_SHUFFLE(3, 1, 3, 1)));
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 quads[2];
  for (int i = 0; i < 2; ++i) {
    __m256 pairs[2];
    for (int h = 0; h < 2; ++h) {
      const __m256 a = part[4 * i + 2 * h], b = part[4 * i + 2 * h + 1];
      pairs[h] = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
    }
    quads[i] = _mm256_add_ps(_mm256_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                       _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
#else
  float sums[kLanes];
  for (int64_t t = 0; t < kLanes; ++t) sums[t] = hsum(part[t]);
  return Vec::loadu(sums);
#endif
}

// lanes at or past n set to `fill`
inline Vec keep_first(Vec v, int64_t n, float fill) {
  if (n >= kLanes) return v;
  alignas(64) float lanes[kLanes];
  v.store(lanes);
  for (int64_t t = n; t < kLanes; ++t) lanes[t] = fill;
  return Vec::loadu(lanes);
}

// The online-softmax state of one query row.
struct RowState {
  float* acc;  // [head_dim], unnormalised (in the bf16 dot's permuted order on that path)
  float m;     // running max of the scores
  float l;     // running sum of exp(score - m)
};

// Folds a block's scores into the row's state: returns the rescale of the accumulator and leaves the block's
// weights exp(s - max) in `p` (lanes past n: 0). kFastExp: ATen's exp_u20 (20 ulp, a third of the work),
// for weights that are rounded to bf16/fp16 anyway.
template <bool kFastExp>
inline float softmax_step(RowState& row, Vec s, int64_t n, float* p) {
  s = keep_first(s, n, kNegInf);
  const float top = std::max(row.m, hmax(s));
  const float rescale = radixrt::softmax_rescale(row.m, top);
  const Vec w = kFastExp ? (s - Vec(top)).exp_u20() : (s - Vec(top)).exp();
  w.store(p);
  row.l = row.l * rescale + hsum(w);
  row.m = top;
  return rescale;
}

// ---- portable: fp32 arithmetic on widened keys and values -------------------------------------------------
// kChunks = head_dim / lanes when known at compile time (registers), 0 = a run-time width with a scalar tail.

template <typename T, int kChunks>
inline Vec scores_fp32(const float* qf, const T* k, int64_t token_stride, int64_t n, int64_t head_dim) {
  const int64_t chunks = kChunks > 0 ? kChunks : head_dim / kLanes;
  Vec part[kLanes];
  for (int64_t t = 0; t < kLanes; ++t) {
    Vec a(0.f);
    if (t < n) {
      const T* kt = k + t * token_stride;
      for (int64_t c = 0; c < chunks; ++c) a = at::vec::fmadd(Vec::loadu(qf + c * kLanes), load_floats(kt + c * kLanes), a);
    }
    part[t] = a;
  }
  Vec s = hsum_each(part);
  if (kChunks == 0 && chunks * kLanes < head_dim) {
    alignas(64) float lanes[kLanes];
    s.store(lanes);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t d = chunks * kLanes; d < head_dim; ++d) lanes[t] += qf[d] * static_cast<float>(k[t * token_stride + d]);
    }
    s = Vec::loadu(lanes);
  }
  return s;
}

// acc[r] = acc[r] * rescale[r] + sum_t p[r][t] v[t] for kRows rows side by side (each value converted once for
// all of them); kRows is 1 unless kChunks is known.
template <typename T, int kChunks, int kRows>
inline void accumulate_fp32(RowState* const* rows, const float* rescale, const float (*p)[kLanes], const T* v,
                            int64_t token_stride, int64_t n, int64_t head_dim) {
  if constexpr (kChunks > 0) {  // the accumulator rows in registers, each value loaded once
    Vec r[kRows][kChunks];
    for (int i = 0; i < kRows; ++i) {
      for (int c = 0; c < kChunks; ++c) r[i][c] = Vec::loadu(rows[i]->acc + c * kLanes) * Vec(rescale[i]);
    }
    for (int64_t t = 0; t < n; ++t) {
      const T* vt = v + t * token_stride;
      for (int c = 0; c < kChunks; ++c) {
        const Vec x = load_floats(vt + c * kLanes);
        for (int i = 0; i < kRows; ++i) r[i][c] = at::vec::fmadd(Vec(p[i][t]), x, r[i][c]);
      }
    }
    for (int i = 0; i < kRows; ++i) {
      for (int c = 0; c < kChunks; ++c) r[i][c].store(rows[i]->acc + c * kLanes);
    }
  } else {
    static_assert(kRows == 1, "a run-time width takes one row at a time");
    float* acc = rows[0]->acc;
    const int64_t chunks = head_dim / kLanes;
    for (int64_t c = 0; c < chunks; ++c) {
      Vec r = Vec::loadu(acc + c * kLanes) * Vec(rescale[0]);
      for (int64_t t = 0; t < n; ++t) r = at::vec::fmadd(Vec(p[0][t]), load_floats(v + t * token_stride + c * kLanes), r);
      r.store(acc + c * kLanes);
    }
    for (int64_t d = chunks * kLanes; d < head_dim; ++d) {
      float x = acc[d] * rescale[0];
      for (int64_t t = 0; t < n; ++t) x += p[0][t] * static_cast<float>(v[t * token_stride + d]);
      acc[d] = x;
    }
  }
}

// A run of at most kLanes keys of one kv head that lie next to each other in a page; `start`: the index of its
// first key in the part of the keys being walked (a row that may see keys before some limit sees it).
template <typename T>
struct Block {
  const T *k, *v;
  int64_t n;
  int64_t start;
};

// ---- bf16 dot: vdpbf16ps on bf16 pairs ----------------------------------------------------------------------
#ifdef RADIXRT_BF16_DOT
// kPairs = head_dim / 32: the 512-bit vectors of bf16 one row of q, k or v spans.

template <int kPairs>
inline Vec scores_bf16(const c10::BFloat16* q, const c10::BFloat16* k, int64_t token_stride, int64_t n, float scale) {
  __m512bh qv[kPairs];
  for (int c = 0; c < kPairs; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  Vec part[kLanes];
  for (int64_t t = 0; t < kLanes; ++t) {
    __m512 a = _mm512_setzero_ps();
    if (t < n) {
      const c10::BFloat16* kt = k + t * token_stride;
      for (int c = 0; c < kPairs; ++c) a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(kt + 32 * c));
    }
    part[t] = a;
  }
  return hsum_each(part) * Vec(scale);
}

constexpr int64_t kSpan = 8;  // blocks whose keys share one softmax rescale (128 keys with AVX-512)

// kRows query rows over `count` (<= kSpan) blocks: scores for the whole span first, then one max, one rescale of
// the accumulators and one pass of exponentials per row, then the weighted values. A per-block softmax spent
// more on its bookkeeping (maxima, rescales, the serial chain between them) than on the dot products.
template <int kPairs, int kRows>
inline void attend_span_bf16(const c10::BFloat16* const* q, float scale, RowState* rows,
                             const Block<c10::BFloat16>* blocks, int64_t count, int64_t token_stride) {
  alignas(64) float s[kSpan][kLanes];
  alignas(64) uint32_t pairs[kRows][kSpan][kLanes / 2];
  float rescale[kRows];
  for (int i = 0; i < kRows; ++i) {
    Vec top(kNegInf);
    for (int64_t j = 0; j < count; ++j) {
      const Vec sc = keep_first(scores_bf16<kPairs>(q[i], blocks[j].k, token_stride, blocks[j].n, scale),
                                blocks[j].n, kNegInf);
      sc.store(s[j]);
      top = at::vec::maximum(top, sc);
    }
    RowState& row = rows[i];
    const float m = std::max(row.m, hmax(top));
    rescale[i] = radixrt::softmax_rescale(row.m, m);
    Vec sum(0.f);
    for (int64_t j = 0; j < count; ++j) {
      const Vec w = (Vec::loadu(s[j]) - Vec(m)).exp_u20();
      sum = sum + w;
      // to bf16 by the CPU's conversion: nearest even, as c10 rounds, in one instruction; a weight below fp32's
      // normal range (1e-38) becomes 0 there, where its share of any sum lies far below the sum's last bit
      _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[i][j]), (__m256i)_mm512_cvtneps_pbh(w));
    }
    row.l = row.l * rescale[i] + hsum(sum);
    row.m = m;
  }
  __m512 lo[kRows][kPairs], hi[kRows][kPairs];
  for (int i = 0; i < kRows; ++i) {
    const __m512 vrescale = _mm512_set1_ps(rescale[i]);
    for (int c = 0; c < kPairs; ++c) {
      lo[i][c] = _mm512_mul_ps(_mm512_loadu_ps(rows[i].acc + 32 * c), vrescale);
      hi[i][c] = _mm512_mul_ps(_mm512_loadu_ps(rows[i].acc + 32 * c + 16), vrescale);
    }
  }
  for (int64_t j = 0; j < count; ++j) {
    const c10::BFloat16* v = blocks[j].v;
    const int64_t n = blocks[j].n;
    for (int64_t t = 0; t < n; t += 2) {
      const c10::BFloat16* v0 = v + t * token_stride;
      for (int c = 0; c < kPairs; ++c) {
        const __m512i a = _mm512_loadu_si512(v0 + 32 * c);
        const __m512i b = t + 1 < n ? _mm512_loadu_si512(v0 + token_stride + 32 * c) : _mm512_setzero_si512();
        const __m512bh even = (__m512bh)_mm512_unpacklo_epi16(a, b), odd = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int i = 0; i < kRows; ++i) {
          const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[i][j][t / 2]));
          lo[i][c] = _mm512_dpbf16_ps(lo[i][c], even, w);
          hi[i][c] = _mm512_dpbf16_ps(hi[i][c], odd, w);
        }
      }
    }
  }
  for (int i = 0; i < kRows; ++i) {
    for (int c = 0; c < kPairs; ++c) {
      _mm512_storeu_ps(rows[i].acc + 32 * c, lo[i][c]);
      _mm512_storeu_ps(rows[i].acc + 32 * c + 16, hi[i][c]);
    }
  }
}

// Rows [0, count) of a span, kTile at a time and the rest as one smaller tile (a GQA group of 3 stays together).
template <int kPairs, int kTile>
inline void attend_rows_bf16(const c10::BFloat16* const* q, float scale, RowState* rows, int64_t count,
                             const Block<c10::BFloat16>* blocks, int64_t nblocks, int64_t token_stride) {
  if constexpr (kTile > 0) {
    for (; count >= kTile; count -= kTile, q += kTile, rows += kTile) {
      attend_span_bf16<kPairs, kTile>(q, scale, rows, blocks, nblocks, token_stride);
    }
    if (count > 0) attend_rows_bf16<kPairs, kTile - 1>(q, scale, rows, count, blocks, nblocks, token_stride);
  }
}
#endif

// Asks for a coming page's rows of one kv head, into L2, while this page is computed: its rows are strided
// (the other heads lie between them) and a page holds too few for the hardware prefetcher to catch on. Cold
// (30 layers' caches in turn), batch 64 at 232 keys took 1.3 ms a layer without it and 0.84 with it.
template <typename T>
inline void prefetch_rows(const T* first, int64_t rows, int64_t token_stride, int64_t head_dim) {
  for (int64_t t = 0; t < rows; ++t) {
    const char* row = reinterpret_cast<const char*>(first + t * token_stride);
    for (int64_t byte = 0; byte < head_dim * static_cast<int64_t>(sizeof(T)); byte += 64) {
      __builtin_prefetch(row + byte, 0, 2);
    }
  }
}

constexpr int64_t kAhead = 3;  // pages ahead; 2 and 3 ran alike, 1 gained a tenth of what they do

template <typename T>
struct Args {
  const T *q, *k_cache, *v_cache;
  const int32_t *table, *lens;  // each request's own pages and how many keys they hold
  T* out;
  float* lse;
  int64_t batch, heads, kv_heads, head_dim, page_size, table_width, window;
  float scale;
  bool tiles;  // the bf16 path multiplies on AMX tiles (attend_amx.h)
  // chunks (nullptr rows: every request alone): rows[offsets[c] .. offsets[c + 1]) share the pages
  // shared_table[chunk_group[c]][0 .. shared_pages[chunk_group[c]]) unless chunk_group[c] < 0
  const int32_t *rows, *offsets, *chunk_group, *shared_table, *shared_pages;
  int64_t num_chunks, max_chunk, shared_width;
};

// Query rows that a row tile holds side by side: as many as keep their accumulators in registers, at most four.
template <int kWidth, bool kBf16Dot>
constexpr int row_tile() {
  constexpr int per_row = kBf16Dot ? 2 * kWidth : kWidth;  // accumulator vectors of one row
  return per_row == 0 ? 1 : std::max(1, std::min(4, 16 / per_row));
}

// Portable: kRows query rows (`qf` their scaled fp32 queries, `rows` their states) over tokens [lo, hi) of one
// page of one kv head, a block of kLanes keys at a time. kWidth: head_dim / lanes when known at compile time, else 0.
template <typename T, int kWidth, int kRows>
inline void attend_rows(const float* const* qf, RowState* const* rows, const T* k_page, const T* v_page, int64_t lo,
                        int64_t hi, int64_t token_stride, int64_t head_dim) {
  alignas(64) float p[kRows][kLanes];
  float rescale[kRows];
  for (int64_t b = lo; b < hi; b += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, hi - b);
    const T* k = k_page + b * token_stride;
    const T* v = v_page + b * token_stride;
    for (int i = 0; i < kRows; ++i) {
      rescale[i] = softmax_step<!std::is_same_v<T, float>>(
          *rows[i], scores_fp32<T, kWidth>(qf[i], k, token_stride, n, head_dim), n, p[i]);
    }
    accumulate_fp32<T, kWidth, kRows>(rows, rescale, p, v, token_stride, n, head_dim);
  }
}

// Portable: rows j0 .. j0 + count - 1 of a work item over one page, in tiles of row_tile() rows.
template <typename T, int kWidth>
inline void attend_page(const float* qf, RowState* state, int64_t j0, int64_t count, const T* k_page,
                        const T* v_page, int64_t lo, int64_t hi, int64_t token_stride, int64_t head_dim) {
  constexpr int kTile = row_tile<kWidth, false>();
  const float* qfs[kTile];
  RowState* rows[kTile];
  int64_t j = j0;
  for (; j + kTile <= j0 + count; j += kTile) {
    for (int i = 0; i < kTile; ++i) {
      qfs[i] = qf + (j + i) * head_dim;
      rows[i] = state + j + i;
    }
    attend_rows<T, kWidth, kTile>(qfs, rows, k_page, v_page, lo, hi, token_stride, head_dim);
  }
  for (; j < j0 + count; ++j) {
    qfs[0] = qf + j * head_dim;
    rows[0] = state + j;
    attend_rows<T, kWidth, 1>(qfs, rows, k_page, v_page, lo, hi, token_stride, head_dim);
  }
}

// Whether requests b and c read the same pages (a verify step's rows of one request): their tables' rows agree.
inline bool same_table(const int32_t* table, int64_t width, int64_t b, int64_t c) {
  return std::memcmp(table + b * width, table + c * width, width * sizeof(int32_t)) == 0;
}

template <typename T, int kWidth, bool kBf16Dot>
void decode_kernel(const Args<T>& a) {
  const int64_t group = a.heads / a.kv_heads, head_dim = a.head_dim, page_size = a.page_size;
  const int64_t token_stride = a.kv_heads * head_dim;
  const int64_t page_stride = page_size * token_stride;
  const int64_t num_chunks = a.rows ? a.num_chunks : a.batch;
  const int64_t max_rows = (a.rows ? a.max_chunk : 1) * group;
  constexpr int64_t kNoLimit = std::numeric_limits<int64_t>::max();
#ifdef RADIXRT_AMX
  const bool tiles = kBf16Dot && a.tiles;
#else
  const bool tiles = false;
#endif
  at::parallel_for(0, num_chunks * a.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(kBf16Dot ? 0 : max_rows * head_dim), acc(max_rows * head_dim);
    std::vector<const T*> qrow(max_rows);
    std::vector<RowState> state(max_rows);
    std::vector<int64_t> limit(max_rows, kNoLimit);
    std::vector<int64_t> members(a.rows ? a.max_chunk : 1);
    std::vector<Block<T>> blocks;
#ifdef RADIXRT_AMX
    std::unique_ptr<radixrt::amx::SpanScratch<kWidth>> scratch;
    std::optional<radixrt::amx::TileScope> tile_scope;
    if (tiles) {
      scratch = std::make_unique<radixrt::amx::SpanScratch<kWidth>>();  // zeroed
      tile_scope.emplace();
    }
#endif
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
          qrow[j] = a.q + (members[i] * a.heads + kh * group + g) * head_dim;
          if constexpr (!kBf16Dot) {
            for (int64_t d = 0; d < head_dim; ++d) qf[j * head_dim + d] = static_cast<float>(qrow[j][d]) * a.scale;
          }
          state[j] = RowState{acc.data() + j * head_dim, kNegInf, 0.f};
        }
      }
      std::fill(acc.begin(), acc.begin() + n * group * head_dim, 0.f);
      // bf16 dot: a part's pages are gathered into blocks, then walked a span of blocks at a time (the next
      // span prefetched); portable: page by page as they come. first_key: the page's first key in the part.
      auto walk = [&](int64_t j0, int64_t count, const T* k_page, const T* v_page, int64_t lo, int64_t hi,
                      int64_t first_key) {
        if constexpr (kBf16Dot) {
          for (int64_t b = lo; b < hi; b += kLanes) {
            blocks.push_back(Block<T>{k_page + b * token_stride, v_page + b * token_stride,
                                      std::min<int64_t>(kLanes, hi - b), first_key + b});
          }
        } else {
          attend_page<T, kWidth>(qf.data(), state.data(), j0, count, k_page, v_page, lo, hi, token_stride, head_dim);
        }
      };
      auto finish_part = [&](int64_t j0, int64_t count) {
#ifdef RADIXRT_BF16_DOT
        if constexpr (kBf16Dot) {
          const int64_t total = static_cast<int64_t>(blocks.size());
          const auto* bf16_blocks = reinterpret_cast<const Block<c10::BFloat16>*>(blocks.data());
          auto prefetch_span = [&](int64_t b) {
            for (int64_t f = b; f < std::min(total, b + kSpan); ++f) {
              prefetch_rows(blocks[f].k, blocks[f].n, token_stride, head_dim);
              prefetch_rows(blocks[f].v, blocks[f].n, token_stride, head_dim);
            }
          };
          if (tiles) {
#ifdef RADIXRT_AMX
            for (int64_t r = 0; r < count; r += radixrt::amx::kTileRows) {  // tiles of rows, each over every span
              const int rows = static_cast<int>(std::min(radixrt::amx::kTileRows, count - r));
              radixrt::amx::prepare_rows<kWidth>(
                  reinterpret_cast<const c10::BFloat16* const*>(qrow.data()) + j0 + r, rows, *scratch);
              prefetch_span(0);
              for (int64_t b = 0; b < total; b += kSpan) {
                prefetch_span(b + kSpan);
                radixrt::amx::attend_span_tiles<kWidth>(limit.data() + j0 + r, rows, a.scale, state.data() + j0 + r,
                                                        bf16_blocks + b, std::min(kSpan, total - b), token_stride,
                                                        *scratch);
              }
            }
#endif
          } else {
            prefetch_span(0);
            for (int64_t b = 0; b < total; b += kSpan) {
              prefetch_span(b + kSpan);
              attend_rows_bf16<kWidth, row_tile<kWidth, true>()>(
                  reinterpret_cast<const c10::BFloat16* const*>(qrow.data()) + j0, a.scale, state.data() + j0,
                  count, bf16_blocks + b, std::min(kSpan, total - b), token_stride);
            }
          }
        }
#endif
        blocks.clear();
      };
      auto prefetch_page = [&](int64_t page, int64_t rows) {  // this kv head's first `rows` rows, K and V
        const int64_t offset = page * page_stride + kh * head_dim;
        prefetch_rows(a.k_cache + offset, rows, token_stride, head_dim);
        prefetch_rows(a.v_cache + offset, rows, token_stride, head_dim);
      };
      const int64_t shared = a.rows && a.chunk_group[chunk] >= 0 ? a.chunk_group[chunk] : -1;
      if (shared >= 0) {
        const int32_t* pages = a.shared_table + shared * a.shared_width;
        const int64_t count = a.shared_pages[shared];
        for (int64_t p = 1; !kBf16Dot && p < std::min(count, kAhead); ++p) prefetch_page(pages[p], page_size);
        for (int64_t p = 0; p < count; ++p) {
          const T* k_page = a.k_cache + pages[p] * page_stride + kh * head_dim;
          const T* v_page = a.v_cache + pages[p] * page_stride + kh * head_dim;
          if (!kBf16Dot && p + kAhead < count) prefetch_page(pages[p + kAhead], page_size);
          walk(0, n * group, k_page, v_page, 0, page_size, p * page_size);
        }
        std::fill(limit.begin(), limit.begin() + n * group, kNoLimit);
        finish_part(0, n * group);
      }
      // Each request's own pages; on tiles, requests that read the same pages (a verify step's rows) walk them
      // together, each row up to its own length.
      for (int64_t i = 0, next; i < n; i = next) {
        next = i + 1;
        while (tiles && a.window == 0 && next < n && same_table(a.table, a.table_width, members[i], members[next])) {
          ++next;
        }
        int64_t longest = i;
        for (int64_t m = i; m < next; ++m) {
          if (a.lens[members[m]] > a.lens[members[longest]]) longest = m;
          for (int64_t g = 0; g < group; ++g) limit[m * group + g] = a.lens[members[m]];
        }
        const int64_t b = members[longest], len = a.lens[b];
        const int64_t first = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
        const int64_t first_page = first / page_size, pages = (len + page_size - 1) / page_size;
        const int32_t* row_pages = a.table + b * a.table_width;
        auto rows_of = [&](int64_t p) { return std::min(page_size, len - p * page_size); };
        for (int64_t p = first_page + 1; !kBf16Dot && p < std::min(pages, first_page + kAhead); ++p) {
          prefetch_page(row_pages[p], rows_of(p));
        }
        for (int64_t start = first - first % page_size; start < len; start += page_size) {
          const int64_t page = a.table[b * a.table_width + start / page_size];
          const int64_t lo = std::max(start, first) - start, hi = std::min(start + page_size, len) - start;
          const T* k_page = a.k_cache + page * page_stride + kh * head_dim;
          const T* v_page = a.v_cache + page * page_stride + kh * head_dim;
          const int64_t ahead = start / page_size + kAhead;
          if (!kBf16Dot && ahead < pages) prefetch_page(row_pages[ahead], rows_of(ahead));
          walk(i * group, (next - i) * group, k_page, v_page, lo, hi, start);
        }
        finish_part(i * group, (next - i) * group);
        for (int64_t m = i; m < next; ++m) {
          for (int64_t g = 0; g < group; ++g) {
            const RowState& row = state[m * group + g];
            const int64_t out_row = members[m] * a.heads + kh * group + g;
            const float inv = 1.f / row.l;
            for (int64_t d = 0; d < head_dim; ++d) {
              const float x = row.acc[kBf16Dot ? permuted_dim(d) : d];
              a.out[out_row * head_dim + d] = static_cast<T>(x * inv);
            }
            a.lse[out_row] = row.m + std::log(row.l);
          }
        }
      }
    }
  });
}

// The instantiation for this head_dim and path: the width in registers where it is one of the common ones.
template <typename T>
void dispatch(const Args<T>& args, bool bf16_dot) {
#ifdef RADIXRT_BF16_DOT
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (bf16_dot) {
      if (args.head_dim == 64) return decode_kernel<T, 2, true>(args);
      if (args.head_dim == 128) return decode_kernel<T, 4, true>(args);
      if (args.head_dim == 32) return decode_kernel<T, 1, true>(args);
    }
  }
#endif
  const int64_t width = args.head_dim % kLanes == 0 ? args.head_dim / kLanes : 0;
  if (width == 4) return decode_kernel<T, 4, false>(args);
  if (width == 8) return decode_kernel<T, 8, false>(args);
  if (width == 16) return decode_kernel<T, 16, false>(args);
  decode_kernel<T, 0, false>(args);
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

at::Tensor int32_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt, name, " must be int32");
  return t.contiguous();
}

}  // namespace

// Whether the bf16 dot's products can run on AMX tiles here (an AMX build, the tiles granted to the process).
bool decode_tiles_usable() {
#if defined(RADIXRT_AMX) && defined(RADIXRT_BF16_DOT)
  return radixrt::amx::tiles_permitted();
#else
  return false;
#endif
}

// Whether this build multiplies bf16 with vdpbf16ps (the CPU has AVX512-BF16 and the kernels were built for it).
bool bf16_dot_built() {
#ifdef RADIXRT_BF16_DOT
  return true;
#else
  return false;
#endif
}

// q [B, H, D]; caches [P, S, KH, D] (same dtype as q); page_table [B, W] int32; seq_lens [B] int32 (>= 1).
// Returns (out [B, H, D], lse [B, H] fp32); window > 0 keeps only the last `window` keys.
// Cascade (all of chunk_rows .. shared_pages given, window 0): chunk_rows [B] int32 lists every request once,
// chunk c being chunk_rows[chunk_offsets[c] .. chunk_offsets[c + 1]); chunk_group [C] names the row of
// shared_table [G, SW] (with shared_pages [G] full pages) its requests all begin with, or -1. Then page_table
// and seq_lens describe each request's keys after its shared pages.
// portable: the fp32 path even where the bf16 dot would run (tests compare the two); tiles: the bf16 dot's products
// on AMX tiles where decode_tiles_usable() (else it is ignored).
std::vector<at::Tensor> paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor page_table,
                                     at::Tensor seq_lens, double scale, int64_t window,
                                     c10::optional<at::Tensor> chunk_rows, c10::optional<at::Tensor> chunk_offsets,
                                     c10::optional<at::Tensor> chunk_group, c10::optional<at::Tensor> shared_table,
                                     c10::optional<at::Tensor> shared_pages, bool portable, bool tiles) {
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
  at::Tensor rows, offsets, groups, shared, shared_count;
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
  auto out = at::empty_like(q);
  auto lse = at::empty({batch, heads}, q.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    Args<scalar_t> args{q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                        page_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(),
                        lse.data_ptr<float>(), batch, heads, kv_heads, head_dim, page_size, page_table.size(1),
                        window, static_cast<float>(scale), tiles && !portable && decode_tiles_usable(),
                        given ? rows.data_ptr<int32_t>() : nullptr, given ? offsets.data_ptr<int32_t>() : nullptr,
                        given ? groups.data_ptr<int32_t>() : nullptr, given ? shared.data_ptr<int32_t>() : nullptr,
                        given ? shared_count.data_ptr<int32_t>() : nullptr, num_chunks, max_chunk,
                        given ? shared.size(1) : 0};
    dispatch(args, !portable);
  });
  return {out, lse};
}
