// bf16 linear layers on AVX512-BF16 CPUs: y = x W^T (+ b) with W packed once into panels of 16 output columns
// held as bf16 pairs, multiplied by `vdpbf16ps` (32 products into 16 fp32 lanes per instruction).
//
// The layout and the register tiles are bf16_panel_tiles.h's (shared with linear_fp8.cpp). Threads take groups of
// three panels; a block of up to kRowBlock rows of x stays in L2 while the panels pass, so a decode-sized product
// (1-64 rows) reads every weight from memory once; at 2-32 rows a thread prefetches its next group meanwhile.
// Outputs are fp32 sums rounded once to bf16 (nearest even), as a bf16 GEMM that accumulates in fp32 does; only
// the order of the sum differs from oneDNN's.
//
// Without AVX512-BF16 the same loops run on bf16_pairs.h's stand-in for the instruction (the tests' path on
// other CPUs); the runtime takes this kernel only where the instruction exists (linear_bf16_built()).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "bf16_panel_tiles.h"
#include "panel_product.h"

namespace {

using namespace radixrt::panel_tiles;

constexpr int64_t kRowBlock = 256;  // rows of x a block of work keeps in L2 while the panels pass
// From 2 to 32 rows the next panels are prefetched: one row streams at the memory's pace without help, and past
// 32 rows the product is bound by arithmetic (old and new builds alternating: 2-16 rows 5-15% faster, 1 and
// 48-64 level).
constexpr int64_t kPrefetchMinRows = 2, kPrefetchMaxRows = 32;

// Panel group g (kTilePanels panels from panel g * kTilePanels) against rows [r0, r0 + block) of x. With
// `has_next`, the next group's lines stream in meanwhile (kPrefetch).
template <bool kPrefetch>
void panel_group(const c10::BFloat16* xp, int64_t ldx, const uint32_t* wp, int64_t half_k, int64_t num_panels,
                 int64_t g, bool has_next, const float* bp, c10::BFloat16* op, int64_t out_features, int64_t r0,
                 int64_t block) {
  const int64_t p0 = g * kTilePanels, np = std::min<int64_t>(kTilePanels, num_panels - p0);
  const int64_t col0 = p0 * kCols, ncols = std::min(np * kCols, out_features - col0);
  const uint32_t* gp = wp + p0 * half_k * kCols;
  const float* gb = bp != nullptr ? bp + col0 : nullptr;
  const int64_t after = std::max<int64_t>(0, std::min<int64_t>(kTilePanels, num_panels - p0 - kTilePanels));
  const int64_t next_lines = (has_next ? after : 0) * half_k * kCols * 4 / 64;
  const char* next = reinterpret_cast<const char*>(gp + kTilePanels * half_k * kCols);
  group_tiles<kPrefetch>(xp, ldx, gp, np, half_k, gb, op, out_features, col0, ncols, r0, block, next, next_lines);
}

template <bool kPrefetch>
void panel_groups(const c10::BFloat16* xp, int64_t ldx, const uint32_t* wp, int64_t half_k, int64_t num_panels,
                  int64_t groups, const float* bp, c10::BFloat16* op, int64_t out_features, int64_t r0,
                  int64_t block) {
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      panel_group<kPrefetch>(xp, ldx, wp, half_k, num_panels, g, g + 1 < end, bp, op, out_features, r0, block);
    }
  });
}

// Whether a block of `rows` rows takes the prefetching variant (built with the instruction only).
inline bool prefetches(int64_t rows) {
  return kPrefetchBuilt && rows >= kPrefetchMinRows && rows <= kPrefetchMaxRows;
}

// panel_group, prefetching where `prefetch` asks and the variant is built.
inline void run_panel_group(bool prefetch, const c10::BFloat16* xp, int64_t ldx, const uint32_t* wp, int64_t half_k,
                            int64_t num_panels, int64_t g, bool has_next, c10::BFloat16* op, int64_t out_features,
                            int64_t r0, int64_t block) {
  if constexpr (kPrefetchBuilt) {
    if (prefetch) {
      panel_group<true>(xp, ldx, wp, half_k, num_panels, g, has_next, nullptr, op, out_features, r0, block);
      return;
    }
  }
  panel_group<false>(xp, ldx, wp, half_k, num_panels, g, has_next, nullptr, op, out_features, r0, block);
}

}  // namespace

// Whether this build multiplies with vdpbf16ps (else the kernel runs on the stand-in, for tests only).
bool linear_bf16_built() {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// weight [N, K] bf16 (K even) -> panels [ceil(N / 16), K / 2, 16, 2] bf16, zero-padded past N.
at::Tensor pack_linear_bf16(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "weight must be a 2-D bf16 tensor");
  TORCH_CHECK(weight.size(1) % 2 == 0, "the bf16 panels need an even number of input features");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kCols - 1) / kCols;
  auto padded = at::zeros({panels * kCols, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  // [P, 16, K/2, 2] -> [P, K/2, 16, 2]
  return padded.view({panels, kCols, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x [..., K] bf16 (rows contiguous) times the packed weight: [..., out_features] bf16; bias fp32/bf16 [out].
at::Tensor linear_bf16(at::Tensor x, at::Tensor panels, int64_t out_features, c10::optional<at::Tensor> bias) {
  const radixrt::PanelProduct product = radixrt::check_panel_product(x, panels, out_features, bias, kCols);
  const int64_t k = product.k, half_k = k / 2, num_panels = product.num_panels;
  const at::Tensor& b = product.bias;
  auto x2 = x.reshape({-1, k});
  if (x2.stride(1) != 1 || x2.stride(0) < k) x2 = x2.contiguous();
  const int64_t rows = x2.size(0), ldx = x2.stride(0);
  auto out = at::empty({rows, out_features}, x.options());
  const auto* xp = x2.data_ptr<c10::BFloat16>();
  const auto* wp = reinterpret_cast<const uint32_t*>(panels.data_ptr<c10::BFloat16>());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t groups = (num_panels + kTilePanels - 1) / kTilePanels;
  for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
    const int64_t block = std::min(kRowBlock, rows - r0);
    if constexpr (kPrefetchBuilt) {
      if (prefetches(block)) {
        panel_groups<true>(xp, ldx, wp, half_k, num_panels, groups, bp, op, out_features, r0, block);
        continue;
      }
    }
    panel_groups<false>(xp, ldx, wp, half_k, num_panels, groups, bp, op, out_features, r0, block);
  }
  return out.view(product.out_shape);
}

// Several products of one shape in one parallel region: rows [bounds[e], bounds[e + 1]) of x times weight e (each
// packed by pack_linear_bf16), into the same rows of the output. A mixture-of-experts layer runs every expert's rows
// through its own weight in one call; each row gets the bits linear_bf16 gives it (the same tiles, rows in the
// same balanced split).
at::Tensor linear_bf16_grouped(at::Tensor x, std::vector<at::Tensor> panels, std::vector<int64_t> bounds,
                               int64_t out_features) {
  TORCH_CHECK(!panels.empty() && bounds.size() == panels.size() + 1, "bounds must hold one more entry than panels");
  TORCH_CHECK(x.dim() == 2 && bounds.front() == 0 && bounds.back() == x.size(0), "bounds must cover x's rows");
  std::vector<const uint32_t*> weights;
  int64_t half_k = 0, num_panels = 0;
  for (size_t e = 0; e < panels.size(); ++e) {
    const radixrt::PanelProduct product = radixrt::check_panel_product(x, panels[e], out_features, c10::nullopt, kCols);
    TORCH_CHECK(e == 0 || product.num_panels == num_panels, "every weight must have the same shape");
    TORCH_CHECK(bounds[e] <= bounds[e + 1], "bounds must not decrease");
    half_k = product.k / 2;
    num_panels = product.num_panels;
    weights.push_back(reinterpret_cast<const uint32_t*>(panels[e].data_ptr<c10::BFloat16>()));
  }
  auto x2 = x.stride(1) == 1 && x.stride(0) >= x.size(1) ? x : x.contiguous();
  auto out = at::empty({x2.size(0), out_features}, x.options());
  const auto* xp = x2.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t ldx = x2.stride(0), groups = (num_panels + kTilePanels - 1) / kTilePanels;
  struct Block { int64_t weight, r0, rows; };
  std::vector<Block> blocks;
  for (size_t e = 0; e < weights.size(); ++e) {
    for (int64_t r0 = bounds[e]; r0 < bounds[e + 1]; r0 += kRowBlock) {
      blocks.push_back({static_cast<int64_t>(e), r0, std::min(kRowBlock, bounds[e + 1] - r0)});
    }
  }
  const int64_t items = static_cast<int64_t>(blocks.size()) * groups;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Block& b = blocks[i / groups];
      const int64_t g = i % groups;
      const bool has_next = i + 1 < end && g + 1 < groups;
      run_panel_group(prefetches(b.rows), xp, ldx, weights[b.weight], half_k, num_panels, g, has_next, op,
                      out_features, b.r0, b.rows);
    }
  });
  return out;
}
