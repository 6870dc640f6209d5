// The register tiles of the bf16 panel products (linear_bf16.cpp over bf16 panels, linear_fp8.cpp over fp8 panels
// dequantized to bf16 a group at a time): the panel layout, a tile of up to 8 rows of x by up to 3 panels, and the
// split of a block of rows into balanced tiles. Both products run these same loops, so a row gets the same bits
// from either over the same bf16 weights.
//
// Layout: panel p holds W's rows 16p..16p+15, [K/2][16][2]: for each pair of k, the 16 columns' two weights side
// by side (the last panel zero-padded), so a panel is one contiguous stream and one 64-byte load feeds a whole
// instruction. A tile keeps 24 accumulators in registers over all of K (the instruction's latency needs about
// that many in flight), each row's pair of x broadcast once per k-pair for the three panels, each panel's vector
// loaded once for the eight rows. Outputs are fp32 sums rounded once to bf16 (nearest even).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "bf16_pairs.h"

namespace radixrt::panel_tiles {

using radixrt::pairs::F16;
namespace pairs = radixrt::pairs;


constexpr int64_t kCols = 16;       // output columns of a panel
constexpr int kTileRows = 8;        // rows of x in a tile
constexpr int kTilePanels = 3;      // panels in a tile
// The stand-in (tests only) builds no prefetching variant: a prefetch never changes a result, and the variant
// doubled the stand-in's compile time (31 s of a narrower build's minute).
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
constexpr bool kPrefetchBuilt = true;
#else
constexpr bool kPrefetchBuilt = false;
#endif

// fp32 lanes rounded to bf16 (nearest even, NaN kept) into n <= 16 outputs
inline void store_bf16(c10::BFloat16* out, const float* lanes, int64_t n) {
  for (int64_t c = 0; c < n; ++c) out[c] = c10::BFloat16(lanes[c]);
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
inline void store_lanes(c10::BFloat16* out, F16 v, int64_t n) {
  const __m256i bits = (__m256i)_mm512_cvtneps_pbh(v);
  if (n == kCols) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bits);
  } else {
    _mm256_mask_storeu_epi16(out, static_cast<__mmask16>((1u << n) - 1), bits);
  }
}
#else
inline void store_lanes(c10::BFloat16* out, F16 v, int64_t n) {
  alignas(64) float lanes[kCols];
  pairs::store16(lanes, v);
  store_bf16(out, lanes, n);
}
#endif

// Cache lines of the next panel group that a tile asks for, into L2, while it computes: [next, next + 64 * lines),
// `per_step` of them each k-pair.
struct Prefetch {
  const char* next;
  int64_t lines, per_step;
};

// Rows R (1..8) of x times panels P (1..3): out[r][16 p + c] = x[r] . W[16 (p0 + p) + c] (+ bias) for the first
// `ncols` columns of the tile.
template <int R, int P, bool kPrefetch>
inline void tile(const c10::BFloat16* __restrict x, int64_t ldx, const uint32_t* __restrict panels, int64_t half_k,
                 const float* __restrict bias, c10::BFloat16* __restrict out, int64_t ldo, int64_t ncols,
                 Prefetch ahead) {
  F16 acc[R][P];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 3
    for (int p = 0; p < P; ++p) acc[r][p] = pairs::zeros();
  }
  const int64_t panel_stride = half_k * kCols;
  int64_t fetched = 0;
  for (int64_t kp = 0; kp < half_k; ++kp) {
    if constexpr (kPrefetch) {
      for (int64_t i = 0; i < ahead.per_step && fetched < ahead.lines; ++i, ++fetched) {
        __builtin_prefetch(ahead.next + 64 * fetched, 0, 2);
      }
    }
#if defined(CPU_CAPABILITY_AVX512)
    __m512i w[P];
#pragma GCC unroll 3
    for (int p = 0; p < P; ++p) w[p] = _mm512_loadu_si512(panels + p * panel_stride + kp * kCols);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint32_t xr = pairs::pair_at(x + r * ldx + 2 * kp);
#pragma GCC unroll 3
      for (int p = 0; p < P; ++p) acc[r][p] = pairs::dot2(acc[r][p], w[p], xr);
    }
#else
    for (int r = 0; r < R; ++r) {
      const uint32_t xr = pairs::pair_at(x + r * ldx + 2 * kp);
      for (int p = 0; p < P; ++p) acc[r][p] = pairs::dot2(acc[r][p], panels + p * panel_stride + kp * kCols, xr);
    }
#endif
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 3
    for (int p = 0; p < P; ++p) {
      const int64_t n = std::min<int64_t>(kCols, ncols - p * kCols);
      if (n <= 0) continue;
      F16 v = acc[r][p];
      if (bias != nullptr) {
        alignas(64) float padded[kCols] = {};
        std::memcpy(padded, bias + p * kCols, n * sizeof(float));
        v = pairs::add16(v, pairs::load16(padded));
      }
      store_lanes(out + r * ldo + p * kCols, v, n);
    }
  }
}

template <int P, bool kPrefetch>
inline void rows_tile(int64_t rows, const c10::BFloat16* x, int64_t ldx, const uint32_t* panels, int64_t half_k,
                      const float* bias, c10::BFloat16* out, int64_t ldo, int64_t ncols, Prefetch ahead) {
  switch (rows) {
    case 8: return tile<8, P, kPrefetch>(x, ldx, panels, half_k, bias, out, ldo, ncols, ahead);
    case 7: return tile<7, P, kPrefetch>(x, ldx, panels, half_k, bias, out, ldo, ncols, ahead);
    case 6: return tile<6, P, kPrefetch>(x, ldx, panels, half_k, bias, out, ldo, ncols, ahead);
    case 5: return tile<5, P, kPrefetch>(x, ldx, panels, half_k, bias, out, ldo, ncols, ahead);
    case 4: return tile<4, P, kPrefetch>(x, ldx, panels, half_k, bias, out, ldo, ncols, ahead);
    case 3: return tile<3, P, kPrefetch>(x, ldx, panels, half_k, bias, out, ldo, ncols, ahead);
    case 2: return tile<2, P, kPrefetch>(x, ldx, panels, half_k, bias, out, ldo, ncols, ahead);
    default: return tile<1, P, kPrefetch>(x, ldx, panels, half_k, bias, out, ldo, ncols, ahead);
  }
}

// Rows [r0, r0 + block) of x against one group of `np` (1..3) panels at `gp`, into the output's columns
// [col0, col0 + ncols) (`ldo` apart; `gb`: the group's fp32 bias or null). The rows split into the fewest tiles of
// at most 8, balanced: 9 rows run as 5 + 4, since a tile of one row keeps only 3 accumulators in flight and took
// as long as a tile of four (1.8 ms of the default model's 30 layers at 9 rows against 6.9 ms at 8). kPrefetch:
// the `next_lines` cache lines from `next` (the thread's next group) stream in meanwhile, shared among the tiles,
// so that the memory stream and the arithmetic overlap instead of taking turns.
template <bool kPrefetch>
inline void group_tiles(const c10::BFloat16* xp, int64_t ldx, const uint32_t* gp, int64_t np, int64_t half_k,
                        const float* gb, c10::BFloat16* op, int64_t ldo, int64_t col0, int64_t ncols, int64_t r0,
                        int64_t block, const char* next = nullptr, int64_t next_lines = 0) {
  const int64_t tiles = (block + kTileRows - 1) / kTileRows, share = (next_lines + tiles - 1) / tiles;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t r = r0 + t * block / tiles, tile_rows = r0 + (t + 1) * block / tiles - r;
    const c10::BFloat16* xr = xp + r * ldx;
    c10::BFloat16* orow = op + r * ldo + col0;
    const int64_t first = std::min(next_lines, t * share);
    const Prefetch ahead{next + 64 * first, std::min(next_lines, first + share) - first,
                         (share + half_k - 1) / half_k};
    if (np == 3) {
      rows_tile<3, kPrefetch>(tile_rows, xr, ldx, gp, half_k, gb, orow, ldo, ncols, ahead);
    } else if (np == 2) {
      rows_tile<2, kPrefetch>(tile_rows, xr, ldx, gp, half_k, gb, orow, ldo, ncols, ahead);
    } else {
      rows_tile<1, kPrefetch>(tile_rows, xr, ldx, gp, half_k, gb, orow, ldo, ncols, ahead);
    }
  }
}

}  // namespace radixrt::panel_tiles
