// bf16 linear layers on AMX tiles, over the very panels linear_bf16 packs: one copy of each weight serves both.
//
// A panel ([K/2][16][2] bf16: for each pair of k, 16 output columns' two weights side by side) is already the
// layout an AMX B tile reads: 16 pairs of k by 16 columns is 1 KB of the panel, rows 64 bytes apart. An A tile is
// 16 rows of x by 32 k, read in place (rows K * 2 bytes apart). A step multiplies a block of 32 rows (two A tiles)
// by two panels (two B tiles) into four 16 x 16 fp32 accumulator tiles, over all of K, 32 k at a time; the sums
// are then rounded once to bf16 (nearest even) with the bias added in fp32, as linear_bf16 rounds them. Only the
// order of each sum differs from linear_bf16's (`tdpbf16ps` adds the even product of a pair first).
//
// From kStreamRows rows on (prefill sizes) a whole pair's outputs go out in non-temporal stores, a line a row:
// written through the cache, each output line was first read from memory, and at 2,048 rows those reads took a
// fifth of the product's time (264 -> 200 ms for the default model's projections, oneDNN 186-189).
// Rows go in chunks of kChunkRows; in each, threads take pairs of panels and walk the chunk's row blocks against
// them, so a pair's weights stay in L1/L2 while the chunk's rows, in L2, pass. Rows past a multiple of 16 are
// read from a zero-padded copy of one tile (a tile loads 16 rows); the others in place.
// Needs K a multiple of 32, a build for a CPU with AMX-BF16 (-march=native there) and the kernel's permission to
// use the tile registers (arch_prctl, asked once); linear_amx_usable() says whether all hold.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "panel_product.h"

namespace {

constexpr int64_t kCols = 16;      // output columns of a panel
constexpr int64_t kTileK = 32;     // k of an A tile's row (64 bytes of bf16)
constexpr int64_t kBlockRows = 32; // rows of x in a step (two A tiles)
// Rows of x the threads take through every panel pair before the next rows: they stay in L2 meanwhile, where
// walking all rows against each pair re-read x from memory once a pair (2,048 rows: 1.6x oneDNN's time).
constexpr int64_t kChunkRows = 256;
constexpr int64_t kStreamRows = 256;

#ifdef RADIXRT_AMX
using radixrt::amx::tiles_permitted;

// sums [rows][32] fp32 (two panels side by side) + bias -> out rows (ldo apart), the first ncols columns, bf16.
inline void store_rows(const float* sums, int64_t rows, const float* bias, c10::BFloat16* out, int64_t ldo,
                       int64_t ncols, bool stream) {
  if (stream) {  // a whole pair into aligned lines: one non-temporal 64-byte store a row, no read of the line
    for (int64_t r = 0; r < rows; ++r) {
      __m512 lo = _mm512_loadu_ps(sums + r * 2 * kCols), hi = _mm512_loadu_ps(sums + r * 2 * kCols + kCols);
      if (bias != nullptr) {
        lo = _mm512_add_ps(lo, _mm512_loadu_ps(bias));
        hi = _mm512_add_ps(hi, _mm512_loadu_ps(bias + kCols));
      }
      _mm512_stream_si512(reinterpret_cast<__m512i*>(out + r * ldo), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t n = std::min<int64_t>(kCols, ncols - half * kCols);
      if (n <= 0) break;
      const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
      __m512 v = _mm512_loadu_ps(sums + r * 2 * kCols + half * kCols);
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + half * kCols));
      const __m256i bits = (__m256i)_mm512_cvtneps_pbh(v);
      _mm256_mask_storeu_epi16(out + r * ldo + half * kCols, mask, bits);
    }
  }
}

// A block whose sums wait to be rounded and written (after the next block's tiles have been issued).
struct Pending {
  const float* sums = nullptr;
  int64_t rows = 0;
  const float* bias = nullptr;
  c10::BFloat16* out = nullptr;
  int64_t ncols = 0;
  int buffer_index = 1;

  int next_buffer() const { return buffer_index ^ 1; }
  void flush(int64_t ldo, bool stream) {
    if (sums != nullptr) {
      const bool aligned = ncols == 2 * kCols && reinterpret_cast<uintptr_t>(out) % 64 == 0 && (ldo * 2) % 64 == 0;
      store_rows(sums, rows, bias, out, ldo, ncols, stream && aligned);
    }
    sums = nullptr;
  }
};

// One step: the 16 rows at a0 (and, with a_tiles 2, the 16 at a1), lda elements apart, times panels [0, b_tiles)
// of wb, over all k, into the accumulator tiles (store_tiles writes them out).
inline void block_product(const c10::BFloat16* a0, const c10::BFloat16* a1, int64_t lda, const c10::BFloat16* wb,
                          int64_t panel_elems, int64_t k, int a_tiles, int b_tiles) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t a_stride = lda * 2;
  for (int64_t k0 = 0; k0 < k; k0 += kTileK) {
    const c10::BFloat16* w0 = wb + k0 * kCols;  // 16 pairs of k = 32 k, 16 columns: k0 / 2 pairs * 32 elements
    _tile_loadd(4, a0 + k0, a_stride);
    _tile_loadd(6, w0, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (b_tiles == 2) {
      _tile_loadd(7, w0 + panel_elems, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (a_tiles == 2) {
      _tile_loadd(5, a1 + k0, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      if (b_tiles == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// The accumulator tiles into sums [32][32] fp32.
inline void store_tiles(float* sums) {
  constexpr int64_t ld = 2 * kCols * sizeof(float);
  _tile_stored(0, sums, ld);
  _tile_stored(1, sums + kCols, ld);
  _tile_stored(2, sums + 16 * 2 * kCols, ld);
  _tile_stored(3, sums + 16 * 2 * kCols + kCols, ld);
}
#endif

}  // namespace

bool linear_amx_usable() {
#ifdef RADIXRT_AMX
  return tiles_permitted();
#else
  return false;
#endif
}

// x [rows, K] bf16 times panels from pack_linear_bf16 (K a multiple of 32) on AMX tiles: [rows, out_features] bf16.
at::Tensor linear_amx(at::Tensor x, at::Tensor panels, int64_t out_features, c10::optional<at::Tensor> bias) {
#ifdef RADIXRT_AMX
  TORCH_CHECK(linear_amx_usable(), "AMX tiles are not usable in this process");
  const radixrt::PanelProduct product = radixrt::check_panel_product(x, panels, out_features, bias, kCols);
  const int64_t k = product.k, half_k = k / 2, num_panels = product.num_panels;
  TORCH_CHECK(k % kTileK == 0, "the AMX path needs K a multiple of 32; got ", k);
  const at::Tensor& b = product.bias;
  auto x2 = x.reshape({-1, k});
  if (x2.stride(1) != 1 || x2.stride(0) != k) x2 = x2.contiguous();
  const int64_t rows = x2.size(0);
  const int64_t padded_rows = (rows + 15) / 16 * 16, whole = rows / 16 * 16;
  // Rows past the last whole tile are read from a zero-padded copy of one tile in a buffer the thread keeps; the
  // rest in place. (A padded copy of all of x in a fresh tensor cost a tenth of a decode step's products at 8 rows.)
  const auto* xp = x2.data_ptr<c10::BFloat16>();
  thread_local std::vector<c10::BFloat16> tail;
  const c10::BFloat16* tp = nullptr;
  if (whole < rows) {
    tail.resize(16 * k);
    const int64_t copied = (rows - whole) * k;
    std::memcpy(tail.data(), xp + whole * k, copied * sizeof(c10::BFloat16));
    std::memset(static_cast<void*>(tail.data() + copied), 0, (16 * k - copied) * sizeof(c10::BFloat16));
    tp = tail.data();
  }
  auto out = at::empty({rows, out_features}, x.options());
  auto tile_rows = [&](int64_t r) { return r < whole ? xp + r * k : tp; };  // the 16 rows from row r (r % 16 == 0)
  const auto* wp = panels.data_ptr<c10::BFloat16>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t panel_elems = half_k * kCols * 2, pairs = (num_panels + 1) / 2;
  const bool stream = rows >= kStreamRows;
  for (int64_t chunk = 0; chunk < padded_rows; chunk += kChunkRows) {
    const int64_t chunk_end = std::min(padded_rows, chunk + kChunkRows);
    at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
      const radixrt::amx::TileScope tiles;
      // Two buffers: a block's sums are rounded and written while the tiles compute the next block.
      alignas(64) float sums[2][kBlockRows * 2 * kCols];
      Pending pending;
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t p0 = 2 * pair, b_tiles = std::min<int64_t>(2, num_panels - p0);
        const int64_t col0 = p0 * kCols, ncols = std::min(b_tiles * kCols, out_features - col0);
        const c10::BFloat16* wb = wp + p0 * panel_elems;
        for (int64_t r0 = chunk; r0 < chunk_end; r0 += kBlockRows) {
          const int a_tiles = chunk_end - r0 >= kBlockRows ? 2 : 1;
          block_product(tile_rows(r0), tile_rows(r0 + 16), k, wb, panel_elems, k, a_tiles,
                        static_cast<int>(b_tiles));
          pending.flush(out_features, stream);
          float* buffer = sums[pending.next_buffer()];
          store_tiles(buffer);
          pending = Pending{buffer, std::min<int64_t>(kBlockRows, rows - r0), bp != nullptr ? bp + col0 : nullptr,
                            op + r0 * out_features + col0, ncols, pending.buffer_index ^ 1};
        }
      }
      pending.flush(out_features, stream);
      _mm_sfence();  // the streamed lines are visible before another thread reads the output
    });
  }
  return out.view(product.out_shape);
#else
  TORCH_CHECK(false, "this build has no AMX path (it needs a CPU with AMX-BF16)");
#endif
}
