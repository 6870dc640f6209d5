// fp32 linear layers on AVX2/FMA CPUs: y = x W^T (+ b) with W packed once into panels of 16 output columns.
//
// Layout: panel p holds W's rows 16p..16p+15 transposed, [K][16] (the last panel zero-padded), so a panel is
// one contiguous stream. Each thread takes whole panels; for each panel it walks the rows of x in balanced
// tiles of up to 6 (8 where AVX-512 gives 32 vector registers), and a tile's outputs stay in registers over all
// of K (one FMA pair per row and k, the panel's two vectors loaded once per k for all the tile's rows). A row's
// arithmetic is the same in any tile, so its bits do not depend on the rows beside it. A panel is read from
// memory once per block of 128 rows of x and then from cache, so decode-sized products (1-64 rows) stream the
// weights once, overlapping the arithmetic; the block of x stays in L2 while the panels pass. On the AVX2-only
// CPUs this ran 15-40% faster than oneDNN's prepacked fp32 kernel at every row count from 1 to 2048; on Zen 4
// 1.5x at 1-2 rows and within 10% either way from 4 to 512 (docs/BENCHMARKS.md).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RADIXRT_PANELS 1
#endif

namespace {

constexpr int64_t kCols = 16;      // output columns a panel holds: two 8-wide vectors
constexpr int64_t kRowBlock = 128; // rows of x a block of work keeps in L2 while every panel passes
#ifdef __AVX512VL__
constexpr int64_t kMaxTile = 8;  // 16 accumulators: AVX-512's 32 vector registers hold them with room to spare
#else
constexpr int64_t kMaxTile = 6;  // 12 accumulators of AVX2's 16 registers
#endif

#ifdef RADIXRT_PANELS
// Rows R (1..kMaxTile) of x times one panel: out[r][0:ncols] = x[r] . panel (+ bias).
// The accumulators are written out one by one: as a loop over an array gcc spilled them, and it ran 2x slower.
template <int R>
inline void tile(const float* __restrict x, int64_t ldx, const float* __restrict panel, int64_t K,
                 const float* __restrict bias, float* __restrict out, int64_t ldo, int64_t ncols) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
         c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00, c60 = c00, c61 = c00, c70 = c00, c71 = c00;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(panel + k * kCols), b1 = _mm256_loadu_ps(panel + k * kCols + 8);
    __m256 a = _mm256_broadcast_ss(x + k);
    c00 = _mm256_fmadd_ps(a, b0, c00);
    c01 = _mm256_fmadd_ps(a, b1, c01);
    if constexpr (R > 1) {
      a = _mm256_broadcast_ss(x + ldx + k);
      c10 = _mm256_fmadd_ps(a, b0, c10);
      c11 = _mm256_fmadd_ps(a, b1, c11);
    }
    if constexpr (R > 2) {
      a = _mm256_broadcast_ss(x + 2 * ldx + k);
      c20 = _mm256_fmadd_ps(a, b0, c20);
      c21 = _mm256_fmadd_ps(a, b1, c21);
    }
    if constexpr (R > 3) {
      a = _mm256_broadcast_ss(x + 3 * ldx + k);
      c30 = _mm256_fmadd_ps(a, b0, c30);
      c31 = _mm256_fmadd_ps(a, b1, c31);
    }
    if constexpr (R > 4) {
      a = _mm256_broadcast_ss(x + 4 * ldx + k);
      c40 = _mm256_fmadd_ps(a, b0, c40);
      c41 = _mm256_fmadd_ps(a, b1, c41);
    }
    if constexpr (R > 5) {
      a = _mm256_broadcast_ss(x + 5 * ldx + k);
      c50 = _mm256_fmadd_ps(a, b0, c50);
      c51 = _mm256_fmadd_ps(a, b1, c51);
    }
    if constexpr (R > 6) {
      a = _mm256_broadcast_ss(x + 6 * ldx + k);
      c60 = _mm256_fmadd_ps(a, b0, c60);
      c61 = _mm256_fmadd_ps(a, b1, c61);
    }
    if constexpr (R > 7) {
      a = _mm256_broadcast_ss(x + 7 * ldx + k);
      c70 = _mm256_fmadd_ps(a, b0, c70);
      c71 = _mm256_fmadd_ps(a, b1, c71);
    }
  }
  alignas(32) float acc[8][kCols];
  _mm256_store_ps(acc[0], c00);
  _mm256_store_ps(acc[0] + 8, c01);
  if constexpr (R > 1) {
    _mm256_store_ps(acc[1], c10);
    _mm256_store_ps(acc[1] + 8, c11);
  }
  if constexpr (R > 2) {
    _mm256_store_ps(acc[2], c20);
    _mm256_store_ps(acc[2] + 8, c21);
  }
  if constexpr (R > 3) {
    _mm256_store_ps(acc[3], c30);
    _mm256_store_ps(acc[3] + 8, c31);
  }
  if constexpr (R > 4) {
    _mm256_store_ps(acc[4], c40);
    _mm256_store_ps(acc[4] + 8, c41);
  }
  if constexpr (R > 5) {
    _mm256_store_ps(acc[5], c50);
    _mm256_store_ps(acc[5] + 8, c51);
  }
  if constexpr (R > 6) {
    _mm256_store_ps(acc[6], c60);
    _mm256_store_ps(acc[6] + 8, c61);
  }
  if constexpr (R > 7) {
    _mm256_store_ps(acc[7], c70);
    _mm256_store_ps(acc[7] + 8, c71);
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < ncols; ++j) out[r * ldo + j] = acc[r][j] + (bias ? bias[j] : 0.f);
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t);
constexpr TileFn kTiles[9] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>, tile<7>, tile<8>};
#endif

}  // namespace

at::Tensor pack_linear_panels(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "pack_linear_panels: a 2-D float32 CPU weight [out, in]");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kCols - 1) / kCols;
  auto padded = at::zeros({P * kCols, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({P, kCols, K}).transpose(1, 2).contiguous();  // [P, K, 16]
}

at::Tensor linear_panels(at::Tensor x, at::Tensor panels, int64_t out_features, c10::optional<at::Tensor> bias) {
#ifndef RADIXRT_PANELS
  TORCH_CHECK(false, "linear_panels: this build has no AVX2/FMA");
#else
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), "linear_panels: float32 CPU input");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kCols && panels.is_contiguous(), "linear_panels: packed panels");
  const int64_t K = panels.size(1), P = panels.size(0), N = out_features;
  TORCH_CHECK(x.size(-1) == K, "linear_panels: input has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(N > (P - 1) * kCols && N <= P * kCols, "linear_panels: ", N, " outputs do not fit ", P, " panels");
  const float* b = nullptr;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->contiguous();
    TORCH_CHECK(bias_c.scalar_type() == at::kFloat && bias_c.numel() == N, "linear_panels: bias of ", N, " floats");
    b = bias_c.data_ptr<float>();
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto out = at::empty({M, N}, x.options());
  const float* X = x2.data_ptr<float>();
  const float* W = panels.data_ptr<float>();
  float* Y = out.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int64_t m1 = std::min(M, m0 + kRowBlock);
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t ncols = std::min(kCols, N - p * kCols);
        const float* panel = W + p * K * kCols;
        const float* pb = b ? b + p * kCols : nullptr;
        // the fewest tiles of at most kMaxTile rows, balanced (7 rows as 4 + 3, not 6 + 1, on AVX2): a tile
        // of one row keeps two FMA chains in flight, and took as long as a tile of four
        const int64_t block = m1 - m0, tiles = (block + kMaxTile - 1) / kMaxTile;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t m = m0 + t * block / tiles, rows = m0 + (t + 1) * block / tiles - m;
          kTiles[rows](X + m * K, K, panel, K, pb, Y + m * N + p * kCols, N, ncols);
        }
      }
    });
  }
  return out.view(sizes);
#endif
}

bool linear_panels_built() {
#ifdef RADIXRT_PANELS
  return true;
#else
  return false;
#endif
}
