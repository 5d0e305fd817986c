"""An EAGLE-style draft head on the target's own features (EAGLE / EAGLE-3 / HASS, for Gemma-3).

At draft position t the head reads the target's feature at t - 1 (its hidden state there, the state that
predicted token t) and the target's embedding of token t, mixes them with one Linear, runs ONE decoder layer of
the target's own shape (a specgate.models.transformer.Block: Gemma-3 norms, 4 q heads / 1 KV head / head_dim
256, q/k norms, RoPE, GeGLU), and reads its output feature through the target's final norm and the target's
embedding rows of a reduced vocabulary (the `d2t` map, frozen: the head's LM head is the target's head cut to
those rows). For the next draft position it feeds its OWN output feature back in place of the target's, with
the token it just drafted: that is why the output lives in the target's residual space.

    feature_in  = the target's feature (concat of the `feature_layers` states, normed, projected) or own output
    x           = fc([norm(embed(token_t)); norm(feature_in)])               # [.., 2H] -> [.., H]
    out         = Block(x)                                                  # the head's feature (residual space)
    draft_logits = final_norm(out) @ rows.T                                 # [.., V_d], rows = embed[d2t]

Target features: `target_features(model, ids, layers)` runs the runtime's own layers (read-only) and returns the
residual after any layers (0-based) and the final-norm hidden state (FEATURE_FINAL_NORM = -1), which is also what
`CausalLM.forward(..., return_hidden=True)` returns today.

Index convention (training and evaluation, one window of T tokens x_0..x_{T-1} with target features h_0..):
head index j reads (h_j, x_{j+1}) at position j (the feature's: the head's cache row j holds that pair,
so a cache row is never left empty below a query) and predicts x_{j+2} (target distribution at j + 1).
Unrolled step s (s = 0 is the plain EAGLE step; s >= 1 is training-time test, EAGLE-3/HASS) at index j reads
the head's own step s - 1 output at j - 1 instead of h_j, and attends exactly as it would at draft position
s + 1 of a chain started at j - s: to step-0 keys at indices <= j - s and to the chain's own keys of steps
1..s at indices j - s + 1..j. `unrolled` computes that in parallel; `step` is the cached one-position path used at
draft time, and the tests check the two agree.

Shipping: `save_head(head, dir, metadata)` writes the trainable weights (bf16), the d2t map, eagle_config.json (the
config, a fingerprint of the target the head was attached to and of the map) and a model card; `load_head(dir,
target)` attaches it to a target and refuses another model, naming the mismatch. Drafting with it (`--draft
eagle:<dir>`): specgate.drafting.eagle_drafter. A quantized target (--dtype gguf, the default for the GGUF target,
or int8) serves as it is: the head reads its embedding through exact dequantization (embedding_rows).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specgate.models import native
from specgate.models.kv_cache import KVCache
from specgate.models.quant import QuantWeight, quantize_q8_0
from specgate.models.transformer import STACK_ACTIVATION, Batch, Block, CausalLM, ModelArgs, RMSNorm, apply_rope, rope_inv_freq

FEATURE_FINAL_NORM = -1  # in feature_layers: the target's final-norm hidden state (what forward(return_hidden) gives)


# --- the target's features --------------------------------------------------------------------------------------


@torch.no_grad()  # not inference_mode: training reuses the result, and inference tensors cannot be saved for backward
def target_features(model: CausalLM, input_ids: Tensor, layers: Sequence[int]) -> Tensor:
    """The target's hidden states at every position of input_ids [B, T] (each row a sequence from position 0).

    layers: 0-based layer indices (the residual stream after that layer, before the final norm) or
    FEATURE_FINAL_NORM (-1: after the final norm). Returns [B, T, len(layers), H] float32. Runs the model's own
    embedding and blocks through the per-layer torch path with a throwaway cache; the model is not modified.
    """
    bad = [layer for layer in layers if layer != FEATURE_FINAL_NORM and not 0 <= layer < model.args.num_layers]
    if bad or not layers:
        raise ValueError(f"layers {list(layers)}: use 0..{model.args.num_layers - 1} or {FEATURE_FINAL_NORM} (final norm)")
    B, T = input_ids.shape
    cache = model.new_cache(B, T)
    positions = torch.arange(T, dtype=torch.int64)[None].expand(B, T)  # [B, T]
    slots = torch.arange(B, dtype=torch.int64)  # [B]
    batch = Batch(model, cache, slots, positions, T, 0, False)
    x = model.embed_tokens(input_ids).to(model.compute_dtype)  # [B, T, H]
    if model.args.embed_scale is not None:
        x = x * torch.tensor(model.args.embed_scale, dtype=model.dtype).to(model.compute_dtype)
    wanted = {layer: index for index, layer in enumerate(layers)}
    out = torch.empty(B, T, len(layers), model.args.hidden_size)  # [B, T, L, H]
    for number, block in enumerate(model.layers):
        x = block(x, batch)
        if number in wanted:
            out[:, :, wanted[number]] = x.float()
    if FEATURE_FINAL_NORM in wanted:
        out[:, :, wanted[FEATURE_FINAL_NORM]] = model.norm(x).float()
    return out


# --- the head ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EagleConfig:
    """The head's shape. Defaults to the target's layer shape (Gemma-3-270M: 640 / 2048 / 4 x 256 / 1 KV head)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    attn_scale: float
    activation: str
    embed_scale: float
    draft_vocab_size: int
    feature_layers: tuple[int, ...] = (FEATURE_FINAL_NORM,)
    rope_theta: float = 10_000.0
    max_position_embeddings: int = 32_768
    # a sampled request's draft divides the head's logits by this before its own temperature applies: training
    # matches q to p by forward KL, which leaves q broader than the overlap sum_x min(p, q) (the acceptance rate at
    # temperature 1) wants; fitted after training on held-out text (sampled_acceptance, `eagle_train calibrate`).
    # Exact for any value > 0: verification divides by the q the draft was drawn from. Greedy drafts ignore it.
    sample_temperature: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.sample_temperature) and self.sample_temperature > 0):
            raise ValueError(f"sample_temperature={self.sample_temperature}: use a finite value > 0 (1: the head's q as trained)")

    @staticmethod
    def for_target(args: ModelArgs, draft_vocab_size: int, feature_layers: Sequence[int], intermediate_size: int | None = None) -> "EagleConfig":
        if not args.gemma_norms:
            raise ValueError(f"model_type '{args.model_type}': the EAGLE head is built for Gemma-3 targets (gemma3_text)")
        return EagleConfig(
            hidden_size=args.hidden_size, intermediate_size=intermediate_size or args.intermediate_size,
            num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, norm_eps=args.norm_eps,
            attn_scale=args.attn_scale, activation=args.activation, embed_scale=float(args.embed_scale or 1.0),
            draft_vocab_size=draft_vocab_size, feature_layers=tuple(int(layer) for layer in feature_layers),
            max_position_embeddings=args.max_position_embeddings,
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "feature_layers": list(self.feature_layers)}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "EagleConfig":
        return EagleConfig(**{**data, "feature_layers": tuple(data["feature_layers"])})

    def layer_args(self) -> ModelArgs:
        """ModelArgs of a one-layer Gemma-3 (full attention, RoPE base rope_theta) for the head's Block."""
        return ModelArgs(
            model_type="gemma3_text", vocab_size=self.draft_vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=1, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, max_position_embeddings=self.max_position_embeddings,
            norm_eps=self.norm_eps, activation=self.activation, attn_scale=self.attn_scale, layer_windows=(None,),
            layer_rope=("all",), rope_parameters={"all": {"rope_type": "default", "rope_theta": self.rope_theta}},
            gemma_norms=True, embed_scale=self.embed_scale,
        )


class _HeadRuntime:
    """What transformer.Batch reads from a model, for the head's one Block (rope tables, masks, dtype)."""

    _rope_table = staticmethod(CausalLM._rope_table)
    _mask = staticmethod(CausalLM._mask)

    def __init__(self, inv_freq: dict[str, Tensor], compute_dtype: torch.dtype) -> None:
        self.inv_freq, self.compute_dtype = inv_freq, compute_dtype


def embedding_rows(table: Tensor | QuantWeight, token_ids: Tensor) -> Tensor:
    """Rows token_ids [..] of a target's embedding table [V_t, H] -> [.., H] float32 (unscaled). A quantized table
    (QuantWeight: --dtype gguf / int8) is dequantized in C exactly as ggml does, the rows read only, as the target's
    own QuantEmbedding reads them; a float / bf16 table is indexed (bf16 widens exactly)."""
    if isinstance(table, QuantWeight):
        flat = token_ids.reshape(-1).contiguous()
        return native.dequantize_rows(table, flat).view(*token_ids.shape, table.in_features)
    return F.embedding(token_ids, table).float()


class EagleHead(nn.Module):
    """The draft head. Trainable: feature norms/projection, embed/feature norms, fc, the Block. Frozen, not in
    state_dict, taken from the target by `attach_target`: the embedding table (by reference; a QuantWeight for a
    quantized target), and the buffers final norm scale and rows (float32)."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        H, n = config.hidden_size, len(config.feature_layers)
        # Gemma's residual stream runs to norms in the hundreds while its final-norm state is O(1): each target
        # feature is normed before it is mixed, so low, middle and high layers enter on one scale
        self.feature_norms = nn.ModuleList(RMSNorm(H, config.norm_eps, gemma=True) for _ in range(n))
        self.feature_proj = nn.Linear(n * H, H, bias=False) if n > 1 else None
        self.embed_norm = RMSNorm(H, config.norm_eps, gemma=True)
        self.input_norm = RMSNorm(H, config.norm_eps, gemma=True)  # of the feature entering fc (target's or own)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layer = Block(config.layer_args(), 0)
        self.final_norm = RMSNorm(H, config.norm_eps, gemma=True)
        self.final_norm.weight.requires_grad_(False)
        # [V_t, H] the target's table, shared: a plain attribute, not a buffer, since a quantized target's is a QuantWeight
        self.embed: Tensor | QuantWeight = torch.zeros(0, H)
        self.register_buffer("rows", torch.zeros(config.draft_vocab_size, H), persistent=False)  # [V_d, H] frozen
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64), persistent=False)  # [V_d]
        self.inv_freq = {"all": rope_inv_freq({"rope_type": "default", "rope_theta": config.rope_theta}, config.head_dim)}

    def attach_target(self, target: CausalLM, d2t: Tensor) -> "EagleHead":
        """Take the frozen parts from the target: its embedding (by reference), final norm and the rows d2t. A
        quantized target (QuantWeight table: --dtype gguf / int8) works as is: its d2t rows are dequantized once,
        exactly, to float32 (12,288 x 640 floats, 31 MB, for Gemma-3-270M), and token lookups dequantize the rows
        they read, so the head sees the values the target computes with."""
        if d2t.shape != (self.config.draft_vocab_size,):
            raise ValueError(f"d2t {tuple(d2t.shape)} must be [{self.config.draft_vocab_size}] (one target id per draft output)")
        weight = target.embed_tokens.weight
        self.embed = weight if isinstance(weight, QuantWeight) else weight.detach()
        self.d2t = d2t.to(torch.int64).clone()
        self.rows = embedding_rows(self.embed, self.d2t).clone()  # [V_d, H] tied head: the embedding's rows
        with torch.no_grad():
            self.final_norm.weight.copy_(target.norm.weight.float())
        return self

    def init_layer_from(self, target: CausalLM, layer: int) -> "EagleHead":
        """Start the head's Block from one of the target's layers (same shapes; the MLP cut if narrower)."""
        source = {name: tensor.float() for name, tensor in target.layers[layer].state_dict().items()}
        if self.config.intermediate_size != target.args.intermediate_size:
            keep = slice(0, self.config.intermediate_size)
            source["mlp.gate_proj.weight"] = source["mlp.gate_proj.weight"][keep]
            source["mlp.up_proj.weight"] = source["mlp.up_proj.weight"][keep]
            source["mlp.down_proj.weight"] = source["mlp.down_proj.weight"][:, keep]
        self.layer.load_state_dict(source)
        return self

    # -- pieces --------------------------------------------------------------------------------------------------

    def embed_tokens(self, token_ids: Tensor) -> Tensor:
        """token_ids [..] target ids -> [.., H] float32: the target's embedding, scaled as the target scales it."""
        scale = torch.tensor(self.config.embed_scale, dtype=self.embed.dtype).float()  # QuantWeight.dtype: float32
        return embedding_rows(self.embed, token_ids) * scale

    def project_target(self, features: Tensor) -> Tensor:
        """The target's features [.., n, H] (feature_layers) -> the head's feature input [.., H]."""
        normed = [norm(features[..., i, :].float()) for i, norm in enumerate(self.feature_norms)]
        return self.feature_proj(torch.cat(normed, -1)) if self.feature_proj is not None else normed[0]

    def mix(self, token_ids: Tensor, feature: Tensor) -> Tensor:
        """[.., H]: fc of the normed token embedding and the normed feature (the target's projected, or own)."""
        return self.fc(torch.cat([self.embed_norm(self.embed_tokens(token_ids)), self.input_norm(feature)], -1))

    def logits(self, out: Tensor) -> Tensor:
        """The head's output feature [.., H] -> draft logits [.., V_d] (the target's final norm and rows)."""
        return self.final_norm(out) @ self.rows.T

    # -- training / evaluation: the unrolled, parallel form ------------------------------------------------------

    def unrolled(self, token_ids: Tensor, features: Tensor, steps: int) -> list[tuple[Tensor, Tensor]]:
        """Steps 0..steps-1 over whole windows, in parallel (see the module docstring for the attention pattern).

        token_ids [B, T] target ids x_1..x_T of the head's indices (the token AFTER each feature's position);
        features [B, T, n, H] the target's features h_0..h_{T-1}. Returns per step (logits [B, T, V_d], out
        [B, T, H]); at step s the first s indices have no chain (they belong to chains starting before 0).
        """
        B, T = token_ids.shape
        attn, block = self.layer.self_attn, self.layer
        positions = torch.arange(T)[None].expand(B, T)  # [B, T] the features' positions
        cos, sin = CausalLM._rope_table(positions, self.inv_freq["all"], torch.float32)  # [B, 1, T, D]
        embedded = self.embed_norm(self.embed_tokens(token_ids))  # [B, T, H] the same at every step
        feature = self.project_target(features)  # [B, T, H]
        keys, values, results = [], [], []
        for step in range(steps):
            x = self.fc(torch.cat([embedded, self.input_norm(feature)], -1))  # [B, T, H]
            h = block.input_layernorm(x)
            q = attn.q_proj(h).view(B, T, attn.num_heads, attn.head_dim)
            k = attn.k_proj(h).view(B, T, attn.num_kv_heads, attn.head_dim)
            v = attn.v_proj(h).view(B, T, attn.num_kv_heads, attn.head_dim).transpose(1, 2)  # [B, H_kv, T, D]
            q, k = attn.q_norm(q).transpose(1, 2), attn.k_norm(k).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # [B, H_q, T, D], [B, H_kv, T, D]
            keys.append(k)
            values.append(v)
            mask = unrolled_mask(T, step)  # [T, (step + 1) T]
            att = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask,
                                                 scale=attn.scale, enable_gqa=attn.num_heads != attn.num_kv_heads)
            x = x + block.post_attention_layernorm(attn.o_proj(att.transpose(1, 2).reshape(B, T, -1)))
            out = x + block.post_feedforward_layernorm(block.mlp(block.pre_feedforward_layernorm(x)))  # [B, T, H]
            results.append((self.logits(out), out))
            feature = F.pad(out[:, :-1], (0, 0, 1, 0))  # index j reads own output at j - 1 (index 0: no chain)
        return results

    # -- drafting: one position at a time through a position-indexed cache ---------------------------------------

    def new_cache(self, num_slots: int, max_seq_len: int) -> KVCache:
        c = self.config
        return KVCache(1, num_slots, c.num_kv_heads, max_seq_len, c.head_dim)

    @torch.inference_mode()
    def step(self, token_ids: Tensor, feature: Tensor, positions: Tensor, cache: KVCache, slots: Tensor) -> tuple[Tensor, Tensor]:
        """Run the head on token_ids [B, T] (target ids) with features [B, T, H] (head space: project_target of the
        target's, or the head's own output) at positions [B, T] (-1 = pad) of cache slots [B]; writes the head's
        K/V there. Returns (logits [B, T, V_d], out [B, T, H]). Rejected drafts need no undo: the next write at
        a position overwrites it."""
        cache.check(positions, slots)
        x = self.mix(torch.where(positions >= 0, token_ids, 0), feature)  # [B, T, H]
        kv_length = max(int(positions.max()) + 1, 1)
        batch = Batch(_HeadRuntime(self.inv_freq, torch.float32), cache, slots, positions, kv_length, None, False)
        out = self.layer(x, batch)
        return self.logits(out), out

    @torch.inference_mode()
    def draft_greedy(self, token_id: int, feature: Tensor, position: int, cache: KVCache, slot: int, gamma: int,
                     step: Any = None) -> Tensor:
        """A greedy chain of gamma draft tokens (target ids [gamma]) after token_id, the token that follows the
        target's state at `position` (feature: that state in head space [H]). The cache must already hold the
        head's K/V of every earlier position of the slot. step: the step to run (default: this head's torch
        `step`; drafting_step(head) for the drafters' own)."""
        slots = torch.tensor([slot])
        step = step or self.step
        tokens = []
        for offset in range(gamma):
            logits, out = step(torch.tensor([[token_id]]), feature.view(1, 1, -1), torch.tensor([[position + offset]]), cache, slots)
            token_id = int(self.d2t[logits[0, -1].argmax()])
            tokens.append(token_id)
            feature = out[0, -1]
        return torch.tensor(tokens, dtype=torch.int64)

    def size_bytes(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of the trainable weights that ship (the frozen rows/embedding/final norm come from the target)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad) * torch.finfo(dtype).bits // 8


class NativeHead:
    """The head's drafting step in specgate's C kernels, as a target's decode step runs: fc and the reduced LM head
    through native.skinny_product, the Block through a one-layer native.DecodeStack over the head's own cache.
    Where int8 activations are on (AVX-512 VNNI) the head's matrices are quantized to Q8_0 on load (ggml's rounding)
    and read by the int8 kernels: ~15 MB a step instead of ~60 MB of float32, so a draft token costs a fraction of
    a target step. Quantizing the DRAFT changes which tokens it proposes, never what the output follows: the
    verifier accepts against the q actually sampled (tests/test_eagle_drafting.py compares it with `step`)."""

    def __init__(self, head: "EagleHead") -> None:
        c, block = head.config, head.layer
        attn, mlp = block.self_attn, block.mlp
        if attn.q_proj.bias is not None or mlp.gate_proj.bias is not None or STACK_ACTIVATION.get(c.activation) is None:
            raise ValueError("the native head path takes the Gemma-3 layer shape (no biases, GeGLU)")
        self.quantized = native.int8_activations()

        def weight(t: Tensor) -> Tensor | QuantWeight:  # [N, K]
            t = t.detach().float().contiguous()
            return native.for_kernels(quantize_q8_0(t)) if self.quantized else t

        with torch.no_grad():
            qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])  # [(H_q + 2 H_kv) D, H]
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])  # [2 I, H]
            scale = {name: (1.0 + norm.weight.detach().float()).contiguous() for name, norm in (
                ("in", block.input_layernorm), ("attn", block.post_attention_layernorm), ("pre", block.pre_feedforward_layernorm),
                ("post", block.post_feedforward_layernorm), ("q", attn.q_norm), ("k", attn.k_norm))}
            layer = native.StackLayer(
                qkv=weight(qkv), qkv_bias=None, o=weight(attn.o_proj.weight), o_bias=None, gate_up=weight(gate_up),
                gate_up_bias=None, down=weight(mlp.down_proj.weight), down_bias=None, norm_in=scale["in"],
                norm_attn=scale["attn"], norm_pre_ff=scale["pre"], norm_post_ff=scale["post"], q_norm=scale["q"],
                k_norm=scale["k"], inv_freq=head.inv_freq["all"].float().contiguous(), window=None, scale=float(attn.scale))
            self.stack = native.DecodeStack([layer], heads=c.num_heads, kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                                            eps=c.norm_eps, gemma=True, activation=STACK_ACTIVATION[c.activation])
            self.fc = weight(head.fc.weight)  # [H, 2H]
            self.rows = weight(head.rows)  # [V_d, H]
        self.head = head

    @torch.inference_mode()
    def step(self, token_ids: Tensor, feature: Tensor, positions: Tensor, cache: KVCache, slots: Tensor) -> tuple[Tensor, Tensor]:
        """EagleHead.step's contract (token_ids, positions [B, T], feature [B, T, H], slots [B]; -1 = pad) -> (logits
        [B, T, V_d], out [B, T, H]), pads' rows zero; only the real rows run."""
        cache.check(positions, slots)
        head = self.head
        B, T = token_ids.shape
        flat_positions = positions.reshape(-1)
        keep = (flat_positions >= 0).nonzero().squeeze(1)  # [R]
        ids = token_ids.reshape(-1).index_select(0, keep)
        mixed = torch.cat([head.embed_norm(head.embed_tokens(ids)),
                           head.input_norm(feature.reshape(B * T, -1).index_select(0, keep).float())], -1).contiguous()  # [R, 2H]
        x = native.skinny_product(mixed, self.fc)  # [R, H]
        row_slots = slots.to(torch.int64)[:, None].expand(B, T).reshape(-1).index_select(0, keep).contiguous()
        self.stack.run(x, flat_positions.index_select(0, keep).contiguous(), row_slots, cache.keys, cache.values)
        scores = native.skinny_product(head.final_norm(x).contiguous(), self.rows)  # [R, V_d]
        if keep.numel() == B * T:
            return scores.view(B, T, -1), x.view(B, T, -1)
        logits = torch.zeros(B * T, scores.shape[1])
        out = torch.zeros(B * T, x.shape[1])
        logits[keep], out[keep] = scores, x
        return logits.view(B, T, -1), out.view(B, T, -1)


def drafting_step(head: "EagleHead"):
    """The step drafting calls: NativeHead's where the C kernels run, else the head's own torch `step`."""
    if not native.available():
        return head.step
    built = getattr(head, "_native_head", None)  # built once per head: every request's proposer shares it
    if built is None:
        try:
            built = NativeHead(head)
        except ValueError:
            return head.step
        head._native_head = built
    return built.step


def unrolled_mask(length: int, step: int) -> Tensor:
    """[T, (step + 1) T] bool: which keys (step r, index m) a step-`step` query at index j sees. Step-0 keys at
    m <= j - step (the target-fed context of the chain's start); step-r keys (1 <= r <= step) only at
    m = j - step + r (the chain's own earlier draft positions, and itself)."""
    j = torch.arange(length)[:, None]  # [T, 1]
    m = torch.arange(length)[None, :]  # [1, T]
    blocks = [m <= j - step] + [m == j - step + r for r in range(1, step + 1)]
    mask = torch.cat(blocks, 1)
    mask[:step, 0] = True  # indices without a chain see one key (no all -inf row); their outputs are ignored
    return mask


# --- losses and the acceptance proxy ----------------------------------------------------------------------------


def head_loss(head: EagleHead, token_ids: Tensor, features: Tensor, final_hidden: Tensor, steps: int,
              regression_weight: float, step_decay: float = 0.8) -> tuple[Tensor, dict[str, float]]:
    """EAGLE's loss, summed over unrolled steps with weights step_decay**s.

    token_ids [B, T] (x_0..x_{T-1}), features [B, T, n, H], final_hidden [B, T, H] the target's final-norm states
    (its distribution at each position is final_hidden @ rows.T). Head index j in 0..T-3 reads (h_j, x_{j+1}) and
    is scored by KL(p_{j+1} || q) over the draft vocabulary plus regression_weight * smooth-L1 between the head's
    final-normed feature and h_{j+1}. Returns (loss, {kl_s, reg_s per step}).
    """
    T = token_ids.shape[1]
    results = head.unrolled(token_ids[:, 1:T - 1], features[:, : T - 2], steps)
    target_hidden = final_hidden[:, 1 : T - 1].float()  # [B, T - 2, H]
    with torch.no_grad():
        target_logp = torch.log_softmax(target_hidden @ head.rows.T, -1)  # [B, T - 2, V_d]
    total, parts = 0.0, {}
    for step, (logits, out) in enumerate(results):
        logp = torch.log_softmax(logits[:, step:], -1)
        p_log = target_logp[:, step:]
        kl = (p_log.exp() * (p_log - logp)).sum(-1).mean()
        reg = F.smooth_l1_loss(head.final_norm(out[:, step:]), target_hidden[:, step:])
        total = total + step_decay**step * (kl + regression_weight * reg)
        parts[f"kl_{step}"], parts[f"reg_{step}"] = float(kl.detach()), float(reg.detach())
    return total, parts


@torch.no_grad()
def chain_acceptance(head: EagleHead, token_ids: Tensor, features: Tensor, scored: Tensor, gamma: int) -> dict[str, Any]:
    """Teacher-forced greedy acceptance of gamma-token chains on text the target wrote greedily.

    token_ids [B, T] target ids; features [B, T, n, H]; scored [B, T] bool: positions whose token is the
    target's greedy choice (its own greedy continuation; not the prompt). A chain starting at index i (the target
    has verified through token x_{i+1}) drafts x_{i+2}..x_{i+1+gamma} from its own features; on greedy text the
    target accepts the longest matching prefix, so `prefix_match[k]` = P(first k+1 drafts all match) and the
    acceptance length at gamma = 1 + sum_k prefix_match[k] (the +1 is the target's own token).
    Returns {chains, prefix_match [gamma], conditional [gamma], acceptance_length}.
    """
    T = token_ids.shape[1]
    width = T - 2  # head indices 0..T-3
    results = head.unrolled(token_ids[:, 1 : T - 1], features[:, :width], gamma)
    labels = token_ids[:, 2:]  # [B, W]: the head at index j predicts x_{j+2}
    label_ok = scored[:, 2:]
    matches = [head.d2t[logits.argmax(-1)] == labels for logits, _ in results]  # per step [B, W] bool
    starts = width - gamma + 1  # chains whose every position is inside the window
    alive = torch.ones(token_ids.shape[0], starts, dtype=torch.bool)
    usable = label_ok[:, gamma - 1 : gamma - 1 + starts].clone()  # every label of the chain must be greedy text
    for k in range(gamma):
        usable &= label_ok[:, k : k + starts]
    count = int(usable.sum())
    prefix = []
    for k in range(gamma):
        alive = alive & matches[k][:, k : k + starts]  # step k of the chain that started at i sits at index i + k
        prefix.append(float((alive & usable).sum()) / max(count, 1))
    conditional = [prefix[0]] + [prefix[k] / prefix[k - 1] if prefix[k - 1] else 0.0 for k in range(1, gamma)]
    return {"chains": count, "prefix_match": prefix, "conditional": conditional, "acceptance_length": 1.0 + sum(prefix)}


@torch.no_grad()
def sampled_acceptance(head: EagleHead, model: CausalLM, token_ids: Tensor, temperatures: Sequence[float], steps: int) -> Tensor:
    """Teacher-forced acceptance of sampled drafts at temperature 1, per candidate sample_temperature t and chain
    step `# [len(temperatures), steps]` (float64).

    token_ids [B, T] target ids, each row from position 0. At head index j (reading h_j and x_{j+1}; step s feeds
    the head's own features from s earlier steps, as a chain's s-th draft does) the rate is sum_x min(p(x), q_t(x)):
    p the target's next-token distribution over its FULL vocabulary (mass outside d2t is never drafted), q_t =
    softmax(head logits / t) on d2t's ids. That overlap is the chance exact verification accepts the draft, so it is
    the quantity sample_temperature should maximise; it is averaged over every index that has a chain at every step."""
    if not temperatures or any(not t > 0 for t in temperatures):
        raise ValueError(f"temperatures {list(temperatures)}: give one or more values > 0")
    B, T = token_ids.shape
    if T < steps + 2:
        raise ValueError(f"rows of {T} tokens: give rows of at least steps + 2 = {steps + 2} tokens")
    total = torch.zeros(len(temperatures), steps, dtype=torch.float64)
    scale = torch.tensor([float(t) for t in temperatures])[:, None, None]  # [K, 1, 1]
    for row in token_ids:
        ids = row[None]  # [1, T]
        logits = model.forward(ids, torch.arange(T)[None], model.new_cache(1, T), torch.zeros(1, dtype=torch.int64))
        p = torch.softmax(logits[0, 1 : T - 1].float(), -1)[steps - 1 :, head.d2t]  # [W, V_d] p after x_{j+1}
        features = target_features(model, ids, head.config.feature_layers)[:, : T - 2]  # [1, T-2, n, H]
        for step, (draft_logits, _) in enumerate(head.unrolled(ids[:, 1 : T - 1], features, steps)):
            q = torch.softmax(draft_logits[0, steps - 1 :].float() / scale, -1)  # [K, W, V_d]
            total[:, step] += torch.minimum(p, q).sum(-1).double().mean(-1)
    return total / B


def expected_acceptance_length(rates: Sequence[float]) -> float:
    """1 + sum_k prod_{i<=k} rates[i]: the acceptance length of greedy chains with conditional per-position rates."""
    return 1.0 + sum(math.prod(rates[: k + 1]) for k in range(len(rates)))


# --- saving and loading: the head that ships --------------------------------------------------------------------

HEAD_WEIGHTS_FILE = "eagle_head.safetensors"  # the trainable weights only, bf16
HEAD_CONFIG_FILE = "eagle_config.json"  # format, EagleConfig, the target's and the d2t map's fingerprints, metadata
MODEL_CARD_FILE = "README.md"
HEAD_FORMAT = "specgate-eagle-head"
FINGERPRINT_IDS = 5  # embedding rows sampled, at evenly spaced ids
FINGERPRINT_COLUMNS = 16  # leading values of each sampled row and of the final norm's scale
# a sampled value may move by this fraction of the sample's largest magnitude: bf16 and Q8_0 copies of one model
# pass (bf16 rounds a value by <= 0.4% of itself, Q8_0 by <= 1/254 of its 32-value block's largest), another
# model's weights do not (they differ by the values' own size)
FINGERPRINT_TOLERANCE = 0.05
TRAIN_HINT = "python -m specgate.drafting.eagle_train extract / train against that target, then eagle.save_head"


def target_fingerprint(head: EagleHead) -> dict[str, Any]:
    """What the head was attached to: the target's embedding shape, a few of its values (FINGERPRINT_IDS rows,
    FINGERPRINT_COLUMNS leading values each) and the final norm's leading scales. Read from the head's frozen
    parts, which attach_target took from the target, so saving and loading compute it the same way."""
    if head.embed.numel() == 0:
        raise ValueError("the head has no target attached: call head.attach_target(target, d2t) before saving or fingerprinting it")
    vocab, hidden = head.embed.shape
    ids = torch.linspace(0, vocab - 1, FINGERPRINT_IDS).round().to(torch.int64)
    return {
        "embedding_shape": [int(vocab), int(hidden)],
        "embedding_ids": ids.tolist(),
        "embedding_sample": embedding_rows(head.embed, ids)[:, :FINGERPRINT_COLUMNS].tolist(),  # dequantized if quantized
        "final_norm_sample": head.final_norm.weight[:FINGERPRINT_COLUMNS].float().tolist(),
    }


def d2t_fingerprint(d2t: Tensor) -> str:
    """sha256 of the d2t map's ids (int64, little-endian): the map a head was trained with."""
    import hashlib

    return hashlib.sha256(d2t.to(torch.int64).contiguous().numpy().astype("<i8").tobytes()).hexdigest()


def save_head(head: EagleHead, out_dir: str | Path, metadata: dict[str, Any] | None = None) -> Path:
    """Write a head that `load_head` can attach to its target: out_dir/eagle_head.safetensors (the trainable
    weights, bf16; the frozen embedding, rows and final norm are the target's), draft_vocab_map.safetensors (d2t),
    eagle_config.json (the EagleConfig, the target's fingerprint, the d2t map's sha256, metadata) and README.md, a
    model card from metadata (see model_card). The head must be attached to the target it was trained on."""
    from safetensors.torch import save_file

    from specgate.drafting.model_drafter import VOCAB_MAP_FILE, VOCAB_MAP_KEY

    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    fingerprint = target_fingerprint(head)
    weights = {name: p.detach().to(torch.bfloat16).contiguous() for name, p in head.named_parameters() if p.requires_grad}
    save_file(weights, str(out / HEAD_WEIGHTS_FILE), metadata={"format": HEAD_FORMAT})
    save_file({VOCAB_MAP_KEY: head.d2t.to(torch.int64).contiguous()}, str(out / VOCAB_MAP_FILE))
    info = {"format": HEAD_FORMAT, "version": 1, "config": head.config.to_dict(), "target_fingerprint": fingerprint,
            "d2t_sha256": d2t_fingerprint(head.d2t), "metadata": dict(metadata or {})}
    (out / HEAD_CONFIG_FILE).write_text(json.dumps(info, indent=2) + "\n")
    (out / MODEL_CARD_FILE).write_text(model_card(head, info))
    return out


def load_head(head_dir: str | Path, target: Any) -> EagleHead:
    """The head saved in head_dir, attached to target (a LoadedModel or CausalLM), in eval mode, float32.

    Raises ValueError naming the mismatch and the fix when the dir is not a saved head, its files disagree, or
    target is not the model it was trained on (embedding shape or values, final norm: target_fingerprint).
    A quantized target (--dtype gguf / int8) is compared by its dequantized values, under the one rule for every
    dtype: the embedding shape equal, and each sampled value within FINGERPRINT_TOLERANCE (5%) of the recorded
    sample's largest magnitude. So a head saved against a GGUF loaded as float32 / bf16 loads onto the same GGUF's
    blocks (--dtype gguf: equal values, or bf16 rounding), and one saved against a float model loads onto that
    model quantized to Q8_0 (int8 on load, or a GGUF whose embedding is Q8_0, as Gemma-3-270M Q4_K_M's is); another
    model of the same shapes fails (its values differ by their own size)."""
    from safetensors.torch import load_file

    from specgate.drafting.model_drafter import load_vocab_map

    path = Path(head_dir).expanduser()
    model, name = getattr(target, "model", target), getattr(target, "name", "the target")
    if not (path / HEAD_CONFIG_FILE).is_file():
        raise ValueError(f"'{path}' is not a saved EAGLE head (no {HEAD_CONFIG_FILE}): give the directory eagle.save_head wrote")
    info = json.loads((path / HEAD_CONFIG_FILE).read_text())
    if info.get("format") != HEAD_FORMAT:
        raise ValueError(f"'{path / HEAD_CONFIG_FILE}' has format {info.get('format')!r}, not {HEAD_FORMAT!r}: give a directory eagle.save_head wrote")
    config = EagleConfig.from_dict(info["config"])
    d2t = load_vocab_map(path, config.draft_vocab_size, int(model.vocab_size))
    if d2t is None or d2t_fingerprint(d2t) != info.get("d2t_sha256"):
        raise ValueError(f"'{path}': the d2t map is missing or is not the one {HEAD_CONFIG_FILE} records (sha256 differs): "
                         "the files come from different exports; save the head again with eagle.save_head")
    head = EagleHead(config).attach_target(model, d2t)
    _check_target(path, info, target_fingerprint(head), name)
    weights = load_file(str(path / HEAD_WEIGHTS_FILE))
    expected = {n for n, p in head.named_parameters() if p.requires_grad}
    if set(weights) != expected:
        raise ValueError(f"'{path / HEAD_WEIGHTS_FILE}' does not hold this head's trainable weights (missing "
                         f"{sorted(expected - set(weights))[:3]}, unexpected {sorted(set(weights) - expected)[:3]}): save it again with eagle.save_head")
    head.load_state_dict({n: w.float() for n, w in weights.items()}, strict=False)
    return head.eval()


def _check_target(path: Path, info: dict[str, Any], actual: dict[str, Any], name: str) -> None:
    """Raise ValueError if the target's fingerprint is not the recorded one (shape exactly, values within tolerance:
    |recorded - actual| <= FINGERPRINT_TOLERANCE * max |recorded| per sample, actual dequantized where quantized)."""
    saved = info["target_fingerprint"]
    trained_on = info.get("metadata", {}).get("target", "another model")
    fix = f"use the target it was trained on ('{trained_on}'), or train a head for '{name}' ({TRAIN_HINT})"
    if saved["embedding_shape"] != actual["embedding_shape"]:
        raise ValueError(f"EAGLE head '{path}' was trained on a target with embedding [vocab, hidden] = {saved['embedding_shape']}, "
                         f"but target '{name}' has {actual['embedding_shape']}: {fix}")
    for key, what in (("embedding_sample", "embedding values"), ("final_norm_sample", "final norm scales")):
        expected, got = torch.tensor(saved[key]), torch.tensor(actual[key])
        worst = float((expected - got).abs().max())
        limit = FINGERPRINT_TOLERANCE * float(expected.abs().max()) + 1e-6
        if worst > limit:
            raise ValueError(f"EAGLE head '{path}': target '{name}' has other {what} than the model the head was trained on "
                             f"(largest difference {worst:.4g}, tolerance {limit:.4g}; same shapes, so another model or checkpoint): {fix}")


def model_card(head: EagleHead, info: dict[str, Any]) -> str:
    """The head's README.md. metadata keys read: target, data, steps, acceptance ({category: {conditional,
    prefix_match, acceptance_length}}, as eagle_train.evaluate gives), gamma, end_to_end (str), exactness (str), limits
    (str or list), recipe; a key left out reads "not recorded" (end_to_end and exactness: the command that measures it)."""
    meta, config = info["metadata"], head.config
    missing = "not recorded"
    limits = meta.get("limits", missing)
    lines = [
        f"# EAGLE head for {meta.get('target', 'its target')}", "",
        "A draft head for specgate's speculative decoding (specgate.drafting.eagle): one decoder layer of the target's shape "
        "that reads the target's own final-norm features and drafts over a reduced vocabulary. Exact: the target verifies "
        "every draft over its full vocabulary.", "",
        "| what | value |", "|---|---|",
        f"| target | {meta.get('target', missing)} (embedding {info['target_fingerprint']['embedding_shape']}, checked at load) |",
        f"| feature layers | {list(config.feature_layers)} (-1: final norm) |",
        f"| draft vocabulary | {config.draft_vocab_size} target ids (draft_vocab_map.safetensors, sha256 {info['d2t_sha256'][:16]}...) |",
        f"| weights | {head.size_bytes() / 1e6:.1f} MB bf16 ({HEAD_WEIGHTS_FILE}) |",
        f"| training data | {meta.get('data', missing)} |",
        f"| training steps | {meta.get('steps', missing)} |",
        f"| recipe | {meta.get('recipe', missing)} |", "",
        "## Held-out acceptance", "",
        *_acceptance_table(meta.get("acceptance"), meta.get("gamma")), "",
        "## End to end", "",
        str(meta.get("end_to_end", "not measured at export: `python bench/bench_draft.py` measures the head against the target alone "
                                   "(docs/BENCHMARKS.md, the draft table)")), "",
        "## Exactness", "",
        str(meta.get("exactness", "not checked at export: `specgate check-lossless --target TARGET --draft eagle:THIS_DIR` runs "
                                  "the chi-square check on the real pair, with its negative controls")), "",
        "## Limits", "",
        *([f"- {item}" for item in limits] if isinstance(limits, list) else [str(limits)]), "",
        "## Use", "",
        "    specgate generate --draft eagle:THIS_DIR --prompt ...", "    specgate serve --draft eagle:THIS_DIR", "",
    ]
    return "\n".join(lines)


def _acceptance_table(acceptance: dict[str, Any] | None, gamma: Any) -> list[str]:
    """Markdown rows: per category, the conditional acceptance at each draft position and the acceptance length."""
    if not acceptance:
        return ["not recorded"]
    positions = max(len(entry.get("conditional", [])) for entry in acceptance.values())
    header = "| category | " + " | ".join(f"pos {k + 1}" for k in range(positions)) + " | acceptance length |"
    rows = [header, "|---" * (positions + 2) + "|"]
    for category, entry in acceptance.items():
        rates = [f"{rate:.3f}" for rate in entry.get("conditional", [])] + ["-"] * (positions - len(entry.get("conditional", [])))
        rows.append(f"| {category} | " + " | ".join(rates) + f" | {entry.get('acceptance_length', float('nan')):.3f} |")
    note = f"greedy, teacher-forced chains of {gamma or positions} drafts on the target's own held-out text; pos k: P(draft k accepted | drafts 1..k-1 were)"
    return [*rows, "", note]
