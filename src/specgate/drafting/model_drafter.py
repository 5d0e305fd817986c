"""Draft with a small language model that shares the target's tokenizer (optionally over a subset vocabulary).

q is the distribution each draft token is actually sampled from: the draft's logits processed with the SAME
SamplingParams as the target's (temperature, top-k, top-p), placed on the target's vocabulary. A draft whose
output vocabulary is a subset of the target's (EAGLE-3 / FR-Spec) ships an id map `d2t` in
`draft_vocab_map.safetensors` next to its weights: d2t[i] is the target id of draft output i (absolute ids).
Its q is scattered into the target vocabulary with zeros elsewhere; the result stays exact because the target
verifies over its full vocabulary and the residual (p - q)+ gives the other tokens their mass. Context tokens
outside the draft vocabulary are fed to the draft as its unknown (or id 0) token: that can only lower
acceptance, never exactness.

A draft built by specgate's recipe (specgate.drafting.build_default) ships no tokenizer (Gemma's is ~30 MB):
its dir holds `specgate_draft.json` naming the target, the target's vocabulary size and special ids, and a
fingerprint of the target tokens its d2t map stands for. load_draft_dir checks all of them against the target
and borrows the target's tokenizer.

The drafter keeps its own KV cache (one CausalLM slot, positions absolute), so drafts the target rejected need
no undo: the cache remembers which token it holds at each position and re-feeds from the first disagreement.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specgate.drafting.base import DraftProposal, Drafter

VOCAB_MAP_FILE = "draft_vocab_map.safetensors"
VOCAB_MAP_KEY = "d2t"
DRAFT_INFO_FILE = "specgate_draft.json"


def check_same_tokenizer(draft: Any, target: Any) -> None:
    """Refuse a draft whose tokenizer differs from the target's (vocabulary dict or special tokens)."""
    draft_vocab, target_vocab = draft.tokenizer.get_vocab(), target.tokenizer.get_vocab()
    fix = (
        "speculative decoding needs the target's tokenizer: pick a draft from the same model family, "
        f"or a subset-vocabulary draft that ships the target's tokenizer and a {VOCAB_MAP_FILE} id map"
    )
    if draft_vocab != target_vocab:
        differing = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()), key=lambda kv: kv[1])[:3]
        raise ValueError(
            f"draft '{draft.name}' has a different tokenizer from target '{target.name}' "
            f"({len(draft_vocab)} vs {len(target_vocab)} entries; first differences {differing}): {fix}"
        )
    for attribute in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        draft_id, target_id = getattr(draft.tokenizer, attribute, None), getattr(target.tokenizer, attribute, None)
        if draft_id != target_id:
            raise ValueError(
                f"draft '{draft.name}' has {attribute}={draft_id} but target '{target.name}' has {target_id}: {fix}"
            )


def load_vocab_map(draft_dir: Path | None, draft_vocab_size: int, target_vocab_size: int) -> Tensor | None:
    """d2t [V_d] int64 from draft_dir/draft_vocab_map.safetensors, validated; None if the file is absent."""
    if draft_dir is None or not (Path(draft_dir) / VOCAB_MAP_FILE).is_file():
        return None
    from safetensors.torch import load_file

    path = Path(draft_dir) / VOCAB_MAP_FILE
    tensors = load_file(str(path))
    if VOCAB_MAP_KEY not in tensors:
        raise ValueError(f"{path} has no tensor '{VOCAB_MAP_KEY}' (keys {sorted(tensors)}): store the draft->target id map under '{VOCAB_MAP_KEY}'")
    d2t = tensors[VOCAB_MAP_KEY]
    if d2t.dim() != 1 or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise ValueError(f"{path}: '{VOCAB_MAP_KEY}' must be a 1-D integer tensor, got shape {tuple(d2t.shape)} dtype {d2t.dtype}")
    d2t = d2t.to(torch.int64)
    if d2t.numel() != draft_vocab_size:
        raise ValueError(
            f"{path}: '{VOCAB_MAP_KEY}' has {d2t.numel()} entries but the draft has {draft_vocab_size} output tokens: "
            "the map needs exactly one target id per draft output"
        )
    bad = (d2t < 0) | (d2t >= target_vocab_size)
    if bool(bad.any()):
        index = int(bad.nonzero()[0])
        raise ValueError(
            f"{path}: '{VOCAB_MAP_KEY}'[{index}] = {int(d2t[index])} is outside the target vocabulary 0..{target_vocab_size - 1}"
        )
    if torch.unique(d2t).numel() != d2t.numel():
        values, counts = torch.unique(d2t, return_counts=True)
        duplicate = int(values[counts > 1][0])
        raise ValueError(f"{path}: '{VOCAB_MAP_KEY}' maps several draft ids to target id {duplicate}: the map must be one-to-one")
    return d2t


def sample_draft_ids(logits: Tensor, params: Any, generator: torch.Generator | None) -> tuple[Tensor, Tensor | None]:
    """Draw from draft logits `# [B, V_d']` processed with the target's SamplingParams: the draws as draft output ids
    `# [B]` and the probabilities `# [B, V_d']` they were drawn from (None when greedy: argmax, q one-hot).

    One float64 uniform per row and an inverse CDF over the float64 running sum: the first id whose running mass
    exceeds u * total, so an id of zero mass (top-k / top-p cut) is never drawn. torch.multinomial took ~0.3 ms a
    draw over the EAGLE head's 12,288 ids, a tenth of a drafted token's cost."""
    from specgate.sampling import logits_to_probs

    if params.greedy:
        return logits.argmax(-1), None
    probs = logits_to_probs(logits.float(), params)  # [B, V_d']
    cdf = probs.double().cumsum(-1)  # [B, V_d']
    total = cdf[:, -1:]  # [B, 1]
    uniforms = torch.rand(probs.shape[0], 1, dtype=torch.float64, generator=generator)  # [B, 1]
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    ids = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)
    return ids, probs


def sample_draft(logits: Tensor, params: Any, generator: torch.Generator | None, d2t: Tensor | None,
                 target_vocab_size: int) -> tuple[Tensor, Tensor | None]:
    """The drafters' one sampler (the draft model's; the EAGLE head keeps sample_draft_ids' q on its d2t columns):
    draw from the draft's logits processed with the target's SamplingParams, and say what the draws came from.

    logits `# [B, V_d']` draft logits; d2t `# [V_d']` draft output id -> target id, or None when the draft's
    outputs are the target's ids. Returns the draft tokens `# [B]` (target ids) and q `# [B, V_t]`, the
    distribution they were drawn from on the target vocabulary, zero outside d2t (None when greedy: q is one-hot).
    """
    draft_ids, probs = sample_draft_ids(logits, params, generator)
    if d2t is None:
        return draft_ids, probs
    if probs is None:
        return d2t[draft_ids], None
    draft_probs = torch.zeros(probs.shape[0], target_vocab_size, dtype=probs.dtype)  # [B, V_t]
    draft_probs[:, d2t] = probs
    return d2t[draft_ids], draft_probs


def vocab_fingerprint(pieces: Sequence[str]) -> str:
    """sha256 of the token strings a d2t map points at, in draft-id order (what the ids mean, not just how many)."""
    return hashlib.sha256("\n".join(pieces).encode("utf-8")).hexdigest()


def is_draft_dir(path: str | Path) -> bool:
    """True for a dir written by specgate's draft recipe (it carries specgate_draft.json)."""
    return (Path(path).expanduser() / DRAFT_INFO_FILE).is_file()


def check_draft_info(draft_dir: Path, info: dict[str, Any], d2t: Tensor | None, target: Any) -> None:
    """Refuse a recipe-built draft whose target facts (vocabulary size, special ids, token strings) differ.

    d2t None: check the vocabulary size and special ids only (before the map itself is read)."""
    fix = f"use the draft built for this target, or rebuild it with `{info.get('recipe', 'the draft recipe')}` against '{target.name}'"
    target_vocab = int(target.model.vocab_size)
    if int(info.get("target_vocab_size", -1)) != target_vocab:
        raise ValueError(
            f"draft '{draft_dir.name}' was built for a target vocabulary of {info.get('target_vocab_size')} tokens "
            f"('{info.get('target')}') but target '{target.name}' has {target_vocab}: {fix}"
        )
    for attribute, draft_id in dict(info.get("target_special_ids", {})).items():
        target_id = getattr(target.tokenizer, attribute, None)
        if draft_id != target_id:
            raise ValueError(f"draft '{draft_dir.name}' expects {attribute}={draft_id} but target '{target.name}' has {target_id}: {fix}")
    if d2t is None:
        return
    pieces = target.tokenizer.convert_ids_to_tokens(d2t.tolist())
    if vocab_fingerprint(pieces) != info.get("draft_vocab_sha256"):
        raise ValueError(
            f"draft '{draft_dir.name}': its {VOCAB_MAP_FILE} ids name different tokens in target '{target.name}''s tokenizer "
            f"than in the tokenizer it was built with (sha256 of the token strings differs): {fix}"
        )


def load_draft_dir(path: str | Path, target: Any, dtype: torch.dtype | None = None) -> Any:
    """A recipe-built draft (config.json, model.safetensors, d2t map, specgate_draft.json) as a LoadedModel that
    borrows the target's tokenizer, after checking its vocabulary map against the target.

    dtype: the weights' dtype (default: the target's, so draft and target compute alike).
    """
    from safetensors import safe_open
    from transformers import AutoConfig

    from specgate.models import LoadedModel
    from specgate.models.loading import build_model

    draft_dir = Path(path).expanduser()
    info = json.loads((draft_dir / DRAFT_INFO_FILE).read_text())
    config = AutoConfig.from_pretrained(str(draft_dir), local_files_only=True, trust_remote_code=False)
    check_draft_info(draft_dir, info, None, target)
    d2t = load_vocab_map(draft_dir, int(config.vocab_size), int(target.model.vocab_size))
    if d2t is None:
        raise ValueError(f"draft '{draft_dir}' has {DRAFT_INFO_FILE} but no {VOCAB_MAP_FILE}: a reduced-vocabulary draft needs its d2t map")
    check_draft_info(draft_dir, info, d2t, target)

    def tensors():
        with safe_open(str(draft_dir / "model.safetensors"), framework="pt") as handle:
            for key in handle.keys():
                yield key, handle.get_tensor(key)

    model = build_model(config, tensors(), dtype or target.model.dtype)
    return LoadedModel(model=model, tokenizer=target.tokenizer, name=draft_dir.name, path=draft_dir)


class ModelDrafter(Drafter):
    """Sample gamma draft tokens autoregressively from a small LM (gamma draft forward passes per step)."""

    def __init__(self, draft: Any, target: Any, name: str | None = None) -> None:
        check_same_tokenizer(draft, target)
        self.draft = draft
        self.name = name or f"model:{draft.name}"
        draft_vocab, target_vocab = int(draft.model.vocab_size), int(target.model.vocab_size)
        self.target_vocab_size = target_vocab
        d2t = load_vocab_map(getattr(draft, "path", None), draft_vocab, target_vocab)
        if d2t is None:
            # same tokenizer, maybe different padding rows: only ids both models have can be drafted
            d2t = torch.arange(min(draft_vocab, target_vocab), dtype=torch.int64)
        self.d2t = d2t  # [V_d'] draft output id -> target id
        self.identity_map = bool(d2t.numel() == target_vocab and torch.equal(d2t, torch.arange(target_vocab)))
        self.t2d = torch.zeros(target_vocab, dtype=torch.int64)  # [V_t] target id -> draft input id
        self.t2d[d2t] = torch.arange(d2t.numel(), dtype=torch.int64)
        unknown = getattr(draft.tokenizer, "unk_token_id", None)
        if unknown is not None and 0 <= unknown < target_vocab and bool((d2t == unknown).any()):
            fallback = self.t2d[unknown].clone()
            unmapped = torch.ones(target_vocab, dtype=torch.bool)
            unmapped[d2t] = False
            self.t2d[unmapped] = fallback
        self.num_outputs = d2t.numel()

    def begin(self, prompt_ids, params, generator, max_seq_len) -> None:
        super().begin(prompt_ids, params, generator, max_seq_len)
        limit = int(self.draft.model.max_position_embeddings)
        if max_seq_len > limit:
            raise ValueError(
                f"the request needs {max_seq_len} positions but draft '{self.draft.name}' supports {limit}: "
                "lower max_new_tokens or shorten the prompt"
            )
        self.cache = self.draft.model.new_cache(1, max_seq_len)
        self.slots = torch.zeros(1, dtype=torch.int64)  # [1]
        self.cached_tokens = torch.full((max_seq_len,), -1, dtype=torch.int64)  # [S] target id held at each position

    def _forward(self, target_ids: Tensor, start: int) -> Tensor:
        """Feed target_ids [T] at positions start.. into the draft cache; logits of the last one [V_d']."""
        positions = torch.arange(start, start + target_ids.numel(), dtype=torch.int64)[None]  # [1, T]
        logits = self.draft.model.forward(self.t2d[target_ids][None], positions, self.cache, self.slots, last_only=True)
        self.cached_tokens[start : start + target_ids.numel()] = target_ids
        return logits[0, : self.num_outputs]  # [V_d']

    def sample(self, logits: Tensor, params: Any, generator: torch.Generator | None) -> tuple[Tensor, Tensor | None]:
        """The draft's sampler, shared by propose, sample_batch and the batched drafter (drafting.batched):
        sample_draft with this draft's id map."""
        return sample_draft(logits, params, generator, None if self.identity_map else self.d2t, self.target_vocab_size)

    def sample_batch(self, contexts: Tensor, gamma: int, params: Any, generator: torch.Generator | None) -> tuple[Tensor, Tensor | None]:
        """Draft gamma tokens for B equal-length contexts [B, T] at once (own cache, B slots).

        Returns tokens [B, G] int64 (target ids) and q [B, G, V_t] float32 (None when greedy): the same sampler
        as propose(), batched, for statistical checks and batching engines.
        """
        batch, length = contexts.shape
        cache = self.draft.model.new_cache(batch, length + gamma)
        slots = torch.arange(batch, dtype=torch.int64)  # [B]
        positions = torch.arange(length, dtype=torch.int64)[None].expand(batch, length)  # [B, T]
        logits = self.draft.model.forward(self.t2d[contexts], positions, cache, slots, last_only=True)  # [B, V_d]
        tokens = torch.empty(batch, gamma, dtype=torch.int64)  # [B, G]
        draft_probs = None if params.greedy else torch.zeros(batch, gamma, self.target_vocab_size)  # [B, G, V_t]
        for i in range(gamma):
            tokens[:, i], q = self.sample(logits[:, : self.num_outputs], params, generator)  # [B], [B, V_t]
            if q is not None:
                draft_probs[:, i] = q
            if i + 1 < gamma:
                step_positions = torch.full((batch, 1), length + i, dtype=torch.int64)  # [B, 1]
                logits = self.draft.model.forward(self.t2d[tokens[:, i : i + 1]], step_positions, cache, slots, last_only=True)
        return tokens, draft_probs

    def propose(self, context_ids: Tensor, gamma: int) -> DraftProposal:
        length = int(context_ids.numel())
        # the cache is valid up to the first position whose token differs from the context (a rejected draft)
        differs = (self.cached_tokens[:length] != context_ids).nonzero()
        valid = min(int(differs[0]) if differs.numel() else length, length - 1)  # always feed >= 1 token
        logits = self._forward(context_ids[valid:], valid)
        tokens, probs = [], []
        for i in range(gamma):
            draft, q = self.sample(logits[None], self.params, self.generator)  # [1], [1, V_t] or None
            token = int(draft[0])
            tokens.append(token)
            probs.append(None if q is None else q[0])
            if i + 1 < gamma:
                logits = self._forward(torch.tensor([token], dtype=torch.int64), length + i)
        draft_probs = None if self.params.greedy else torch.stack(probs)  # [G, V_t]
        return DraftProposal(tokens=torch.tensor(tokens, dtype=torch.int64), draft_probs=draft_probs, forward_passes=gamma)
