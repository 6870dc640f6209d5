// The Python module of the CPU kernels: one binding per op defined in the other sources.
#include <torch/python.h>  // pybind11 and its tensor casters, without the C++ frontend (a third of the parse)

#include <vector>

std::vector<at::Tensor> paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor page_table,
                                     at::Tensor seq_lens, double scale, int64_t window,
                                     c10::optional<at::Tensor> chunk_rows, c10::optional<at::Tensor> chunk_offsets,
                                     c10::optional<at::Tensor> chunk_group, c10::optional<at::Tensor> shared_table,
                                     c10::optional<at::Tensor> shared_pages, bool portable, bool tiles);
bool bf16_dot_built();
bool decode_tiles_usable();
at::Tensor paged_extend(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor page_table,
                        at::Tensor prefix_lens, at::Tensor extend_lens, double scale, int64_t window);
bool paged_extend_vectorized();
at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps,
                    bool round_once, double weight_offset);
at::Tensor silu_and_mul(at::Tensor gate_up);
at::Tensor gelu_tanh_and_mul(at::Tensor gate_up);
void rotary_embedding(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos_cache, at::Tensor sin_cache);
void rope_and_store(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor cos_cache,
                    at::Tensor sin_cache, at::Tensor slots, at::Tensor k_cache, at::Tensor v_cache);
at::Tensor pack_linear_panels(at::Tensor weight);
at::Tensor linear_panels(at::Tensor x, at::Tensor panels, int64_t out_features, c10::optional<at::Tensor> bias);
bool linear_panels_built();
at::Tensor pack_linear_bf16(at::Tensor weight);
at::Tensor linear_bf16(at::Tensor x, at::Tensor panels, int64_t out_features, c10::optional<at::Tensor> bias);
bool linear_bf16_built();
at::Tensor linear_bf16_grouped(at::Tensor x, std::vector<at::Tensor> panels, std::vector<int64_t> bounds,
                               int64_t out_features);
at::Tensor linear_fp8(at::Tensor x, at::Tensor panels, at::Tensor scales, int64_t block_k, int64_t k_offset,
                      int64_t out_features, c10::optional<at::Tensor> bias);
at::Tensor linear_fp8_grouped(at::Tensor x, std::vector<at::Tensor> panels, std::vector<at::Tensor> scales,
                              std::vector<int64_t> bounds, int64_t block_k, int64_t k_offset, int64_t out_features);
at::Tensor linear_amx(at::Tensor x, at::Tensor panels, int64_t out_features, c10::optional<at::Tensor> bias,
                      bool fp32_out);
bool linear_amx_usable();
at::Tensor greedy_tokens(at::Tensor logits);
at::Tensor sample_tokens(at::Tensor logits, at::Tensor temperatures, at::Tensor uniforms);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention reading K/V pages in place, a shared prefix once per chunk (CPU)");
  m.def("bf16_dot_built", &bf16_dot_built, "whether paged_decode multiplies bf16 with vdpbf16ps in this build");
  m.def("decode_tiles_usable", &decode_tiles_usable, "whether paged_decode's bf16 products run on AMX tiles here");
  m.def("paged_extend", &paged_extend, "prefill attention over bf16 K/V pages read in place, causal (CPU)");
  m.def("paged_extend_vectorized", &paged_extend_vectorized, "whether paged_extend runs on AVX-512 vectors here");
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally adding x into the residual first (in place); round_once: Gemma's and OLMo 2's");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a merged gate/up projection");
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "gelu(gate, tanh approximation) * up of a merged gate/up projection");
  m.def("pack_linear_panels", &pack_linear_panels, "an fp32 weight [out, in] as panels of 16 outputs [P, in, 16]");
  m.def("linear_panels", &linear_panels, "x W^T (+ b) with W packed by pack_linear_panels (AVX2/FMA fp32)");
  m.def("linear_panels_built", &linear_panels_built, "whether this build has the AVX2/FMA panel kernel");
  m.def("pack_linear_bf16", &pack_linear_bf16, "a bf16 weight [out, in] as panels of 16 outputs in pairs [P, in/2, 16, 2]");
  m.def("linear_bf16", &linear_bf16, "x W^T (+ b) in bf16 with W packed by pack_linear_bf16 (vdpbf16ps)");
  m.def("linear_bf16_grouped", &linear_bf16_grouped,
        "linear_bf16 over consecutive row ranges of x, each through its own packed weight, in one parallel region");
  m.def("linear_bf16_built", &linear_bf16_built, "whether linear_bf16 multiplies with vdpbf16ps in this build");
  m.def("linear_fp8", &linear_fp8,
        "x W^T (+ b) in bf16 with W as fp8 panels and block scales, dequantized a panel group at a time (vdpbf16ps)");
  m.def("linear_fp8_grouped", &linear_fp8_grouped,
        "linear_fp8 over consecutive row ranges of x, each through its own fp8 weight, in one parallel region");
  m.def("linear_amx", &linear_amx, "linear_bf16's product on AMX tiles over the same panels (K a multiple of 32)");
  m.def("linear_amx_usable", &linear_amx_usable, "whether this build has the AMX path and the tiles are granted");
  m.def("rotary_embedding", &rotary_embedding, "neox-style rotary embedding of q and k, in place");
  m.def("greedy_tokens", &greedy_tokens, "each row's first largest logit (the first NaN where it has one), as torch's max");
  m.def("sample_tokens", &sample_tokens, "each row's token by inverse CDF of softmax(logits / T) at its uniform, in one kernel");
  m.def("rope_and_store", &rope_and_store, "rotary embedding of q (in place) and k, k and v stored into cache slots");
}
