// The decode attention's spans of keys on AMX tiles: up to 16 query rows at once (bf16, head_dim 32 * kPairs).
//
// The steps of the vdpbf16ps path (paged_decode.cpp: attend_span_bf16), in the same order for each row, with the
// products on tiles:
// - scores, a block of up to 16 keys at a time: S^T = K Q^T, K the A tile read in place (rows token_stride apart;
//   a block of fewer keys from a zero-padded copy), Q^T the B tile (the rows' pairs of dims, made once per tile
//   of rows: prepare_rows); S^T is transposed into a row of scores per query;
// - per row: one max over the span (keys past the row's own limit at -inf), one rescale, exp_u20 weights (exactly
//   0 past the limit) rounded to bf16, their sum;
// - values, 32 keys at a time: P V, P (the rows' weights) the A tile, V the B tile: two keys' values interleaved
//   by 16-bit unpacks, so the accumulator holds its dims in the order permuted_dim undoes, as the bf16 dot's does.
// A row's sums read its own row of q and of P alone (a tile product's row reads one row of A), so a row gets the
// same bits in a tile of 3 rows or of 16, and walked with other rows over more keys than its own (those weigh
// exactly 0, and a span with none of its keys rescales by exactly 1): a verify step's rows, walked together, get
// the bits each gets alone as a decode row.
#pragma once

#include "amx_tiles.h"

#ifdef RADIXRT_AMX
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "dtype_vec.h"

namespace radixrt::amx {

constexpr int64_t kTileRows = 16;     // query rows a tile holds
constexpr int64_t kBlockKeys = 16;    // keys of a block (one S^T tile)
constexpr int64_t kSpanBlocks = 8;    // blocks of a span: the decode kernel's kSpan
constexpr int64_t kSpanKeys = kSpanBlocks * kBlockKeys;

// One thread's scratch for a tile of rows over its spans (zeroed once: rows past a tile's count stay finite).
template <int kPairs>
struct SpanScratch {
  static constexpr int64_t kDim = 32 * kPairs;
  alignas(64) uint32_t qt[kPairs][16][16];               // Q^T: B tiles [pair of dims][row]
  alignas(64) c10::BFloat16 kpad[kBlockKeys * kDim];     // a block of fewer than 16 keys, zero-padded
  alignas(64) float st[kBlockKeys][kTileRows];           // one block's S^T
  alignas(64) float scores[kTileRows][kSpanKeys];
  alignas(64) uint16_t weights[kTileRows][kSpanKeys];    // P, bf16 bits
  alignas(64) uint32_t vt[kSpanBlocks / 2][2 * kPairs][16][16];  // V: B tiles [32 keys][16 dims][pair of keys]
  alignas(64) float acc[kTileRows][kDim];
};

// in: 16 rows of 16 fp32, ld_in apart; out row c (ld_out apart) = column c of in, for c < rows_out.
inline void transpose16(const float* in, int64_t ld_in, float* out, int64_t ld_out, int rows_out) {
  __m512 r[16], t[16], u[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(in + i * ld_in);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  auto pd = [](__m512 x) { return _mm512_castps_pd(x); };
  for (int i = 0; i < 4; ++i) {  // u[4i + c], 128-bit lane l: column 4l + c of rows 4i .. 4i + 3
    const __m512 *a = t + 4 * i;
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(a[0]), pd(a[2])));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(a[0]), pd(a[2])));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(a[1]), pd(a[3])));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(a[1]), pd(a[3])));
  }
  for (int c = 0; c < 4; ++c) {  // the 128-bit lanes of u[c], u[4 + c], u[8 + c], u[12 + c], transposed
    const __m512 v0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
    const __m512 v2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
    const __m512 v3 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
    const __m512 col[4] = {_mm512_shuffle_f32x4(v0, v2, 0x88), _mm512_shuffle_f32x4(v0, v2, 0xDD),
                           _mm512_shuffle_f32x4(v1, v3, 0x88), _mm512_shuffle_f32x4(v1, v3, 0xDD)};
    for (int l = 0; l < 4; ++l) {
      if (4 * l + c < rows_out) _mm512_storeu_ps(out + (4 * l + c) * ld_out, col[l]);
    }
  }
}

// Q^T of rows [0, rows) (the rest zero) into the scratch, for the spans that follow.
template <int kPairs>
inline void prepare_rows(const c10::BFloat16* const* q, int rows, SpanScratch<kPairs>& w) {
  std::memset(w.qt, 0, sizeof(w.qt));
  for (int i = 0; i < rows; ++i) {
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(q[i]);  // dims 2m, 2m + 1 as one 32-bit word
    for (int c = 0; c < kPairs; ++c) {
      for (int p = 0; p < 16; ++p) w.qt[c][p][i] = pairs[16 * c + p];
    }
  }
}

// Rows [0, rows) (prepared) over `count` (<= kSpanBlocks) blocks of keys: row i sees the keys before limit[i] (key
// indices from the blocks' `start`). Block: {k, v, n, start}; Row: {acc, m, l} (acc in the permuted order).
template <int kPairs, typename Block, typename Row>
void attend_span_tiles(const int64_t* limit, int rows, float scale, Row* state, const Block* blocks, int64_t count,
                       int64_t token_stride, SpanScratch<kPairs>& w) {
  constexpr int64_t kDim = 32 * kPairs;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < count; ++j) {
    const Block& b = blocks[j];
    const c10::BFloat16* k = b.k;
    int64_t stride = token_stride * 2;
    if (b.n < kBlockKeys) {  // a tile loads 16 rows: past the block's keys may lie past the cache
      for (int64_t t = 0; t < b.n; ++t) std::memcpy(w.kpad + t * kDim, b.k + t * token_stride, kDim * 2);
      std::memset(static_cast<void*>(w.kpad + b.n * kDim), 0, (kBlockKeys - b.n) * kDim * 2);
      k = w.kpad;
      stride = kDim * 2;
    }
    _tile_zero(0);
    for (int c = 0; c < kPairs; ++c) {
      _tile_loadd(1, k + 32 * c, stride);
      _tile_loadd(2, w.qt[c], 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, w.st, kTileRows * 4);
    transpose16(&w.st[0][0], kTileRows, &w.scores[0][j * kBlockKeys], kSpanKeys, rows);
  }
  const int64_t steps = (count + 1) / 2;  // of 32 keys
  float rescale[kTileRows];
  for (int i = 0; i < rows; ++i) {
    Row& row = state[i];
    int64_t valid[kSpanBlocks];
    Vec top(kNegInf);
    for (int64_t j = 0; j < count; ++j) {
      valid[j] = std::clamp<int64_t>(limit[i] - blocks[j].start, 0, blocks[j].n);
      const __mmask16 keep = static_cast<__mmask16>((1u << valid[j]) - 1);
      const Vec s(_mm512_mask_mul_ps(_mm512_set1_ps(kNegInf), keep, Vec::loadu(&w.scores[i][j * kBlockKeys]),
                                     _mm512_set1_ps(scale)));
      s.store(&w.scores[i][j * kBlockKeys]);
      top = at::vec::maximum(top, s);
    }
    const float m = std::max(row.m, hmax(top));
    rescale[i] = radixrt::softmax_rescale(row.m, m);
    Vec sum(0.f);
    for (int64_t j = 0; j < count; ++j) {
      const __mmask16 keep = static_cast<__mmask16>((1u << valid[j]) - 1);
      const Vec e = (Vec::loadu(&w.scores[i][j * kBlockKeys]) - Vec(m)).exp_u20();
      const Vec p = m == kNegInf ? Vec(0.f) : Vec(_mm512_maskz_mov_ps(keep, e));
      sum = sum + p;
      _mm256_store_si256(reinterpret_cast<__m256i*>(&w.weights[i][j * kBlockKeys]),
                         (__m256i)_mm512_cvtneps_pbh(p));  // as the vdpbf16ps path rounds its weights
    }
    for (int64_t j = count; j < 2 * steps; ++j) {
      std::memset(&w.weights[i][j * kBlockKeys], 0, kBlockKeys * sizeof(uint16_t));
    }
    row.l = row.l * rescale[i] + hsum(sum);
    row.m = m;
  }
  for (int64_t s = 0; s < steps; ++s) {
    for (int r = 0; r < 16; ++r) {  // keys 2r and 2r + 1 of the step's 32
      const int64_t j = 2 * s + r / 8, t = 2 * (r % 8);
      __m512i a[kPairs], b[kPairs];
      for (int c = 0; c < kPairs; ++c) a[c] = b[c] = _mm512_setzero_si512();
      if (j < count && t < blocks[j].n) {
        const c10::BFloat16* v0 = blocks[j].v + t * token_stride;
        for (int c = 0; c < kPairs; ++c) {
          a[c] = _mm512_loadu_si512(v0 + 32 * c);
          if (t + 1 < blocks[j].n) b[c] = _mm512_loadu_si512(v0 + token_stride + 32 * c);
        }
      }
      for (int c = 0; c < kPairs; ++c) {
        _mm512_store_si512(w.vt[s][2 * c][r], _mm512_unpacklo_epi16(a[c], b[c]));
        _mm512_store_si512(w.vt[s][2 * c + 1][r], _mm512_unpackhi_epi16(a[c], b[c]));
      }
    }
  }
  for (int i = 0; i < rows; ++i) {
    for (int64_t d = 0; d < kDim; d += kLanes) (Vec::loadu(state[i].acc + d) * Vec(rescale[i])).store(&w.acc[i][d]);
  }
  for (int g = 0; g < 2 * kPairs; ++g) {  // 16 dims of the accumulator: lo, hi of each 32
    float* acc = &w.acc[0][32 * (g / 2) + 16 * (g % 2)];
    _tile_loadd(0, acc, kDim * 4);
    for (int64_t s = 0; s < steps; ++s) {
      _tile_loadd(1, &w.weights[0][32 * s], kSpanKeys * 2);
      _tile_loadd(2, w.vt[s][g], 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, acc, kDim * 4);
  }
  for (int i = 0; i < rows; ++i) std::memcpy(state[i].acc, w.acc[i], kDim * sizeof(float));
}

}  // namespace radixrt::amx
#endif
