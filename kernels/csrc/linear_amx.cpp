// bf16 linear layers on AMX tiles, over the very panels linear_bf16 packs: one copy of each weight serves both.
//
// A panel ([K/2][16][2] bf16: for each pair of k, 16 output columns' two weights side by side) is already the
// layout an AMX B tile reads: 16 pairs of k by 16 columns is 1 KB of the panel, rows 64 bytes apart. An A tile is
// 16 rows of x by 32 k, read in place (rows K * 2 bytes apart). A step multiplies a block of 32 rows (two A tiles)
// by two panels (two B tiles) into four 16 x 16 fp32 accumulator tiles, over all of K, 32 k at a time; the sums
// are then rounded once to bf16 (nearest even) with the bias added in fp32, as linear_bf16 rounds them. Only the
// order of each sum differs from linear_bf16's (`tdpbf16ps` adds the even product of a pair first).
//
// Two other block shapes, where rows end in half a block (a speculative verify step's 33-48 rows, a decode step's
// 1-16), keep a pair's weights streaming from memory once instead of waiting on the tiles:
// - 48 or more rows that end in half a block finish with one block of 48 rows (three A tiles) by a pair, into six
//   accumulators, its A and B operands reloaded through one tile each. A 16-row block after a 32-row one re-read
//   the pair from L2 while nothing streamed: a 33rd row cost a sixth of a verify step's forward.
// - 16 rows or fewer take two pairs at once (four accumulators), where one pair alone left two sums waiting on
//   each other's latency.
// Every row's sums run in the same order whatever the block, so a row gets the same bits whatever shares its
// product.
//
// From kStreamRows rows on (prefill sizes), and for an output of more than kStreamBytes (an LM head's logits at a
// verify step's 40 rows: 7.9 MB of fp32), a whole pair's outputs go out in non-temporal stores, a line a row:
// written through the cache, each output line was first read from memory, and at 2,048 rows those reads took a
// fifth of the product's time (264 -> 200 ms for the default model's projections, oneDNN 186-189); an output past
// L2's size leaves the cache before it is read anyway (a verify step of 40-48 rows: 1-2% faster).
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
#include <type_traits>
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
constexpr int64_t kStreamBytes = int64_t{4} << 20;
constexpr int64_t kLineElems = 64 / sizeof(c10::BFloat16);  // bf16 elements of a cache line

#ifdef RADIXRT_AMX
using radixrt::amx::tiles_permitted;

// One row's 16 sums (+ bias) rounded to bf16 (nearest even): the bits, and those bits widened back to fp32.
inline __m256i rounded_bits(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
inline __m512 widened(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }

// sums [rows][32] fp32 (two panels side by side) + bias -> out rows (ldo apart), the first ncols columns, rounded
// to bf16 and written as bf16 (O = c10::BFloat16) or as those values in fp32 (O = float: logits, which the
// reference computes in bf16 and then widens).
template <typename O>
inline void store_rows(const float* sums, int64_t rows, const float* bias, O* out, int64_t ldo, int64_t ncols,
                       bool stream) {
  constexpr bool kWide = std::is_same_v<O, float>;
  if (stream) {  // a whole pair into aligned lines: non-temporal 64-byte stores, no read of the lines
    for (int64_t r = 0; r < rows; ++r) {
      __m512 lo = _mm512_loadu_ps(sums + r * 2 * kCols), hi = _mm512_loadu_ps(sums + r * 2 * kCols + kCols);
      if (bias != nullptr) {
        lo = _mm512_add_ps(lo, _mm512_loadu_ps(bias));
        hi = _mm512_add_ps(hi, _mm512_loadu_ps(bias + kCols));
      }
      if constexpr (kWide) {
        _mm512_stream_ps(out + r * ldo, widened(rounded_bits(lo)));
        _mm512_stream_ps(out + r * ldo + kCols, widened(rounded_bits(hi)));
      } else {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(out + r * ldo), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
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
      if constexpr (kWide) {
        _mm512_mask_storeu_ps(out + r * ldo + half * kCols, mask, widened(rounded_bits(v)));
      } else {
        _mm256_mask_storeu_epi16(out + r * ldo + half * kCols, mask, rounded_bits(v));
      }
    }
  }
}

// A block's output: its sums and where they go.
template <typename O>
struct Part {
  const float* sums = nullptr;
  int64_t rows = 0;
  const float* bias = nullptr;
  O* out = nullptr;
  int64_t ncols = 0;

  void store(int64_t ldo, bool stream) const {
    const bool aligned = ncols == 2 * kCols && reinterpret_cast<uintptr_t>(out) % 64 == 0 &&
                         (ldo * static_cast<int64_t>(sizeof(O))) % 64 == 0;
    store_rows(sums, rows, bias, out, ldo, ncols, stream && aligned);
  }
};

// The outputs of a block (one pair's, or two pairs' for a two-pair block) whose sums wait to be rounded and
// written, after the next block's tiles have been issued. Two sum buffers take turns.
template <typename O>
struct Pending {
  Part<O> parts[2];
  int count = 0;
  int buffer_index = 1;

  void flush(int64_t ldo, bool stream) {
    for (int i = 0; i < count; ++i) parts[i].store(ldo, stream);
    count = 0;
  }
  // Writes what waits; the next block's sums go to the other buffer, whose index this returns.
  int swap(int64_t ldo, bool stream) {
    flush(ldo, stream);
    return buffer_index ^= 1;
  }
  void add(const Part<O>& part) { parts[count++] = part; }
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

// 48 rows (A tiles at a0, a1, a2) times panels [0, b_tiles) of wb into accumulators 0-2 (the first panel; a tile
// of rows each) and 3-5 (the second). One tile holds the A operand and one the B operand, reloaded in a snake
// order (A0B0 A0B1 A1B1 A1B0 A2B0 A2B1) so that each load replaces one operand only.
inline void triple_product(const c10::BFloat16* a0, const c10::BFloat16* a1, const c10::BFloat16* a2, int64_t lda,
                           const c10::BFloat16* wb, int64_t panel_elems, int64_t k, int b_tiles) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  const int64_t a_stride = lda * 2;
  for (int64_t k0 = 0; k0 < k; k0 += kTileK) {
    const c10::BFloat16* w0 = wb + k0 * kCols;
    _tile_loadd(6, a0 + k0, a_stride);
    _tile_loadd(7, w0, 64);
    _tile_dpbf16ps(0, 6, 7);
    if (b_tiles == 2) {
      _tile_loadd(7, w0 + panel_elems, 64);
      _tile_dpbf16ps(3, 6, 7);
      _tile_loadd(6, a1 + k0, a_stride);
      _tile_dpbf16ps(4, 6, 7);
      _tile_loadd(7, w0, 64);
      _tile_dpbf16ps(1, 6, 7);
      _tile_loadd(6, a2 + k0, a_stride);
      _tile_dpbf16ps(2, 6, 7);
      _tile_loadd(7, w0 + panel_elems, 64);
      _tile_dpbf16ps(5, 6, 7);
    } else {
      _tile_loadd(6, a1 + k0, a_stride);
      _tile_dpbf16ps(1, 6, 7);
      _tile_loadd(6, a2 + k0, a_stride);
      _tile_dpbf16ps(2, 6, 7);
    }
  }
}

// 16 rows at a times the panels of two pairs (wb0: b0 panels; wb1: b1 panels, 0 for none) into accumulators 0-1
// (the first pair) and 2-3 (the second).
inline void twin_product(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* wb0, int b0,
                         const c10::BFloat16* wb1, int b1, int64_t panel_elems, int64_t k) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t a_stride = lda * 2;
  for (int64_t k0 = 0; k0 < k; k0 += kTileK) {
    _tile_loadd(4, a + k0, a_stride);
    _tile_loadd(6, wb0 + k0 * kCols, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (b0 == 2) {
      _tile_loadd(7, wb0 + panel_elems + k0 * kCols, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (b1 >= 1) {
      _tile_loadd(5, wb1 + k0 * kCols, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if (b1 == 2) {
      _tile_loadd(6, wb1 + panel_elems + k0 * kCols, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
}

// Sums buffers hold [48][32] fp32: rows of a block, each with its pair's two panels side by side.
constexpr int64_t kSumRow = 2 * kCols;
constexpr int64_t kSumBytes = kSumRow * sizeof(float);

// block_product's accumulators into sums rows 0-31.
inline void store_tiles(float* sums) {
  _tile_stored(0, sums, kSumBytes);
  _tile_stored(1, sums + kCols, kSumBytes);
  _tile_stored(2, sums + 16 * kSumRow, kSumBytes);
  _tile_stored(3, sums + 16 * kSumRow + kCols, kSumBytes);
}

// triple_product's accumulators into sums rows 0-47.
inline void store_triple(float* sums) {
  _tile_stored(0, sums, kSumBytes);
  _tile_stored(3, sums + kCols, kSumBytes);
  _tile_stored(1, sums + 16 * kSumRow, kSumBytes);
  _tile_stored(4, sums + 16 * kSumRow + kCols, kSumBytes);
  _tile_stored(2, sums + 32 * kSumRow, kSumBytes);
  _tile_stored(5, sums + 32 * kSumRow + kCols, kSumBytes);
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

// x [rows, K] bf16 times panels from pack_linear_bf16 (K a multiple of 32) on AMX tiles: [rows, out_features] bf16,
// or with fp32_out the same bf16 values widened to fp32 (an LM head's logits, without a second pass to widen them).
at::Tensor linear_amx(at::Tensor x, at::Tensor panels, int64_t out_features, c10::optional<at::Tensor> bias,
                      bool fp32_out) {
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
  // The copy starts on a cache line, as a tensor's rows do: a tile row that straddles two lines is two loads (a
  // copy 16 bytes off a line made a forward's products 1% slower at 8 and 40 rows).
  thread_local std::vector<c10::BFloat16> tail;
  c10::BFloat16* tp = nullptr;
  if (whole < rows) {
    tail.resize(16 * k + kLineElems);
    const auto offset = static_cast<int64_t>(reinterpret_cast<uintptr_t>(tail.data()) % 64 / sizeof(c10::BFloat16));
    tp = tail.data() + (kLineElems - offset) % kLineElems;
    const int64_t copied = (rows - whole) * k;
    std::memcpy(tp, xp + whole * k, copied * sizeof(c10::BFloat16));
    std::memset(static_cast<void*>(tp + copied), 0, (16 * k - copied) * sizeof(c10::BFloat16));
  }
  auto out = at::empty({rows, out_features}, x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
  auto tile_rows = [&](int64_t r) { return r < whole ? xp + r * k : tp; };  // the 16 rows from row r (r % 16 == 0)
  const auto* wp = panels.data_ptr<c10::BFloat16>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const int64_t panel_elems = half_k * kCols * 2, pairs = (num_panels + 1) / 2;
  // Pair p's panels, output columns and bias.
  auto pair_panels = [&](int64_t p) { return wp + 2 * p * panel_elems; };
  auto pair_tiles = [&](int64_t p) { return static_cast<int>(std::min<int64_t>(2, num_panels - 2 * p)); };
  auto product_into = [&](auto* op) {
    using O = std::remove_pointer_t<decltype(op)>;
    const bool stream = rows >= kStreamRows || rows * out_features * static_cast<int64_t>(sizeof(O)) > kStreamBytes;
    auto pair_part = [&](int64_t p, const float* sums, int64_t r0, int64_t block_rows) {
      const int64_t col0 = 2 * p * kCols;
      return Part<O>{sums, std::min(block_rows, rows - r0), bp != nullptr ? bp + col0 : nullptr,
                     op + r0 * out_features + col0, std::min<int64_t>(pair_tiles(p) * kCols, out_features - col0)};
    };
    for (int64_t chunk = 0; chunk < padded_rows; chunk += kChunkRows) {
      const int64_t chunk_end = std::min(padded_rows, chunk + kChunkRows), chunk_rows = chunk_end - chunk;
      const bool twins = chunk_rows == 16;
      // where the chunk's last 48 rows go as one block (rows that end in half a block), else past its end
      const int64_t triple_r0 = chunk_rows >= 48 && chunk_rows % kBlockRows == 16 ? chunk_end - 48 : chunk_end;
      at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
        const radixrt::amx::TileScope tiles;
        alignas(64) float sums[2][48 * kSumRow];
        Pending<O> pending;
        if (twins) {
          for (int64_t pair = begin; pair < end; pair += 2) {
            const bool two = pair + 1 < end;
            twin_product(tile_rows(chunk), k, pair_panels(pair), pair_tiles(pair),
                         two ? pair_panels(pair + 1) : nullptr, two ? pair_tiles(pair + 1) : 0, panel_elems, k);
            float* buffer = sums[pending.swap(out_features, stream)];
            store_tiles(buffer);
            pending.add(pair_part(pair, buffer, chunk, 16));
            if (two) pending.add(pair_part(pair + 1, buffer + 16 * kSumRow, chunk, 16));
          }
        } else {
          for (int64_t pair = begin; pair < end; ++pair) {
            const c10::BFloat16* wb = pair_panels(pair);
            const int b_tiles = pair_tiles(pair);
            for (int64_t r0 = chunk; r0 < chunk_end; r0 += kBlockRows) {
              float* buffer;
              if (r0 == triple_r0) {
                triple_product(tile_rows(r0), tile_rows(r0 + 16), tile_rows(r0 + 32), k, wb, panel_elems, k, b_tiles);
                buffer = sums[pending.swap(out_features, stream)];
                store_triple(buffer);
                pending.add(pair_part(pair, buffer, r0, 48));
                break;
              }
              block_product(tile_rows(r0), tile_rows(r0 + 16), k, wb, panel_elems, k,
                            chunk_end - r0 >= kBlockRows ? 2 : 1, b_tiles);
              buffer = sums[pending.swap(out_features, stream)];
              store_tiles(buffer);
              pending.add(pair_part(pair, buffer, r0, kBlockRows));
            }
          }
        }
        pending.flush(out_features, stream);
        _mm_sfence();  // the streamed lines are visible before another thread reads the output
      });
    }
  };
  if (fp32_out) {
    product_into(out.data_ptr<float>());
  } else {
    product_into(out.data_ptr<c10::BFloat16>());
  }
  return out.view(product.out_shape);
#else
  TORCH_CHECK(false, "this build has no AMX path (it needs a CPU with AMX-BF16)");
#endif
}
