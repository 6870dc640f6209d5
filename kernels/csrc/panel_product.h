// The checks and the set-up shared by the products over the panels (linear_bf16.cpp on vdpbf16ps, linear_amx.cpp
// on AMX tiles, linear_fp8.cpp over fp8 panels): the same arguments are refused with the same messages.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace radixrt {

struct PanelProduct {
  int64_t k;                      // input features
  int64_t num_panels;             // panels of 16 outputs
  at::Tensor bias;                // fp32 [out_features], or undefined
  std::vector<int64_t> out_shape; // x's leading dimensions, then out_features
};

// x [..., k] against `num_panels` panels of `cols` outputs: the product's shapes and its fp32 bias.
inline PanelProduct check_panel_shape(const at::Tensor& x, int64_t k, int64_t num_panels, int64_t out_features,
                                      const c10::optional<at::Tensor>& bias, int64_t cols) {
  PanelProduct p;
  p.k = k;
  p.num_panels = num_panels;
  TORCH_CHECK(x.size(-1) == p.k, "x has ", x.size(-1), " features, the weight ", p.k);
  TORCH_CHECK(out_features > (p.num_panels - 1) * cols && out_features <= p.num_panels * cols,
              "out_features disagrees with the panels");
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == out_features, "bias must have out_features elements");
    p.bias = bias->to(at::kFloat).contiguous();
  }
  p.out_shape = x.sizes().vec();
  p.out_shape.back() = out_features;
  return p;
}

inline PanelProduct check_panel_product(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                                        const c10::optional<at::Tensor>& bias, int64_t cols) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && panels.scalar_type() == at::kBFloat16, "x and panels must be bf16");
  TORCH_CHECK(panels.dim() == 4 && panels.size(2) == cols && panels.size(3) == 2 && panels.is_contiguous(),
              "panels must come from pack_linear_bf16");
  return check_panel_shape(x, 2 * panels.size(1), panels.size(0), out_features, bias, cols);
}

}  // namespace radixrt
