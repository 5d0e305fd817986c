"""The decoder-only transformer, in one file (nanoGPT / gpt-fast style): Llama, Mistral, Qwen2 and Gemma-3 text.

The four families differ only in a handful of switches, collected in ModelArgs:
- Llama: RMSNorm(w * x), SwiGLU MLP, RoPE (default / linear / llama3 scaling), optional biases.
- Mistral: Llama with a sliding window on every layer.
- Qwen2: Llama with q/k/v biases, sliding window on the layers that `layer_types` marks.
- Gemma-3: RMSNorm((1 + w) * x), embeddings scaled by sqrt(hidden) (in the model dtype), RMSNorm on q and k,
  attention scale query_pre_attn_scalar**-0.5, norms before and after both attention and MLP, GeGLU with the
  tanh gelu, sliding-window local layers with their own RoPE base, optional final-logit soft-capping, tied
  head. Like transformers' Gemma3 (the reference), attn_logit_softcapping is not applied: Gemma-3 replaced
  Gemma-2's attention soft-capping with the q/k norms, and its configs set it to null.

Attention reads keys from the position-indexed KVCache: the query at position p of a slot sees the slot's keys
at positions <= p (and > p - window on sliding layers). Everything else (padding, stale drafts past p) is masked
by position, so one call can score a ragged batch of rows with different lengths and start positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specgate.models.dtypes import native_bf16
from specgate.models import native
from specgate.models.kv_cache import KVCache
from specgate.models.quant import QuantWeight

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "gemma3_text")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


@dataclass(frozen=True)
class ModelArgs:
    """Architecture of one model, read from a Hugging Face config by from_hf_config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float
    activation: str
    attn_scale: float  # multiplies q . k
    layer_windows: tuple[int | None, ...]  # per layer: sliding window (keys with pos > p - window) or None
    layer_rope: tuple[str, ...]  # per layer: key into rope_parameters
    rope_parameters: dict[str, dict[str, Any]] = field(default_factory=dict)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    gemma_norms: bool = False  # (1 + w) RMSNorm, q/k norms, pre/post norms around attention and MLP
    embed_scale: float | None = None
    tie_word_embeddings: bool = False
    final_logit_softcapping: float | None = None

    @staticmethod
    def from_hf_config(config: Any) -> "ModelArgs":
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            hint = " (a multimodal Gemma-3 checkpoint: use its text model, model_type 'gemma3_text')" if model_type == "gemma3" else ""
            raise ValueError(
                f"model_type '{model_type}' is not supported{hint}: supported model types are "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        num_layers = config.num_hidden_layers
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * num_layers)
        sliding_window = getattr(config, "sliding_window", None)
        if model_type == "mistral":  # Mistral: every layer slides when sliding_window is set
            windows = [sliding_window] * num_layers
        else:
            windows = [sliding_window if kind == "sliding_attention" else None for kind in layer_types]
        rope = dict(config.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
        if "full_attention" in rope or "sliding_attention" in rope:  # Gemma-3: one RoPE per layer type
            rope_parameters, layer_rope = rope, layer_types
        else:
            rope_parameters, layer_rope = {"all": rope}, ["all"] * num_layers
        common = dict(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=num_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=head_dim,
            max_position_embeddings=config.max_position_embeddings,
            norm_eps=config.rms_norm_eps,
            layer_windows=tuple(windows),
            layer_rope=tuple(layer_rope),
            rope_parameters=rope_parameters,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )
        if model_type == "gemma3_text":
            if getattr(config, "use_bidirectional_attention", False):
                raise ValueError("use_bidirectional_attention=True (an encoder config) is not a causal LM: load a causal Gemma-3")
            bias = bool(getattr(config, "attention_bias", False))
            return ModelArgs(
                **common,
                activation=config.hidden_activation,
                attn_scale=config.query_pre_attn_scalar**-0.5,
                qkv_bias=bias,
                o_bias=bias,
                gemma_norms=True,
                embed_scale=config.hidden_size**0.5,
                final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
            )
        bias = bool(getattr(config, "attention_bias", False))
        return ModelArgs(
            **common,
            activation=config.hidden_act,
            attn_scale=head_dim**-0.5,
            qkv_bias=True if model_type == "qwen2" else bias,
            o_bias=False if model_type == "qwen2" else bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )


def rope_inv_freq(params: dict[str, Any], head_dim: int) -> Tensor:
    """Inverse frequencies [head_dim / 2] float32 for a rope_parameters dict (types default, linear, llama3)."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type '{rope_type}' is not supported: supported RoPE types are {', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={params['partial_rotary_factor']} is not supported: only 1.0 (RoPE on the whole head)")
    base = params.get("rope_theta", 10000.0)
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))  # [D/2]
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_context = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)  # long waves: divided by factor
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


STACK_ACTIVATION = {  # ModelArgs.activation -> what native.DecodeStack computes in C (absent: the per-layer path)
    "silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "tanh_gelu", "gelu_new": "tanh_gelu", "gelu_fast": "tanh_gelu",
}
UPCAST_CHUNK_ELEMENTS = 1 << 21  # weight elements upcast to fp32 at a time (8 MB): the chunk stays in cache while used


def _onednn_linear_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


ONEDNN_LINEAR = _onednn_linear_available()


def _inference(*tensors: Tensor | None) -> bool:
    """True unless autograd must record this op (grad enabled and an input requires grad): the native kernels and
    oneDNN's op record no graph."""
    return not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in tensors)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [..., K] times weight [N, K] transposed (+ bias [N]) -> [..., N], like F.linear, faster on CPU.

    - float32 activations on CPU, few rows (a float32 LM head times 1..20, a bf16 one times 1..64, a layer's weight
      times 1..64), a float32 or bfloat16 weight: specgate.models.native's C kernel, which reads the weight once for all rows (oneDNN and
      MKL cost 2-3x a 1-row product for 2-9 rows; Gemma-3-270M's layer products: 0.6-0.9x oneDNN's time at 1 row,
      ~0.5-0.6x at 5 rows).
    - other float32 on CPU (a prefill, a wide serving batch): oneDNN's inner-product primitive
      (torch.ops.mkldnn._linear_pointwise, the op inductor emits for a linear, on the plain strided weight).
      F.linear goes to MKL, whose matrix-vector product runs on one core on this project's AMD CPUs and reads
      memory at half the machine's bandwidth; oneDNN uses every torch thread. Gemma-3-270M's 262,144 x 640 head, 2 threads, 1 row: 57 ms (F.linear) vs 25 ms; 9 rows:
      177 vs 74 ms; a 2048 x 640 layer weight read from memory: ~470 vs ~270 us (bench/bench_perf.py).
      Not used where autograd needs the graph (training), which the op does not record.
    - bfloat16 weights with float32 activations (how the runtime runs a bf16 model on the CPU, see
      CausalLM.compute_dtype): few rows go to the same kernel, which widens each bf16 weight to float32 in its
      registers, so a decode step reads half the bytes; more rows (a prefill) upcast the weight in cache-sized
      chunks and multiply in float32. The output is float32.
    - bfloat16 activations (a bf16 model off the CPU path) without native bf16 instructions: PyTorch's bf16 GEMM
      then costs one matrix-vector pass per row, so the weight is upcast to float32 in cache-sized chunks and
      multiplied in float32 (the bytes read from memory stay bf16); the result is rounded to bf16, as a bf16 GEMM
      with float32 accumulation does.
    """
    if isinstance(weight, QuantWeight):
        return _quant_linear(x, weight, bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows == 0 or x.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return F.linear(x, weight, bias)
    if not _inference(x, weight, bias):
        return F.linear(x, weight, bias)
    if native.applies(x, weight):  # decode / verification rows: the weight read once (specgate.models.native)
        out = native.skinny_product(x.reshape(rows, x.shape[-1]).contiguous(), weight)  # [R, N]; applies() checked
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], weight.shape[0])
    if weight.dtype == torch.float32:
        if not ONEDNN_LINEAR or x.dtype != torch.float32 or not weight.is_contiguous():
            return F.linear(x, weight, bias)
        flat = x.reshape(rows, x.shape[-1])  # [R, K]
        out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")  # [R, N]
        return out.reshape(*x.shape[:-1], weight.shape[0])
    if x.dtype == torch.float32:  # bf16 weights, float32 activations: a float32 product of the upcast weight
        out = _upcast_mm(weight, x.reshape(rows, x.shape[-1]).t()).t()  # [R, N] float32
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], weight.shape[0])
    if rows == 1 or native_bf16():
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])  # [R, K]
    out = _upcast_mm(weight, flat.float().t())  # [N, R] float32
    out = out.t().contiguous().to(x.dtype)  # [R, N]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


class QuantLinear(nn.Module):
    """An nn.Linear whose weight is a QuantWeight (bias float32 or None); transformer.linear multiplies by it."""

    def __init__(self, weight: QuantWeight, bias: Tensor | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: Tensor) -> Tensor:
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
        flat = ids.reshape(-1).contiguous()
        return native.dequantize_rows(self.weight, flat).view(*ids.shape, self.embedding_dim)


def _quant_linear(x: Tensor, weight: QuantWeight, bias: Tensor | None) -> Tensor:
    """x [..., K] @ a quantized weight [N, K]^T (+ bias) -> [..., N] float32: decode / verification rows through the
    C kernel (batch-invariant; int8 activations where the CPU has VNNI); more rows (a prefill) dequantize the
    weight in cache-sized chunks of rows and multiply in float32 (oneDNN / MKL), with x rounded as the int8
    kernels round it."""
    rows, k = x.numel() // x.shape[-1], x.shape[-1]
    flat = x.reshape(rows, k).float().contiguous()  # [R, K]
    if native.applies(flat, weight):
        out = native.skinny_product(flat, weight)  # [R, N]
    elif native.available():
        if native.int8_activations():  # the rows the int8 kernels would see (a prefill agrees with decode steps)
            flat = native.round_activations(flat)
        out = torch.empty(rows, weight.shape[0], dtype=torch.float32)  # [R, N]
        step, column = max(1, UPCAST_CHUNK_ELEMENTS // k), 0
        for index, part in enumerate(weight.parts):
            for start in range(0, part.rows, step):
                ids = torch.arange(start, min(start + step, part.rows))
                chunk = native.dequantize_rows(weight, ids, part=index)  # [n, K]
                torch.mm(flat, chunk.t(), out=out[:, column + start : column + start + ids.numel()])
            column += part.rows
    else:  # no C kernels here: gguf.quants' numpy dequantization (slow, exact)
        out = flat @ weight.dequantize().t()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _upcast_mm(weight: Tensor, right: Tensor) -> Tensor:
    """weight [N, K] (bf16) @ right [K, R] (float32) -> [N, R] float32, upcasting the weight chunk by chunk."""
    out = torch.empty(weight.shape[0], right.shape[1], dtype=torch.float32)  # [N, R]
    step = max(1, UPCAST_CHUNK_ELEMENTS // weight.shape[1])
    scratch = torch.empty(min(step, weight.shape[0]), weight.shape[1], dtype=torch.float32)  # [n, K]
    for start in range(0, weight.shape[0], step):
        chunk = weight[start : start + step]  # [n, K]
        upcast = scratch[: chunk.shape[0]].copy_(chunk)
        torch.mm(upcast, right, out=out[start : start + chunk.shape[0]])
    return out


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, T, D]; cos, sin [B, 1, T, D]."""
    return x * cos + rotate_half(x) * sin


class RMSNorm(nn.Module):
    """RMSNorm computed in float32. Llama: w * x̂ (cast first). Gemma: (1 + w) * x̂ (cast last), weights stored as w."""

    def __init__(self, dim: int, eps: float, gemma: bool) -> None:
        super().__init__()
        self.eps, self.gemma = eps, gemma
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))
        self._scale: tuple[tuple[int, int, torch.dtype], Tensor] | None = None  # (weight identity, 1 + w in float32)

    def _gemma_scale(self) -> Tensor:
        """1 + w in float32, computed once per version of the weight (not per call: decode calls this ~100x a step)."""
        weight = self.weight
        if (torch.is_grad_enabled() and weight.requires_grad) or weight.is_inference():
            return 1.0 + weight.float()  # training: autograd needs the graph to w; inference tensors have no version
        key = (weight.data_ptr(), weight._version, weight.dtype)
        if self._scale is None or self._scale[0] != key:
            self._scale = (key, (1.0 + weight.detach().float()).contiguous())
        return self._scale[1]

    def forward(self, x: Tensor) -> Tensor:
        shape = (x.shape[-1],)
        if self.gemma:  # one fused kernel: x̂ * (1 + w), all in float32
            if x.dtype == torch.float32:
                scale = self._gemma_scale()
                if _inference(x, scale) and native.norm_applies(x, scale):  # decode rows: one C call
                    return native.rms_norm(x, scale, self.eps)
                return F.rms_norm(x, shape, scale, self.eps)
            return F.rms_norm(x.float(), shape, self._gemma_scale(), self.eps).type_as(x)
        if _inference(x, self.weight) and native.norm_applies(x, self.weight):  # float32 decode rows: one C call
            return native.rms_norm(x, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(x.dtype)


def _proj(layer: nn.Linear, x: Tensor) -> Tensor:
    return linear(x, layer.weight, layer.bias)


class FusedLinears:
    """Several nn.Linear over the same input, their weights (and biases) made row blocks of one tensor, so that a
    forward is one matrix product instead of several (q, k, v: one; gate, up: one). Each layer's parameter keeps
    its name, shape and values: its .data becomes a view of the fused tensor, so the state dict, in-place updates
    and load_state_dict (which copies in place) keep working and stay in the fused tensor. Anything that gives a
    layer new storage (model.to(...), assigning a new Parameter) breaks the aliasing; `get()` notices (data
    pointers differ) and returns None, and the caller falls back to the separate products."""

    def __init__(self, layers: list[nn.Linear]) -> None:
        self.layers = layers
        self.weight = torch.cat([layer.weight.detach() for layer in layers])  # [sum N_i, K]
        has_bias = layers[0].bias is not None
        self.bias = torch.cat([layer.bias.detach() for layer in layers]) if has_bias else None  # [sum N_i]
        self.sizes = [layer.weight.shape[0] for layer in layers]
        offset = 0
        for layer, size in zip(layers, self.sizes):
            layer.weight.data = self.weight[offset : offset + size]
            if has_bias:
                layer.bias.data = self.bias[offset : offset + size]
            offset += size
        # where each layer's weight and bias must start for the aliasing to hold (the fused tensors never move)
        self._expected = [(layer.weight.data_ptr(), layer.bias.data_ptr() if has_bias else None) for layer in layers]

    def _aliased(self) -> bool:
        for layer, size, (weight_ptr, bias_ptr) in zip(self.layers, self.sizes, self._expected):
            if layer.weight.data_ptr() != weight_ptr or layer.weight.shape != (size, self.weight.shape[1]):
                return False
            if bias_ptr is not None and (layer.bias is None or layer.bias.data_ptr() != bias_ptr):
                return False
        return True

    def get(self) -> tuple[Tensor, Tensor | None] | None:
        """(weight, bias) to multiply by, or None where the separate layers must be used: the aliasing is broken, or
        autograd needs the layers' own parameters (training)."""
        if torch.is_grad_enabled() and self.layers[0].weight.requires_grad:
            return None
        return (self.weight, self.bias) if self._aliased() else None


class QuantFusedLinears:
    """FusedLinears for QuantLinear layers: their quantized row blocks as one QuantWeight (parts of different kinds
    kept apart: a GGUF often quantizes q, k and v differently), so q/k/v and gate/up stay one product each."""

    def __init__(self, layers: list[QuantLinear]) -> None:
        self.layers = layers
        self.parts = [layer.weight for layer in layers]
        self.weight = QuantWeight.concat(self.parts)
        self.bias = torch.cat([layer.bias for layer in layers]) if layers[0].bias is not None else None
        self.sizes = [layer.weight.shape[0] for layer in layers]

    def get(self) -> tuple[QuantWeight, Tensor | None] | None:
        """(weight, bias), or None where a layer's weight was replaced since."""
        return (self.weight, self.bias) if all(layer.weight is part for layer, part in zip(self.layers, self.parts)) else None


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU (silu) or GeGLU (tanh gelu)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        if args.activation not in _ACTIVATIONS:
            raise ValueError(f"activation '{args.activation}' is not supported: supported are {', '.join(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[args.activation]
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)
        self.fused: FusedLinears | QuantFusedLinears | None = None  # gate and up as one product (fuse_projections)

    def forward(self, x: Tensor) -> Tensor:
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        fused = self.fused.get() if self.fused is not None else None
        if fused is not None:
            gate_out, up_out = linear(x, *fused).chunk(2, dim=-1)  # [..., I] each
            return linear(self.act(gate_out) * up_out, down.weight, down.bias)
        return linear(self.act(linear(x, gate.weight, gate.bias)) * linear(x, up.weight, up.bias), down.weight, down.bias)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.window, self.rope_key = args.layer_windows[layer], args.layer_rope[layer]
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.scale = args.attn_scale
        self.q_proj = nn.Linear(args.hidden_size, args.num_heads * args.head_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.hidden_size, args.num_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.hidden_size, args.num_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.num_heads * args.head_dim, args.hidden_size, bias=args.o_bias)
        if args.gemma_norms:
            self.q_norm = RMSNorm(args.head_dim, args.norm_eps, gemma=True)
            self.k_norm = RMSNorm(args.head_dim, args.norm_eps, gemma=True)
        else:
            self.q_norm = self.k_norm = None
        self.fused: FusedLinears | QuantFusedLinears | None = None  # q, k, v as one product (fuse_projections)

    def forward(self, x: Tensor, batch: "Batch") -> Tensor:
        """x [B, T, H] -> [B, T, H]; writes this layer's K/V of the batch into the cache."""
        B, T, _ = x.shape
        fused = self.fused.get() if self.fused is not None else None
        if fused is not None and batch.native:  # decode / verification rows: norms, RoPE, cache write, attention in C
            qkv = linear(x, *fused).reshape(B * T, -1)  # [B T, (H_q + 2 H_kv) D]
            q_norm, k_norm = self.q_norm, self.k_norm
            out = native.attention(
                qkv, batch.flat_positions, batch.flat_slots, batch.inv_freq[self.rope_key],
                q_norm._gemma_scale() if q_norm is not None else None,
                k_norm._gemma_scale() if k_norm is not None else None,
                q_norm.eps if q_norm is not None else 0.0,
                self.num_heads, self.num_kv_heads, batch.cache.keys[self.layer], batch.cache.values[self.layer],
                self.window, self.scale, batch.kv_length,
            )  # [B T, H_q D]
            return _proj(self.o_proj, out.view(B, T, -1))
        if fused is not None:
            q, k, v = linear(x, *fused).split(self.fused.sizes, dim=-1)  # [B, T, H_q D], [B, T, H_kv D] x 2
        else:
            q, k, v = _proj(self.q_proj, x), _proj(self.k_proj, x), _proj(self.v_proj, x)
        q = q.view(B, T, self.num_heads, self.head_dim)  # [B, T, H_q, D]
        k = k.view(B, T, self.num_kv_heads, self.head_dim)  # [B, T, H_kv, D]
        if self.q_norm is not None:  # per head vector: before the transpose, on the contiguous rows
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H_q, T, D], [B, H_kv, T, D]
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, H_kv, T, D]
        cos, sin = batch.rope(self.rope_key)  # [B, 1, T, D] each
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        batch.cache.write(self.layer, batch.slots, batch.positions, k, v)
        mask, start = batch.mask(self.window)  # [B, 1, T, L - start]: only keys start..L-1 are visible
        keys, values = batch.cache.read(self.layer, batch.slots, batch.kv_length, batch.contiguous_from, start)  # [B, H_kv, L - start, D]
        gqa = self.num_heads != self.num_kv_heads  # each group of query heads shares one KV head
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=gqa)  # [B, H_q, T, D]
        return _proj(self.o_proj, out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))  # [B, T, H]


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.gemma = args.gemma_norms
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.norm_eps, args.gemma_norms)
        # Llama names its pre-MLP norm post_attention_layernorm; Gemma-3 uses that name for the norm of the
        # attention output and adds pre/post feedforward norms. Names follow the checkpoints.
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.norm_eps, args.gemma_norms)
        if self.gemma:
            self.pre_feedforward_layernorm = RMSNorm(args.hidden_size, args.norm_eps, gemma=True)
            self.post_feedforward_layernorm = RMSNorm(args.hidden_size, args.norm_eps, gemma=True)

    def norms(self) -> list[RMSNorm]:
        """Every RMSNorm of the layer (Gemma's four around attention and MLP and its q/k norms; Llama's two)."""
        norms = [self.input_layernorm, self.post_attention_layernorm]
        if self.gemma:
            norms += [self.pre_feedforward_layernorm, self.post_feedforward_layernorm]
        if self.self_attn.q_norm is not None:
            norms += [self.self_attn.q_norm, self.self_attn.k_norm]
        return norms

    def forward(self, x: Tensor, batch: "Batch") -> Tensor:
        if self.gemma:
            if batch.native and x.is_contiguous():  # residual + norm pairs in one C call each (x updated in place)
                post_attn, pre_ff = self.post_attention_layernorm, self.pre_feedforward_layernorm
                h = native.residual_norm(x, self.self_attn(self.input_layernorm(x), batch), post_attn._gemma_scale(),
                                         pre_ff._gemma_scale(), post_attn.eps)
                native.residual_norm(x, self.mlp(h), self.post_feedforward_layernorm._gemma_scale(), None, post_attn.eps)
                return x
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), batch))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class Batch:
    """What every attention layer of one forward call needs about the batch. RoPE tables and masks (the torch
    path's) are built on first use and shared by the layers that use the same RoPE / window."""

    def __init__(self, model: "CausalLM", cache: KVCache, slots: Tensor, positions: Tensor, kv_length: int,
                 contiguous_from: int | None, native_path: bool) -> None:
        self.model = model
        self.cache = cache
        self.slots = slots  # [B] int64
        self.positions = positions  # [B, T] int64, -1 = pad
        self.kv_length = kv_length  # keys 0..kv_length-1 are read (max position in the batch + 1)
        self.contiguous_from = contiguous_from  # first slot when slots are consecutive (read views, not copies)
        self.native = native_path  # the C attention path (specgate.models.native) serves this forward
        self.inv_freq = model.inv_freq
        if native_path:
            self.flat_positions = positions.reshape(-1).contiguous()  # [B T]
            self.flat_slots = slots[:, None].expand_as(positions).reshape(-1).contiguous()  # [B T]
        self._ropes: dict[str, tuple[Tensor, Tensor]] = {}
        self._masks: dict[int | None, tuple[Tensor, int]] = {}

    def rope(self, key: str) -> tuple[Tensor, Tensor]:
        """cos, sin [B, 1, T, D] for the RoPE parameters `key`."""
        if key not in self._ropes:
            self._ropes[key] = self.model._rope_table(self.positions, self.model.inv_freq[key], self.model.compute_dtype)
        return self._ropes[key]

    def mask(self, window: int | None) -> tuple[Tensor, int]:
        """(mask [B, 1, T, L - start] bool, start) for layers with this sliding window (None: full attention)."""
        if window not in self._masks:
            self._masks[window] = self.model._mask(self.positions, self.kv_length, window)
        return self._masks[window]


def last_token_index(valid: Tensor) -> Tensor:
    """valid [B, T] bool -> [B] int64: the index of each row's last real token (0 for a row with none)."""
    steps = torch.arange(valid.shape[1], device=valid.device)  # [T]
    return torch.where(valid, steps, -1).max(dim=1).values.clamp(min=0)


class LogitsBuffer:
    """One flat float32 block kept across forwards, viewed as each call's [B, T, V] logits (forward's out=): a
    verification step's logits are tens of MB, and a fresh block that size is page-faulted in at every step,
    memory already touched is not. Grows on demand; a view is valid until the next one is taken."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._block: Tensor | None = None

    def view(self, batch: int, width: int) -> Tensor:
        need = batch * width * self.vocab_size
        if self._block is None or self._block.numel() < need:
            self._block = torch.empty(need, dtype=torch.float32)
        return self._block[:need].view(batch, width, self.vocab_size)


class CausalLM(nn.Module):
    """A decoder-only LM with a position-indexed KV cache. See forward for the calling convention."""

    def __init__(self, args: ModelArgs, config: Any = None) -> None:
        super().__init__()
        self.args = args
        self.config = config  # the Hugging Face config it was built from (read-only)
        self.vocab_size = args.vocab_size
        self.max_position_embeddings = args.max_position_embeddings
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.norm_eps, args.gemma_norms)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.inv_freq = {key: rope_inv_freq(params, args.head_dim) for key, params in args.rope_parameters.items()}
        self._stack: tuple[list, native.DecodeStack | None] | None = None  # (checks, stack): native_stack()

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (of the embedding, the projections and the head); float32 for quantized weights
        (CausalLM.quantized), which compute in float32."""
        return self.embed_tokens.weight.dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """The activations', the KV cache's and the norms' dtype. bfloat16 weights on the CPU compute in float32
        (weight-only bf16, as llama.cpp runs a BF16 model): the bytes a decode step reads are halved, each weight
        is widened exactly in the product, and the arithmetic is float32 (more precise than bf16 activations, and
        on CPUs without bf16 instructions also faster). Elsewhere: the weights' dtype."""
        dtype = self.dtype
        return torch.float32 if dtype == torch.bfloat16 and self.device.type == "cpu" else dtype

    def fuse_projections(self) -> "CausalLM":
        """Make q/k/v and gate/up one product each (see FusedLinears): 3 matrix products per layer instead of 6.
        Called by the loader once the weights are in place; the parameters keep their names and values."""
        for block in self.layers:
            attn, mlp = block.self_attn, block.mlp
            fuse = QuantFusedLinears if isinstance(attn.q_proj, QuantLinear) else FusedLinears
            attn.fused = fuse([attn.q_proj, attn.k_proj, attn.v_proj])
            fuse = QuantFusedLinears if isinstance(mlp.gate_proj, QuantLinear) else FusedLinears
            mlp.fused = fuse([mlp.gate_proj, mlp.up_proj])
        return self

    @property
    def quantized(self) -> bool:
        """True where the matrices are block-quantized (QuantWeight: a GGUF's own blocks, or Q8_0 made on load)."""
        return isinstance(self.embed_tokens.weight, QuantWeight) or isinstance(self.lm_head.weight, QuantWeight)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def _stack_checks(self) -> list[tuple] | None:
        """What the C decoder stack relies on, as cheap checks: each parameter it reads (or derives from: Gemma's
        (1 + w) norm scales) is still the module's parameter, at the same storage and version, and each layer's
        window and attention scale are unchanged. None where a layer cannot take the stack (fusion off or broken,
        an activation not computed in C)."""
        if STACK_ACTIVATION.get(self.args.activation) is None or not native.available():
            return None
        checks = []
        for block in self.layers:
            attn, mlp = block.self_attn, block.mlp
            if attn.fused is None or mlp.fused is None or attn.fused.get() is None or mlp.fused.get() is None:
                return None
            checks.append((attn, attn.window, attn.scale))
            modules = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj, *block.norms())
            for module in modules:
                for name, param in module._parameters.items():
                    if param is not None:
                        checks.append((module._parameters, name, param, param.data_ptr(), param._version))
        return checks

    def _stack_still_valid(self, checks: list[tuple]) -> bool:
        """The checks of _stack_checks, in one tight loop (~0.1 ms for Gemma-3-270M; the per-forward price of the
        stack, against ~4 ms of per-layer dispatch it saves)."""
        grad = torch.is_grad_enabled()
        for check in checks:
            if len(check) == 3:
                attn, window, scale = check
                if attn.window != window or attn.scale != scale:
                    return False
                continue
            parameters, name, param, pointer, version = check
            if parameters.get(name) is not param or param.data_ptr() != pointer or param._version != version or (grad and param.requires_grad):
                return False
        return True

    def native_stack(self) -> "native.DecodeStack | None":
        """The whole decoder as one C call per decode / verification forward (native.DecodeStack), or None where it
        does not apply (see _stack_checks); built on first use and rebuilt when the weights it reads change."""
        if self._stack is not None and self._stack_still_valid(self._stack[0]):
            return self._stack[1]
        try:
            checks = self._stack_checks()
        except RuntimeError:  # inference tensors carry no version counter: use the per-layer path
            return None
        if checks is None:
            self._stack = None
            return None
        self._stack = (checks, self._build_stack())
        return self._stack[1]

    def _build_stack(self) -> "native.DecodeStack | None":
        a = self.args
        layers = []
        for block in self.layers:
            attn, mlp = block.self_attn, block.mlp
            (qkv, qkv_bias), (gate_up, gate_up_bias) = attn.fused.get(), mlp.fused.get()
            scale = (lambda norm: norm._gemma_scale()) if a.gemma_norms else (lambda norm: norm.weight)
            layers.append(native.StackLayer(
                qkv=qkv, qkv_bias=qkv_bias, o=attn.o_proj.weight, o_bias=attn.o_proj.bias, gate_up=gate_up,
                gate_up_bias=gate_up_bias, down=mlp.down_proj.weight, down_bias=mlp.down_proj.bias,
                norm_in=scale(block.input_layernorm), norm_attn=scale(block.post_attention_layernorm),
                norm_pre_ff=scale(block.pre_feedforward_layernorm) if a.gemma_norms else None,
                norm_post_ff=scale(block.post_feedforward_layernorm) if a.gemma_norms else None,
                q_norm=attn.q_norm._gemma_scale() if attn.q_norm is not None else None,
                k_norm=attn.k_norm._gemma_scale() if attn.k_norm is not None else None,
                inv_freq=self.inv_freq[attn.rope_key], window=attn.window, scale=attn.scale,
            ))
        try:
            return native.DecodeStack(layers, heads=a.num_heads, kv_heads=a.num_kv_heads, head_dim=a.head_dim,
                                      eps=a.norm_eps, gemma=a.gemma_norms,
                                      activation=STACK_ACTIVATION[a.activation])
        except ValueError:  # a shape, dtype or layout the C stack does not take: the per-layer path serves
            return None

    def new_cache(self, num_slots: int, max_seq_len: int) -> KVCache:
        """A zeroed cache of num_slots sequences of up to max_seq_len positions (<= max_position_embeddings)."""
        if max_seq_len > self.max_position_embeddings:
            raise ValueError(
                f"max_seq_len={max_seq_len} exceeds the model's max_position_embeddings={self.max_position_embeddings}: "
                "use a shorter prompt or fewer new tokens"
            )
        a = self.args
        return KVCache(a.num_layers, num_slots, a.num_kv_heads, max_seq_len, a.head_dim, dtype=self.compute_dtype, device=self.device)

    @staticmethod
    def _rope_table(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [B, 1, T, D], computed in float32 and cast like the reference does."""
        freqs = positions.clamp(min=0)[..., None].float() * inv_freq.to(positions.device)  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def _mask(positions: Tensor, kv_length: int, window: int | None) -> tuple[Tensor, int]:
        """(mask [B, 1, T, L - start] bool, start). Key j is visible to a query at p iff j <= p (and j > p - w). A
        sliding layer reads only keys from start = (lowest query position) - w + 1 on: past the window the older
        keys are neither read nor scored."""
        query = positions[:, None, :, None]  # [B, 1, T, 1]
        pad = query < 0  # [B, 1, T, 1]: pad queries look at the first key so no row is all -inf (NaN); output discarded
        lowest = int(torch.where(positions >= 0, positions, kv_length).min()) if positions.numel() else 0
        start = 0 if window is None else max(0, min(lowest, kv_length - 1) - window + 1)
        key = torch.arange(start, kv_length, device=positions.device)  # [L - start]
        mask = key <= query  # [B, 1, T, L - start]
        if window is not None:
            mask = mask & (key > query - window)
        return mask | (pad & (key == start)), start

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        cache: KVCache,
        slots: Tensor,
        *,
        last_only: bool = False,
        return_hidden: bool = False,
        logits: bool = True,
        out: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor] | None:
        """Score a (ragged) batch and write its K/V into the cache.

        input_ids [B, T] int64; positions [B, T] int64 absolute positions, -1 = padding (not written, not
        attended, its logits are garbage); slots [B] int64 distinct cache rows. Each row's non-pad positions
        must be distinct, and every position below a query's own must already be in its slot (written by an
        earlier call or by this one). Returns logits [B, T, V] float32, or [B, V] with last_only (each row's
        last non-pad token); with return_hidden, (logits, hidden) with the final-norm hidden state [B, T, H]
        (or [B, H] with last_only). With logits=False the call only writes the K/V (a prefill chunk whose logits
        nobody samples: the final norm and the LM head, 168M of Gemma-3-270M's 268M weights, are skipped) and
        returns None, or with return_hidden the final-norm hidden state [B, T, H] alone (the LM head skipped: an
        EAGLE head's prompt features). out: a contiguous float32 tensor of the logits' shape to write them into, returned (a caller's
        reusable buffer: a verification step's logits are tens of MB, and a fresh block that size is page-faulted
        in at every step, ~0.23 ms per MB against ~0.06 ms for memory already touched).
        """
        if input_ids.dim() != 2 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must both be [B, T]"
            )
        if slots.shape != (input_ids.shape[0],):
            raise ValueError(f"slots {tuple(slots.shape)} must be [B] = [{input_ids.shape[0]}], one cache row per batch row")
        cache.check(positions, slots)
        valid = positions >= 0  # [B, T]
        input_ids = torch.where(valid, input_ids, 0)  # pad ids may be anything (e.g. -1)
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.vocab_size):
            bad = int(input_ids.min()) if int(input_ids.min()) < 0 else int(input_ids.max())
            raise ValueError(f"token id {bad} is out of range 0..{self.vocab_size - 1} (the model's vocabulary)")
        slot_list = slots.tolist()
        if len(set(slot_list)) != len(slot_list):
            raise ValueError(f"slots {slot_list} repeat a cache row: each batch row needs its own slot")
        contiguous = slot_list == list(range(slot_list[0], slot_list[0] + len(slot_list))) if slot_list else False
        kv_length = max(int(positions.max()) + 1, 1) if positions.numel() else 1
        rows = positions.numel()
        real_rows = int(valid.sum())
        compute_dtype = self.compute_dtype
        c_paths = (  # decode / verification rows with float32 activations in inference: the C paths
            compute_dtype == torch.float32
            and self.args.hidden_size % 8 == 0  # residual_norm works on 8-float lanes
            and _inference(self.embed_tokens.weight)
        )
        # the whole stack in one C call runs only the real tokens (padding costs nothing), so its limit counts those
        limit = native.layer_max_rows(self.dtype, self.quantized)  # bf16 / quantized: up to 160 rows (every 16-request verification)
        if c_paths and real_rows > limit and input_ids.shape[0] <= limit and self._chunks_long_forwards():
            return self._chunked_forward(input_ids, positions, cache, slots, limit, last_only, return_hidden, logits, out)
        stack = self.native_stack() if c_paths and native.attention_applies(real_rows, self.args.head_dim, cache.keys[0], limit) else None
        native_path = stack is None and c_paths and native.attention_applies(rows, self.args.head_dim, cache.keys[0], limit)
        batch = Batch(self, cache, slots, positions, kv_length, slot_list[0] if contiguous else None, native_path)

        x = self.embed_tokens(input_ids).to(compute_dtype)  # [B, T, H]; bf16 rows widen exactly
        if self.args.embed_scale is not None:  # Gemma: the scale is rounded to the weights' dtype first, as transformers does
            x = x * torch.tensor(self.args.embed_scale, dtype=self.dtype).to(compute_dtype)
        if out is not None:
            expected = (input_ids.shape[0], self.vocab_size) if last_only else (*input_ids.shape, self.vocab_size)
            if tuple(out.shape) != expected or out.dtype != torch.float32 or not out.is_contiguous():
                raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be a contiguous float32 tensor of the logits' shape {expected}")
        if stack is not None and x.is_contiguous():
            return self._stack_forward(stack, x, valid, positions, slots, cache, real_rows, last_only, return_hidden, logits, out)
        for block in self.layers:
            x = block(x, batch)
        if not logits:
            return self.norm(x) if return_hidden else None
        hidden = self.norm(x)  # [B, T, H]

        if last_only:
            hidden = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_token_index(valid)]  # [B, H]
        scores = self._head(hidden)  # [B, T, V] or [B, V]
        if out is not None:
            scores = out.copy_(scores)
        return (scores, hidden) if return_hidden else scores

    def _chunks_long_forwards(self) -> bool:
        """Whether a forward of more real tokens than the C paths take (a prefill) runs as consecutive column chunks
        through them: for quantized weights, whose alternative dequantizes every weight per call and multiplies in
        float32 (Gemma-3-270M Q4_K_M, 2 threads: ~0.8 ms a token through the stack in chunks of 160 against
        ~2.0-2.4 through the upcast, bench/bench_prefill.py). A chunked prefill also writes the K/V each token would
        get from a decode step, since the stack is batch-invariant."""
        return self.quantized and self.native_stack() is not None

    def _chunked_forward(self, input_ids: Tensor, positions: Tensor, cache: KVCache, slots: Tensor, limit: int,
                         last_only: bool, return_hidden: bool, logits: bool,
                         out: Tensor | None) -> Tensor | tuple[Tensor, Tensor] | None:
        """forward() as consecutive column chunks of at most `limit` tokens (limit // B columns each), each chunk's K/V
        written before the next attends to it; the logits, hidden states or last-token scores put back together as
        one call returns them."""
        B, T = input_ids.shape
        width = max(1, limit // B)
        wants_hidden = return_hidden or (logits and last_only)  # last_only scores the last real token's state
        hidden_parts: list[Tensor] = []
        logit_parts: list[Tensor] = []
        for start in range(0, T, width):
            part = self.forward(input_ids[:, start : start + width], positions[:, start : start + width], cache, slots,
                                return_hidden=wants_hidden, logits=logits and not last_only)
            if logits and not last_only:
                scores, hidden = part if wants_hidden else (part, None)
                logit_parts.append(scores)
            else:
                hidden = part
            if hidden is not None:
                hidden_parts.append(hidden)
        hidden = torch.cat(hidden_parts, dim=1) if hidden_parts else None  # [B, T, H]
        if not logits:
            return hidden if return_hidden else None
        if last_only:
            valid = positions >= 0
            picked = hidden[torch.arange(B), last_token_index(valid)]  # [B, H]; a row of padding only has zeros there
            scores = self._head(picked)  # [B, V]
            hidden = picked
        else:
            scores = torch.cat(logit_parts, dim=1)  # [B, T, V]
        if out is not None:
            scores = out.copy_(scores)
        return (scores, hidden) if return_hidden else scores

    def _head(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] (after the final norm) -> logits [..., V] float32 (soft-capped where the model says)."""
        logits = linear(hidden, self.lm_head.weight, self.lm_head.bias).float()
        if self.args.final_logit_softcapping is not None:
            cap = self.args.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _stack_forward(self, stack: "native.DecodeStack", x: Tensor, valid: Tensor, positions: Tensor, slots: Tensor,
                       cache: KVCache, real_rows: int, last_only: bool, return_hidden: bool,
                       logits: bool = True, out: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor] | None:
        """forward() through the C stack, on the real tokens only: a ragged batch's padding (a verification row with
        fewer drafts than the widest, a shorter prompt chunk) is neither run through the layers nor scored by the
        head, the way a flat ragged batch (vLLM's) costs its real tokens alone. Padding positions get zero logits
        and hidden states. x [B, T, H] contiguous float32."""
        B, T, H = x.shape
        flat = x.view(B * T, H)
        flat_valid = valid.reshape(-1)  # [B T]
        flat_positions = positions.reshape(-1)
        flat_slots = slots[:, None].expand(B, T).reshape(-1)
        if real_rows < B * T:
            keep = flat_valid.nonzero().squeeze(1)  # [R]: the real tokens, in row-major order
            packed = flat.index_select(0, keep)  # [R, H]
            stack.run(packed, flat_positions[keep].contiguous(), flat_slots[keep].contiguous(), cache.keys, cache.values)
        else:
            keep, packed = None, flat
            stack.run(flat, flat_positions.contiguous(), flat_slots.contiguous(), cache.keys, cache.values)
        if not logits:
            return self._unpack(self.norm(packed), keep, B, T) if return_hidden else None
        hidden = self.norm(packed)  # [R, H]
        if last_only:
            picked = torch.arange(B, device=positions.device) * T + last_token_index(valid)  # [B] flat index of each row's last token
            if keep is not None:  # its index among the real tokens (a row with none picks its first, zeroed below)
                picked = (torch.cumsum(flat_valid, 0) - 1).clamp(min=0)[picked]
            out_hidden = hidden.index_select(0, picked)  # [B, H]
            if keep is not None and not bool(valid.any(dim=1).all()):
                out_hidden[~valid.any(dim=1)] = 0.0
            scores = self._head(out_hidden)  # [B, V]
            if out is not None:
                scores = out.copy_(scores)
            return (scores, out_hidden) if return_hidden else scores
        weight = self.lm_head.weight
        plain_head = self.lm_head.bias is None and self.args.final_logit_softcapping is None and native.applies(hidden, weight)
        logits = out.view(B * T, -1) if out is not None else torch.empty(B * T, weight.shape[0], dtype=torch.float32)  # [B T, V]
        if keep is None:
            if plain_head:
                native.skinny_product(hidden, weight, out=logits)
            else:
                logits.copy_(self._head(hidden))
            return (logits.view(B, T, -1), hidden.view(B, T, H)) if return_hidden else logits.view(B, T, -1)
        if plain_head:  # each real token's logits written straight into its padded place
            native.skinny_product(hidden, weight, out=logits, out_rows=keep)
        else:
            logits.index_copy_(0, keep, self._head(hidden))
        counts = valid.sum(dim=1)  # [B]
        grid = logits.view(B, T, -1)
        if bool((valid == (torch.arange(T)[None, :] < counts[:, None])).all()):  # padding is each row's tail
            for row, count in enumerate(counts.tolist()):
                if count < T:
                    grid[row, count:].zero_()
        else:
            logits[~flat_valid] = 0.0
        if return_hidden:
            return logits.view(B, T, -1), self._unpack(hidden, keep, B, T)
        return logits.view(B, T, -1)

    @staticmethod
    def _unpack(hidden: Tensor, keep: Tensor | None, B: int, T: int) -> Tensor:
        """The real tokens' hidden states [R, H] back in their padded places [B, T, H] (zeros at the pads)."""
        if keep is None:
            return hidden.view(B, T, -1)
        full = torch.zeros(B * T, hidden.shape[-1], dtype=hidden.dtype)
        full.index_copy_(0, keep, hidden)
        return full.view(B, T, -1)
