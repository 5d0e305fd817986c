"""A GGUF's tensors as the runtime's parameters: quantized matrices kept as shipped, norms and biases as float32.

Split from models/quant.py (the block formats) because it needs the model's layout (transformer.ModelArgs,
CausalLM's parameter names) while the runtime's layers need the formats: one direction of import each.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from specgate.models.quant import GGUF_KINDS, KIND_NAMES, QuantPart, QuantWeight
from specgate.models.transformer import CausalLM, ModelArgs


def _gguf_arch(model_type: str) -> str:
    return {"gemma3_text": "gemma3", "qwen2": "qwen2", "llama": "llama", "mistral": "llama"}.get(model_type, model_type)


def read_gguf_weights(path: Any, config: Any) -> tuple[dict[str, QuantWeight], dict[str, Tensor]]:
    """The runtime's parameters from a .gguf: (quantized matrices by runtime name, float32 tensors by runtime name).

    Matrices of a served kind (Q8_0, Q5_0, Q4_K, Q6_K) stay as shipped; norms and biases are read as float32
    (Gemma's norms stored as 1 + w, as llama.cpp's converter writes them, are turned back into w); Llama and
    Mistral q/k rows are un-permuted (whole rows: exact on quantized blocks), as transformers does.
    Raises ValueError for a matrix of another kind (the fix: --dtype bfloat16)."""
    from gguf import GGUFReader, MODEL_ARCH_NAMES, GGMLQuantizationType, dequantize, get_tensor_name_map

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
            if kind not in GGUF_KINDS:
                raise ValueError(
                    f"{tensor.name} is {GGMLQuantizationType(kind).name}: the quantized kernels read "
                    f"{', '.join(KIND_NAMES[k] for k in GGUF_KINDS)}; load this GGUF with --dtype bfloat16 or float32"
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
    with torch.device("meta"):
        model = CausalLM(args)
    return [name for name, _ in model.named_parameters(remove_duplicate=False)]
