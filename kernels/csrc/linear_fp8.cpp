// FP8 (e4m3) weights on AVX512-BF16 CPUs: y = x W^T (+ b) with W kept as fp8 bits in linear_bf16's panel layout
// ([P][K/2][16][2], one byte a weight) and one fp32 scale per output column and block of `block_k` inputs
// ([P][blocks][16]), as block-wise quantized checkpoints store them.
//
// A thread dequantizes each panel group it takes into a bf16 buffer (the fp8 value times its scale in fp32,
// rounded once to bf16, nearest even: what transformers computes when it dequantizes these checkpoints) and runs
// linear_bf16's register tiles over the buffer (bf16_panel_tiles.h). A product therefore gives, bit for bit,
// linear_bf16's product over the dequantized weight, while reading half its bytes from memory. The dequantization
// costs about 10 vector instructions per 32 weights (5 through the table below), once per block of up to kRowBlock
// rows: on a 2-vCPU Zen 4 about what the halved stream saves, so a decode step takes about as long as in bf16
// (docs/BENCHMARKS.md); the weights take half the memory.
//
// An fp8 code becomes its fp32 value times 2^-120 in three instructions (sign-extend, shift, mask), the 2^120
// folded into the block's scale; both products are exact, so the rounding is transformers' own. A block whose
// scale is 2^8 or more (its folded scale would overflow), or a thread whose MXCSR treats subnormals as zero, looks
// the exact values up in a table instead. NaN codes are refused when the weights are packed. Without AVX-512 a
// scalar loop computes the same values (the tests' path on other CPUs). A block whose 16 columns share one scale
// (128-row blocks, one scale a tensor) is looked up instead, where the CPU has AVX512-VBMI: the 128 products of
// its magnitudes, computed and rounded as above, as byte tables that two vpermi2b read 64 weights at a time. While
// a group's tiles compute, the next group's fp8 bytes are prefetched (as linear_bf16 prefetches its panels).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <vector>

#include "bf16_panel_tiles.h"
#include "panel_product.h"

namespace {

using namespace radixrt::panel_tiles;

constexpr int64_t kRowBlock = 256;  // rows of x a block of work keeps in L2 while the panels pass (linear_bf16's)
constexpr int64_t kPrefetchBytes = 512;  // how far ahead of the dequantization its fp8 stream is fetched

#if defined(CPU_CAPABILITY_AVX512)
// 32 dequantized weights (fp32, as 16 columns' pairs of k: columns 0-7 in `lo`, 8-15 in `hi`) rounded to bf16
inline void store32(__m512 lo, __m512 hi, uint32_t* dst) {
#if defined(__AVX512BF16__)
  _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
#else
  alignas(64) float lanes[32];
  _mm512_store_ps(lanes, lo);
  _mm512_store_ps(lanes + 16, hi);
  auto* out = reinterpret_cast<c10::BFloat16*>(dst);
  for (int i = 0; i < 32; ++i) out[i] = c10::BFloat16(lanes[i]);
#endif
}

// 16 codes as fp32 values times 2^-120: the code's sign, exponent and mantissa moved to fp32's places (an e4m3
// exponent e reads as fp32's e, bias 127 for 7; a subnormal code becomes an fp32 subnormal of the same ratio). The
// caller's scale carries the 2^120 (exact while the scale is below 2^8). NaN codes (0x7f, 0xff) would read as 480:
// the weights were checked for them when packed.
inline __m512 shifted16(const uint8_t* src) {
  const __m512i code = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(code, 20), _mm512_set1_epi32(0x87f00000u)));
}

// The exact fp32 value of 16 codes, looked up (bf16 bits of the magnitudes 0-127, widened).
struct Magnitudes {
  alignas(64) float values[256];
  Magnitudes() {
    for (int c = 0; c < 256; ++c) values[c] = c10::detail::fp8e4m3fn_to_fp32_value(static_cast<uint8_t>(c));
  }
  __m512 exact16(const uint8_t* src) const {
    return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))), values,
                               4);
  }
};
#endif

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
// A block whose 16 columns share one scale s: the bf16 of every magnitude's value times s (the same products,
// rounded the same way, as the multiplying path), as the low and the high bytes of the 128 results, so that two
// vpermi2b look 64 codes up at once.
struct ScaledTable {
  __m512i low[2], high[2];  // bytes of the results for codes 0-63 and 64-127
  ScaledTable(const Magnitudes& m, float scale) {
    const __m512 s = _mm512_set1_ps(scale);
    for (int h = 0; h < 2; ++h) {
      __m256i low_half[2], high_half[2];
      for (int q = 0; q < 2; ++q) {
        const float* v = m.values + 64 * h + 32 * q;
        const __m512i words = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_load_ps(v + 16), s),
                                                           _mm512_mul_ps(_mm512_load_ps(v), s));
        low_half[q] = _mm512_cvtepi16_epi8(words);
        high_half[q] = _mm512_cvtepi16_epi8(_mm512_srli_epi16(words, 8));
      }
      low[h] = _mm512_inserti64x4(_mm512_castsi256_si512(low_half[0]), low_half[1], 1);
      high[h] = _mm512_inserti64x4(_mm512_castsi256_si512(high_half[0]), high_half[1], 1);
    }
  }
  // 64 codes (two k-pairs of a panel) as their 64 bf16 results, in order, at `dst`
  void dequantize64(const uint8_t* src, uint32_t* dst) const {
    const __m512i codes = _mm512_loadu_si512(src);
    const __m512i low = _mm512_permutex2var_epi8(this->low[0], codes, this->low[1]);
    // the high byte takes the code's sign: bf16(-v * s) is -bf16(v * s)
    const __m512i high = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(this->high[0], codes, this->high[1]),
                                                   codes, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);
    // bytes interleave within 128-bit lanes: codes 0-7, 16-23, 32-39, 48-55 and 8-15, 24-31, 40-47, 56-63
    const __m512i a = _mm512_unpacklo_epi8(low, high), b = _mm512_unpackhi_epi8(low, high);
    _mm512_storeu_si512(dst, _mm512_permutex2var_epi64(a, _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), b));
    _mm512_storeu_si512(dst + kCols, _mm512_permutex2var_epi64(a, _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4), b));
  }
};
#endif

// Panel `src` ([K/2][16][2] fp8) as bf16 pairs at `dst`, each weight times its column's scale for its block of k
// (`scales`: [blocks][16]; k counted from k_offset, a row-split shard's first input).
void dequantize_panel(const uint8_t* src, const float* scales, int64_t half_k, int64_t block_k, int64_t k_offset,
                      uint32_t* dst) {
#if defined(CPU_CAPABILITY_AVX512)
  static const Magnitudes magnitudes;
  const __m512i pick_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i pick_hi = _mm512_add_epi32(pick_lo, _mm512_set1_epi32(8));
  const __m512 two_120 = _mm512_set1_ps(0x1p120f);
  // subnormal inputs read as zero under DAZ: then every block takes the exact values
  const bool daz = (_mm_getcsr() & 0x40) != 0;
#endif
  for (int64_t kp = 0; kp < half_k;) {
    const int64_t block = (k_offset + 2 * kp) / block_k;
    const int64_t end = std::min(half_k, ((block + 1) * block_k - k_offset) / 2);
    const float* s = scales + block * kCols;
#if defined(CPU_CAPABILITY_AVX512)
    const __m512 column_scales = _mm512_loadu_ps(s);
    const __m512 scale_lo = _mm512_permutexvar_ps(pick_lo, column_scales);
    const __m512 scale_hi = _mm512_permutexvar_ps(pick_hi, column_scales);
    const bool shifted = !daz && _mm512_cmp_ps_mask(_mm512_abs_ps(column_scales), _mm512_set1_ps(0x1p8f),
                                                    _CMP_NLT_UQ) == 0;
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
    const bool shared = _mm512_cmp_ps_mask(column_scales, _mm512_set1_ps(s[0]), _CMP_EQ_OQ) == 0xFFFF;
    if (shared && end - kp >= 8) {  // the table costs about as much as 8 k-pairs the other way
      const ScaledTable table(magnitudes, s[0]);
      for (; kp + 2 <= end; kp += 2) {
        __builtin_prefetch(src + 32 * kp + kPrefetchBytes, 0, 0);
        table.dequantize64(src + 32 * kp, dst + kCols * kp);
      }
    }
#endif
    if (shifted) {
      const __m512 lo = _mm512_mul_ps(scale_lo, two_120), hi = _mm512_mul_ps(scale_hi, two_120);
      for (; kp < end; ++kp) {
        __builtin_prefetch(src + 32 * kp + kPrefetchBytes, 0, 0);
        store32(_mm512_mul_ps(shifted16(src + 32 * kp), lo), _mm512_mul_ps(shifted16(src + 32 * kp + 16), hi),
                dst + kCols * kp);
      }
    } else {
      for (; kp < end; ++kp) {
        store32(_mm512_mul_ps(magnitudes.exact16(src + 32 * kp), scale_lo),
                _mm512_mul_ps(magnitudes.exact16(src + 32 * kp + 16), scale_hi), dst + kCols * kp);
      }
    }
#else
    for (; kp < end; ++kp) {
      auto* out = reinterpret_cast<c10::BFloat16*>(dst + kCols * kp);
      for (int i = 0; i < 32; ++i) {
        out[i] = c10::BFloat16(c10::detail::fp8e4m3fn_to_fp32_value(src[32 * kp + i]) * s[i / 2]);
      }
    }
#endif
  }
}

// One fp8 weight's panels and scales, and how its inputs map to scale blocks.
struct Fp8Panels {
  const uint8_t* panels;
  const float* scales;  // [num_panels][blocks][16]
  int64_t num_panels, half_k, blocks, block_k, k_offset;
};

Fp8Panels check_fp8_panels(const at::Tensor& panels, const at::Tensor& scales, int64_t block_k, int64_t k_offset) {
  TORCH_CHECK(panels.scalar_type() == at::kByte && panels.dim() == 4 && panels.size(2) == kCols &&
                  panels.size(3) == 2 && panels.is_contiguous(), "panels must be fp8 bits [P, K/2, 16, 2]");
  TORCH_CHECK(block_k > 0 && block_k % 2 == 0 && k_offset % 2 == 0 && k_offset >= 0,
              "block_k and k_offset must be even (a pair of inputs never spans two scale blocks)");
  const int64_t num_panels = panels.size(0), half_k = panels.size(1);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 3 && scales.size(0) == num_panels &&
                  scales.size(2) == kCols && scales.is_contiguous(), "scales must be fp32 [P, blocks, 16]");
  TORCH_CHECK(scales.size(1) * block_k > k_offset + 2 * half_k - 1,
              "the scales cover fewer inputs than the weight has");
  return {panels.data_ptr<uint8_t>(), scales.data_ptr<float>(), num_panels, half_k, scales.size(1), block_k, k_offset};
}

// Panel group g of `w` dequantized into this thread's buffer, then against rows [r0, r0 + rows) of x. With
// `has_next` the thread's next group's fp8 bytes stream in while the tiles compute (in the prefetching build),
// so that memory and arithmetic overlap instead of taking turns.
void fp8_group(const Fp8Panels& w, int64_t g, bool has_next, const c10::BFloat16* xp, int64_t ldx, const float* bp,
               c10::BFloat16* op, int64_t out_features, int64_t r0, int64_t rows) {
  thread_local std::vector<uint32_t> buffer;
  buffer.resize(kTilePanels * w.half_k * kCols);
  const int64_t p0 = g * kTilePanels, np = std::min<int64_t>(kTilePanels, w.num_panels - p0);
  const int64_t panel_bytes = w.half_k * kCols * 2;
  for (int64_t p = 0; p < np; ++p) {
    dequantize_panel(w.panels + (p0 + p) * panel_bytes, w.scales + (p0 + p) * w.blocks * kCols, w.half_k, w.block_k,
                     w.k_offset, buffer.data() + p * w.half_k * kCols);
  }
  const int64_t col0 = p0 * kCols, ncols = std::min(np * kCols, out_features - col0);
  const float* gb = bp != nullptr ? bp + col0 : nullptr;
  if constexpr (kPrefetchBuilt) {
    const int64_t after = std::max<int64_t>(0, std::min<int64_t>(kTilePanels, w.num_panels - p0 - kTilePanels));
    if (has_next && after > 0) {
      const auto* next = reinterpret_cast<const char*>(w.panels + (p0 + kTilePanels) * panel_bytes);
      group_tiles<true>(xp, ldx, buffer.data(), np, w.half_k, gb, op, out_features, col0, ncols, r0, rows, next,
                        after * panel_bytes / 64);
      return;
    }
  }
  group_tiles<false>(xp, ldx, buffer.data(), np, w.half_k, gb, op, out_features, col0, ncols, r0, rows);
}

}  // namespace

// x [..., K] bf16 (rows contiguous) times fp8 panels [P, K/2, 16, 2] (uint8 bits) with scales [P, blocks, 16]
// (fp32): [..., out_features] bf16; bias fp32/bf16 [out].
at::Tensor linear_fp8(at::Tensor x, at::Tensor panels, at::Tensor scales, int64_t block_k, int64_t k_offset,
                      int64_t out_features, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be bf16");
  const Fp8Panels w = check_fp8_panels(panels, scales, block_k, k_offset);
  const int64_t k = 2 * w.half_k;
  const radixrt::PanelProduct product = radixrt::check_panel_shape(x, k, w.num_panels, out_features, bias, kCols);
  auto x2 = x.reshape({-1, k});
  if (x2.stride(1) != 1 || x2.stride(0) < k) x2 = x2.contiguous();
  const int64_t rows = x2.size(0), ldx = x2.stride(0);
  auto out = at::empty({rows, out_features}, x.options());
  const auto* xp = x2.data_ptr<c10::BFloat16>();
  const float* bp = product.bias.defined() ? product.bias.data_ptr<float>() : nullptr;
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t groups = (w.num_panels + kTilePanels - 1) / kTilePanels;
  for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
    const int64_t block = std::min(kRowBlock, rows - r0);
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) fp8_group(w, g, g + 1 < end, xp, ldx, bp, op, out_features, r0, block);
    });
  }
  return out.view(product.out_shape);
}

// Several fp8 products of one shape in one parallel region (linear_bf16_grouped's over fp8 panels): rows
// [bounds[e], bounds[e + 1]) of x times weight e, into the same rows of the output; each row gets linear_fp8's bits.
at::Tensor linear_fp8_grouped(at::Tensor x, std::vector<at::Tensor> panels, std::vector<at::Tensor> scales,
                              std::vector<int64_t> bounds, int64_t block_k, int64_t k_offset, int64_t out_features) {
  TORCH_CHECK(!panels.empty() && scales.size() == panels.size() && bounds.size() == panels.size() + 1,
              "one scales tensor a weight, and one more bound than weights");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be 2-D bf16");
  TORCH_CHECK(bounds.front() == 0 && bounds.back() == x.size(0), "bounds must cover x's rows");
  std::vector<Fp8Panels> weights;
  for (size_t e = 0; e < panels.size(); ++e) {
    weights.push_back(check_fp8_panels(panels[e], scales[e], block_k, k_offset));
    TORCH_CHECK(weights[e].num_panels == weights[0].num_panels && weights[e].half_k == weights[0].half_k &&
                    weights[e].blocks == weights[0].blocks, "every weight must have the same shape");
    TORCH_CHECK(bounds[e] <= bounds[e + 1], "bounds must not decrease");
  }
  radixrt::check_panel_shape(x, 2 * weights[0].half_k, weights[0].num_panels, out_features, c10::nullopt, kCols);
  auto x2 = x.stride(1) == 1 && x.stride(0) >= x.size(1) ? x : x.contiguous();
  auto out = at::empty({x2.size(0), out_features}, x.options());
  const auto* xp = x2.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t ldx = x2.stride(0), groups = (weights[0].num_panels + kTilePanels - 1) / kTilePanels;
  struct Block { int64_t weight, r0, rows; };
  std::vector<Block> blocks;
  for (size_t e = 0; e < weights.size(); ++e) {
    for (int64_t r0 = bounds[e]; r0 < bounds[e + 1]; r0 += kRowBlock) {
      blocks.push_back({static_cast<int64_t>(e), r0, std::min(kRowBlock, bounds[e + 1] - r0)});
    }
  }
  at::parallel_for(0, static_cast<int64_t>(blocks.size()) * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Block& b = blocks[i / groups];
      fp8_group(weights[b.weight], i % groups, i + 1 < end && i % groups + 1 < groups, xp, ldx, nullptr, op,
                out_features, b.r0, b.rows);
    }
  });
  return out;
}
