"""FP8 (e4m3) weights: quantized checkpoints and the same quantization applied at load.

A checkpoint whose config says ``quantization_config: {"quant_method": "fp8", "weight_block_size": [bn, bk]}``
(Qwen3's and DeepSeek's FP8 releases; no ``weight_block_size``: one scale a tensor) stores each quantized linear
weight as ``float8_e4m3fn`` beside ``weight_scale_inv``, one fp32 scale per block of ``bn`` outputs by ``bk``
inputs (the last blocks partial where a dimension is not a multiple). A compressed-tensors checkpoint
(``quant_method: compressed-tensors``, llm-compressor's ``FP8`` / ``FP8-dynamic`` / ``FP8-block`` releases) with
8-bit float weights stores ``weight_scale`` beside each: one number a tensor, one per output channel ``[out, 1]``,
or one per block of its groups' ``block_structure``. ``--quantization fp8`` quantizes an
unquantized checkpoint's projections the same way as they are read (128 x 128 blocks, each block's largest
magnitude mapped to 448, as transformers' FP8 quantizer does).

The weights are weight-only fp8: activations stay in the model's dtype, and a weight's value is its fp8 value
times its block's scale, in fp32, rounded once to the model's dtype. That is what transformers computes when it
loads these checkpoints on a CPU (it dequantizes them), so logits compare with transformers' on the same
checkpoint. Activation scales (``activation_scheme: static``) are read and ignored, as transformers' CPU path
ignores them.

Where each weight runs: on a CPU with AVX512-BF16 and a bf16 model, radixrt's fp8 kernel (``linear_fp8``: one
byte a weight in memory, dequantized a panel group at a time, the bits of the bf16 product over the dequantized
weight); anywhere else (fp32 models, other CPUs, CUDA) the weight is dequantized once at load into the model's
dtype and runs as an unquantized one.

In the stream of checkpoint tensors (:func:`fp8_tensors`) a quantized weight becomes two tensors the linear layers
load like any other: ``<name>.weight`` as its fp8 bits (uint8) and ``<name>.weight_scale``, its scales expanded to
one row per output (``[out, ceil(in / bk)]`` fp32), so that stacking q/k/v, splitting Phi-3's fused projections and
sharding rows over tensor-parallel ranks are row operations on both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

FP8_MAX = 448.0  # e4m3's largest finite magnitude
ONLINE_BLOCK = (128, 128)
PER_TENSOR = 1 << 30  # block_k of a scale for the whole tensor
QUANTIZATION_METHODS = ("fp8",)
# the projections --quantization fp8 quantizes: every linear map of a layer but a mixture-of-experts router
_PROJECTION = re.compile(r"layers\.\d+\..*(_proj|\.w[123])\.weight$")
_IGNORED = ("activation_scale", "input_scale")


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's fp8 weights are blocked: ``block`` (outputs, inputs) or None for one scale a tensor;
    ``online``: quantized by radixrt at load (the checkpoint is unquantized)."""

    block: tuple[int, int] | None
    online: bool = False

    @property
    def block_k(self) -> int:
        return PER_TENSOR if self.block is None else self.block[1]


@dataclass
class Fp8Weight:
    """A linear layer's fp8 weight as loaded: ``bits`` ``[out, in]`` (uint8: e4m3 codes), ``scales`` ``[out,
    blocks]`` (fp32), input ``k``'s scale that of block ``(k_offset + k) // block_k`` (``k_offset``: a row-split
    tensor-parallel shard's first input)."""

    bits: torch.Tensor
    scales: torch.Tensor
    k_offset: int = 0

    def dequantize(self, block_k: int, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype``: each fp8 value times its scale in fp32, rounded once (transformers' values)."""
        blocks = (torch.arange(self.bits.shape[1], device=self.bits.device) + self.k_offset) // block_k
        values = self.bits.view(torch.float8_e4m3fn).float()
        return values.mul_(self.scales[:, blocks]).to(dtype)


def fp8_scheme(config, quantization: str | None = None) -> Fp8Scheme | None:
    """The model's fp8 scheme: the checkpoint's (its config's ``quantization_config``), else ``--quantization
    fp8``'s, else None. A ``ValueError`` names a quantization radixrt does not run."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        supported = ", ".join(QUANTIZATION_METHODS)
        raise ValueError(f"--quantization {quantization!r} is not supported (supported: {supported}; a GGUF file is "
                         "dequantized at load)")
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return Fp8Scheme(ONLINE_BLOCK, online=True) if quantization == "fp8" else None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return Fp8Scheme(_compressed_tensors_block(qc))
    if method != "fp8":
        raise ValueError(f"checkpoints quantized with {method!r} are not supported (supported: fp8 and "
                         "compressed-tensors' fp8 weights, e4m3)")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"fp8 format {qc.get('fmt')!r} is not supported (supported: e4m3)")
    return Fp8Scheme(_checked_block(qc.get("weight_block_size")))


def _checked_block(block) -> tuple[int, int] | None:
    if block is None:
        return None
    block = (int(block[0]), int(block[1]))
    if block[0] < 1 or block[1] < 2 or block[1] % 2:
        raise ValueError(f"an fp8 block of {list(block)} is not supported (the input block must be even)")
    return block


def _compressed_tensors_block(qc: dict) -> tuple[int, int] | None:
    """The blocks of a compressed-tensors checkpoint's fp8 weights (None: per tensor or per output channel); a
    ``ValueError`` for any other scheme of its groups (integer or 4-bit weights, groups, asymmetric)."""
    blocks = set()
    for name, group in (qc.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ValueError(f"compressed-tensors group {name!r} holds {weights.get('num_bits')}-bit "
                             f"{weights.get('type')} weights: only 8-bit float (fp8) weights are supported")
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel", "block") or weights.get("symmetric") is False:
            raise ValueError(f"compressed-tensors group {name!r}: fp8 weights by {strategy!r}"
                             f"{'' if weights.get('symmetric', True) else ', asymmetric'} are not supported "
                             "(supported: symmetric, by tensor, channel or block)")
        if strategy == "block":
            blocks.add(_checked_block(weights.get("block_structure")))
    if len(blocks) > 1:
        raise ValueError(f"compressed-tensors groups with different fp8 blocks {sorted(blocks)} are not supported")
    return blocks.pop() if blocks else None


def fp8_tensors(weights: Iterable[tuple[str, torch.Tensor]], scheme: Fp8Scheme | None
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors with each fp8 weight as its bits and per-row scales (see the module's docstring):
    joined with the checkpoint's ``weight_scale_inv`` or, for an online scheme, quantized here. Without a scheme
    the tensors pass unchanged."""
    if scheme is None:
        yield from weights
    elif scheme.online:
        for name, tensor in weights:
            if _PROJECTION.search(name) and tensor.dim() == 2:
                bits, grid = quantize(tensor, scheme.block)
                yield name, bits
                yield name + "_scale", row_scales(grid, bits.shape, scheme, name)
            else:
                yield name, tensor
    else:
        yield from _joined(weights, scheme)


def _joined(weights: Iterable[tuple[str, torch.Tensor]], scheme: Fp8Scheme) -> Iterator[tuple[str, torch.Tensor]]:
    pending_bits: dict[str, torch.Tensor] = {}
    pending_scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(_IGNORED):
            continue
        if name.endswith("_zero_point"):
            raise ValueError(f"{name!r}: fp8 weights with a zero point (asymmetric) are not supported")
        if name.endswith((".weight_scale_inv", ".weight_scale")):  # fp8's name; compressed-tensors'
            key = name[: name.rindex("_scale")]
            pending_scales[key] = tensor
        elif tensor.dtype == torch.float8_e4m3fn:
            if tensor.dim() != 2:
                raise ValueError(f"fp8 tensor {name!r} has {tensor.dim()} dimensions: only 2-D fp8 weights are "
                                 "supported (not experts stacked in one tensor)")
            key = name
            pending_bits[key] = tensor.view(torch.uint8)
        else:
            yield name, tensor
            continue
        if key in pending_bits and key in pending_scales:
            bits = pending_bits.pop(key)
            _refuse_nan(bits, key)
            yield key, bits
            yield key + "_scale", row_scales(pending_scales.pop(key), bits.shape, scheme, key)
    orphans = sorted(pending_bits) + sorted(pending_scales)
    if orphans:
        raise ValueError(f"fp8 weights and weight_scale_inv tensors do not pair up: {orphans[:4]}")


def row_scales(grid: torch.Tensor, shape: torch.Size, scheme: Fp8Scheme, name: str) -> torch.Tensor:
    """A weight's scales as one row per output, fp32 ``[out, blocks]`` (one column without blocks): from one scale
    for the tensor, one per output channel (``[out, 1]``), or one per block of the scheme's
    (``[ceil(out / bn), ceil(in / bk)]``)."""
    out_features, in_features = shape
    grid = grid.float()
    blocks = 1 if scheme.block is None else -(-in_features // scheme.block[1])
    if grid.numel() == 1:
        return grid.reshape(1, 1).expand(out_features, blocks).contiguous()
    if scheme.block is not None:
        bn, bk = scheme.block
        if tuple(grid.shape) == (-(-out_features // bn), blocks):
            return grid.repeat_interleave(bn, dim=0)[:out_features].contiguous()
    if grid.numel() == out_features and (grid.dim() == 1 or grid.shape[-1] == 1):
        return grid.reshape(out_features, 1).expand(out_features, blocks).contiguous()
    layout = f"in blocks of {list(scheme.block)}" if scheme.block is not None else "per tensor or per channel"
    raise ValueError(f"{name!r}: fp8 scales of shape {tuple(grid.shape)} for a weight {tuple(shape)} {layout}")


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` as fp8 bits (uint8) and its block scales ``[ceil(out / bn), ceil(in / bk)]`` (fp32, the
    ``weight_scale_inv`` a checkpoint would store): each block's largest magnitude maps to 448 (a block of zeros
    keeps scale 1), values rounded to nearest; partial blocks where a dimension is not a multiple."""
    bn, bk = block
    rows, cols = weight.shape
    padded = torch.zeros(-(-rows // bn) * bn, -(-cols // bk) * bk, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    max_abs = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(max_abs > 0, FP8_MAX / max_abs, torch.ones_like(max_abs))
    quantized = (tiles * scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    bits = quantized.view(padded.shape)[:rows, :cols].contiguous().view(torch.uint8)
    return bits, (1.0 / scale).float()


def _refuse_nan(bits: torch.Tensor, name: str) -> None:
    if bool(((bits & 0x7F) == 0x7F).any()):
        raise ValueError(f"fp8 weight {name!r} holds NaN values")
