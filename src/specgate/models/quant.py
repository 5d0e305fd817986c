"""Block-quantized weights: a GGUF's own Q8_0 / Q5_0 / Q4_K / Q6_K tensors, kept as the file ships them.

A decode step on the CPU is a stream of weight reads, so the bytes a step reads set its floor. A GGUF's weights
as shipped are those bytes (Gemma-3-270M Q4_K_M: 235 MiB a step, against 539 MB in bf16). The runtime keeps each
quantized matrix as its raw GGUF blocks (QuantWeight: uint8 rows in ggml's layout) and the C kernels
(csrc/quant.c) decode 32 weights at a time in registers to float32 and multiply them into float32 activations.
The decoded values are ggml's dequantization exactly (each q * scale is exact in float32), and the products sum
in the float32 kernel's order, so:
- a quantized product equals the float32 product of gguf.quants' dequantized matrix bit for bit, and the model's
  logits equal those of the same GGUF de-quantised to float32 (transformers' route) bit for bit;
- it is batch-invariant like every C path here: a row's logits do not depend on the other rows of the call.
Activations, the KV cache, norms and logits stay float32; only the matrices (the projections and the tied
embedding / LM head) are quantized.

A Hugging Face safetensors model can be quantized on load to Q8_0 (`--dtype int8`, quantize_q8_0): that changes
the target model (its logits are no longer the checkpoint's), so it happens only when asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

# ggml type number -> (weights per block, bytes per block); the kinds the C kernels read
BLOCKS = {8: (32, 34), 6: (32, 22), 12: (256, 144), 14: (256, 210)}
KIND_NAMES = {8: "Q8_0", 6: "Q5_0", 12: "Q4_K", 14: "Q6_K"}
QUANTIZED_FORMATS = ("gguf", "int8")  # --dtype values of quantized weights: the GGUF's own, or Q8_0 on load


@dataclass(frozen=True)
class QuantPart:
    """Rows of one quantized kind: data [rows, row_bytes] uint8, contiguous, in ggml's block layout."""

    kind: int  # ggml type number (BLOCKS)
    data: Tensor  # [rows, K / block * block_bytes] uint8

    @property
    def rows(self) -> int:
        return self.data.shape[0]


@dataclass(frozen=True)
class QuantWeight:
    """A weight [N, K] as quantized row blocks (up to 4 parts, each of its own kind: a fused q/k/v whose parts the
    GGUF quantized differently). Stands where a float weight tensor stands in the runtime (transformer.linear,
    native.DecodeStack, the tied embedding); it computes in float32 and is never trained."""

    parts: tuple[QuantPart, ...]
    in_features: int

    requires_grad = False
    dtype = torch.float32  # what its products compute and return
    device = torch.device("cpu")

    def __post_init__(self) -> None:
        if not 1 <= len(self.parts) <= 4:
            raise ValueError(f"a QuantWeight has 1..4 parts (got {len(self.parts)})")
        for part in self.parts:
            if part.kind not in BLOCKS:
                raise ValueError(f"ggml type {part.kind} is not served: the kernels read {', '.join(KIND_NAMES.values())}")
            per_block, block_bytes = BLOCKS[part.kind]
            expected = (self.in_features // per_block * block_bytes)
            if self.in_features % per_block or part.data.dtype != torch.uint8 or part.data.dim() != 2 or part.data.shape[1] != expected:
                raise ValueError(f"{KIND_NAMES[part.kind]} rows of K={self.in_features} must be uint8 [rows, {expected}] "
                                 f"(K % {per_block} == 0); got {part.data.dtype} {tuple(part.data.shape)}")
            if not part.data.is_contiguous():
                raise ValueError("QuantPart data must be contiguous")
            if len(self.parts) > 1 and part.rows % 4:
                raise ValueError(f"a fused QuantWeight's parts need rows % 4 == 0 (got {part.rows})")

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(part.rows for part in self.parts), self.in_features)

    def numel(self) -> int:
        rows, k = self.shape
        return rows * k

    def dim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        return sum(part.data.numel() for part in self.parts)

    @staticmethod
    def concat(weights: list["QuantWeight"]) -> "QuantWeight":
        """Row blocks of several weights with the same K as one (parts of the same kind merged)."""
        parts: list[QuantPart] = []
        for weight in weights:
            for part in weight.parts:
                if parts and parts[-1].kind == part.kind:
                    parts[-1] = QuantPart(part.kind, torch.cat([parts[-1].data, part.data]))
                else:
                    parts.append(part)
        return QuantWeight(tuple(parts), weights[0].in_features)

    def dequantize(self) -> Tensor:
        """[N, K] float32 with gguf.quants' dequantization (the oracle for the kernels; numpy, no C)."""
        from gguf import GGMLQuantizationType, dequantize

        blocks = [dequantize(part.data.numpy(), GGMLQuantizationType(part.kind)) for part in self.parts]
        return torch.from_numpy(np.concatenate(blocks).reshape(self.shape).astype(np.float32))


def quantize_q8_0(weight: Tensor) -> QuantWeight:
    """weight [N, K] (K % 32 == 0) -> Q8_0 (ggml's quantize_row_q8_0_ref: per 32 weights d = amax / 127 as fp16,
    q = round(w / d)). Lossy: the model it belongs to is no longer the checkpoint's."""
    rows, k = weight.shape
    if k % 32:
        raise ValueError(f"Q8_0 needs K % 32 == 0 (got K={k})")
    blocks = weight.detach().float().reshape(rows, k // 32, 32)  # [N, K/32, 32]
    d = blocks.abs().amax(-1) / 127.0  # [N, K/32]
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse[..., None]).clamp(-128, 127).to(torch.int8)  # [N, K/32, 32]
    scale = d.to(torch.float16).view(torch.uint8).reshape(rows, k // 32, 2)
    data = torch.cat([scale, q.view(torch.uint8)], dim=-1).reshape(rows, k // 32 * 34).contiguous()
    return QuantWeight((QuantPart(8, data),), k)


class QuantLinear(nn.Module):
    """An nn.Linear whose weight is a QuantWeight (bias float32 or None); transformer.linear multiplies by it."""

    def __init__(self, weight: QuantWeight, bias: Tensor | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: Tensor) -> Tensor:
        from specgate.models.transformer import linear

        return linear(x, self.weight, self.bias)


class QuantEmbedding(nn.Module):
    """An nn.Embedding whose table is a one-part QuantWeight: a lookup dequantizes the rows it reads (in C)."""

    def __init__(self, weight: QuantWeight) -> None:
        super().__init__()
        if len(weight.parts) != 1:
            raise ValueError("a quantized embedding table has one part")
        self.weight = weight
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: Tensor) -> Tensor:
        from specgate.models import native

        flat = ids.reshape(-1).contiguous()
        return native.dequantize_rows(self.weight, flat).view(*ids.shape, self.embedding_dim)


# --- the GGUF's own tensors -------------------------------------------------------------------------------


def _gguf_arch(model_type: str) -> str:
    return {"gemma3_text": "gemma3", "qwen2": "qwen2", "llama": "llama", "mistral": "llama"}.get(model_type, model_type)


def read_gguf_weights(path: Any, config: Any) -> tuple[dict[str, QuantWeight], dict[str, Tensor]]:
    """The runtime's parameters from a .gguf: (quantized matrices by runtime name, float32 tensors by runtime name).

    Matrices of a served kind (Q8_0, Q5_0, Q4_K, Q6_K) stay as shipped; norms and biases are read as float32
    (Gemma's norms stored as 1 + w, as llama.cpp's converter writes them, are turned back into w); Llama and
    Mistral q/k rows are un-permuted (whole rows: exact on quantized blocks), as transformers does.
    Raises ValueError for a matrix of another kind (the fix: --dtype bfloat16)."""
    from gguf import GGUFReader, MODEL_ARCH_NAMES, GGMLQuantizationType, dequantize, get_tensor_name_map

    from specgate.models.transformer import ModelArgs

    args = ModelArgs.from_hf_config(config)
    arch_name = _gguf_arch(args.model_type)
    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == arch_name), None)
    if arch is None:
        raise ValueError(f"gguf does not know the architecture {arch_name!r}")
    name_map = get_tensor_name_map(arch, args.num_layers)
    reader = GGUFReader(str(path))
    by_name = {tensor.name: tensor for tensor in reader.tensors}
    quantized: dict[str, QuantWeight] = {}
    floats: dict[str, Tensor] = {}
    for runtime_name in runtime_parameter_names(args):
        module, _, suffix = runtime_name.rpartition(".")
        gguf_name = name_map.get_name("model." + module) or name_map.get_name(module)
        tensor = by_name.get(f"{gguf_name}.{suffix}") if gguf_name else None
        if tensor is None:
            if runtime_name == "lm_head.weight" and args.tie_word_embeddings:
                continue
            raise ValueError(f"the GGUF has no tensor for {runtime_name} (looked for {gguf_name}.{suffix})")
        kind = int(tensor.tensor_type)
        rows_k = [int(n) for n in reversed(tensor.shape)]  # ggml's shape is [K, N]
        is_matrix = len(rows_k) == 2 and suffix == "weight" and "norm" not in module
        if is_matrix:
            if kind not in BLOCKS:
                raise ValueError(
                    f"{tensor.name} is {GGMLQuantizationType(kind).name}: the quantized kernels read "
                    f"{', '.join(KIND_NAMES.values())}; load this GGUF with --dtype bfloat16 or float32"
                )
            data = torch.from_numpy(np.array(tensor.data, copy=True)).view(torch.uint8).reshape(rows_k[0], -1)
            if args.model_type in ("llama", "mistral") and module.endswith(("q_proj", "k_proj")):
                heads = args.num_heads if module.endswith("q_proj") else args.num_kv_heads
                data = _unpermute_rows(data, heads)
            quantized[runtime_name] = QuantWeight((QuantPart(kind, data.contiguous()),), rows_k[1])
            continue
        values = torch.from_numpy(dequantize(tensor.data, GGMLQuantizationType(kind)).astype(np.float32)).reshape(rows_k)
        if args.gemma_norms and "norm" in module:
            values = values - 1.0
        floats[runtime_name] = values.contiguous()
    return quantized, floats


def _unpermute_rows(data: Tensor, heads: int) -> Tensor:
    """llama.cpp's converter interleaves the two RoPE halves of each head's q/k rows; put them back (rows only)."""
    rows = data.shape[0]
    dim = rows // heads // 2
    return data.reshape(heads, dim, 2, -1).transpose(1, 2).reshape(rows, -1)


def runtime_parameter_names(args: Any) -> list[str]:
    """Every parameter name of a CausalLM with these ModelArgs (tied head included)."""
    from specgate.models.transformer import CausalLM

    with torch.device("meta"):
        model = CausalLM(args)
    return [name for name, _ in model.named_parameters(remove_duplicate=False)]
