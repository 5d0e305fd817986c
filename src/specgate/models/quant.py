"""Block-quantized weights: a GGUF's own Q8_0 / Q5_0 / Q4_K / Q6_K tensors, kept as the file ships them.

A decode step on the CPU is a stream of weight reads, so the bytes a step reads set its floor. A GGUF's weights
as shipped are those bytes (Gemma-3-270M Q4_K_M: 235 MiB a step, against 539 MB in bf16). The runtime keeps each
quantized matrix as its raw GGUF blocks (QuantWeight: uint8 rows in ggml's layout) and the C kernels
(csrc/quant.c) multiply them in one of two ways, chosen by the CPU alone:
- int8 activations (AVX-512 VNNI, llama.cpp's method): each 32-block of x is rounded to int8 with a float32
  scale, every weight group's dot product is taken in integers (exact) and scaled in float32. With 2 cores the
  float32 widening of the weights, not the memory, was the limit; integer dots remove it. At load every matrix
  is rearranged exactly into one sequential stream per 4 rows (csrc/quant.c), Q8_0 / Q5_0 / Q4_K block-transposed
  so that one integer lane sums a whole 32-group and extra rows of x (a verification's tokens) cost little. The model is the GGUF as llama.cpp computes it, not its float32
  de-quantisation: decode logits differ from that by activation rounding (top token agrees at ~95% of positions).
- float32 activations (AVX2 / AVX-512 without VNNI, or SPECGATE_VNNI=0): 32 weights at a time decoded in
  registers to float32 (ggml's dequantization exactly) and summed in the float32 kernel's order, so a product
  equals the float32 product of gguf.quants' dequantized matrix bit for bit.
Either way a product is batch-invariant like every C path here: a row's logits do not depend on the other rows of
the call, so greedy speculation stays token-identical to greedy target-only decoding. Activations between the
products, the KV cache, norms and logits stay float32.

A Hugging Face safetensors model can be quantized on load to Q8_0 (`--dtype int8`, quantize_q8_0): that changes
the target model (its logits are no longer the checkpoint's), so it happens only when asked.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

# ggml type number -> (weights per block, bytes per block); the kinds the C kernels read
BLOCKS = {8: (32, 34), 6: (32, 22), 12: (256, 144), 14: (256, 210), 108: (128, 136), 109: (128, 88), 110: (128, 96), 111: (64, 64)}
KIND_NAMES = {8: "Q8_0", 6: "Q5_0", 12: "Q4_K", 14: "Q6_K", 108: "Q8_0_R4", 109: "Q5_R4", 110: "Q4K_R4", 111: "Q6K_R4"}
GGUF_KINDS = (8, 6, 12, 14)  # the ggml types a GGUF may hold that the kernels read
# GGUF kinds rearranged at load for the int8 kernels, 4 rows interleaved (specgate's own numbers; the layouts are
# described in csrc/quant.c): ggml kind -> its repacked kind
REPACKED_KIND = {8: 108, 6: 109, 12: 110, 14: 111}
Q8_0_R4 = 108  # unpack_q8_0_r4 inverts it
REPACKED = tuple(REPACKED_KIND.values())
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
            if (len(self.parts) > 1 or part.kind in REPACKED) and part.rows % 4:
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
        """[N, K] float32 with gguf.quants' dequantization (the oracle for the kernels; numpy, no C). Q8_0_R4 is
        unpacked first; the other repacked kinds exist only where the C kernels run and unpack there."""
        from gguf import GGMLQuantizationType, dequantize

        if any(part.kind in REPACKED[1:] for part in self.parts):
            raise ValueError("a Q5 / Q4_K / Q6_K part repacked for the kernels unpacks in C: use native.dequantize_rows")
        blocks = [dequantize(unpack_q8_0_r4(part.data, self.in_features).numpy() if part.kind == Q8_0_R4 else part.data.numpy(),
                             GGMLQuantizationType(8 if part.kind == Q8_0_R4 else part.kind)) for part in self.parts]
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


def unpack_q8_0_r4(data: Tensor, k: int) -> Tensor:
    """Q8_0_R4 rows [N, K / 32 * 34] back to Q8_0's (the inverse of csrc/quant.c's repack, in torch): per 4-row
    block, K / 128 steps of 8 vectors of 64 quant bytes (q ^ 0x80; vector s, lane 4 j + b: bytes 4 s .. 4 s + 3 of
    row j's group b) then 16 fp16 scales (lane 4 j + b)."""
    rows, steps = data.shape[0], k // 128
    blocks = data.reshape(rows // 4, steps, 544)  # [N/4, T, 544]
    quants = (blocks[..., :512].reshape(rows // 4, steps, 8, 4, 4, 4) ^ 0x80).permute(0, 3, 1, 4, 2, 5)  # [N/4, j, T, b, s, 4]
    scales = blocks[..., 512:].reshape(rows // 4, steps, 4, 4, 2).permute(0, 2, 1, 3, 4)  # [N/4, j, T, b, 2]
    quants = quants.reshape(rows // 4, 4, steps * 4, 32)
    scales = scales.reshape(rows // 4, 4, steps * 4, 2)
    return torch.cat([scales, quants], dim=-1).reshape(rows, k // 32 * 34).contiguous()
