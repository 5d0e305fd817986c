"""The same draft in specgate and in transformers' assisted generation: a full-vocabulary copy of a reduced draft.

transformers' `generate(assistant_model=...)` reads an assistant's output ids as target ids, so a draft with a
reduced head and an id map (the default draft's `d2t`) cannot be an assistant as it ships. The copy written here
has the target's vocabulary: its tied embedding/head row of target id t is the draft's row of t2d[t] (the draft's
own row, or its fallback `<unk>` row for a token it lacks). Inputs: specgate's drafter feeds a token outside its
vocabulary as the fallback, and the copy's row of that token IS the fallback row, so both compute the same hidden
states. Outputs: every token the draft lacks gets exactly the fallback's logit; argmax returns the first maximal
index (torch and transformers' greedy alike), so while each such id is above the fallback's id a tie resolves to
the fallback, which is what the reduced draft proposes there. Greedy drafts are then identical.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def expand_draft_vocabulary(drafter: Any, target: Any, out_dir: Path) -> Path:
    """Write a full-vocabulary copy of a reduced-vocabulary ModelDrafter (HF layout + the target's tokenizer) to
    out_dir and return it. Refuses a draft whose head is not tied, and one where a target id outside the draft
    vocabulary lies below the fallback's id (argmax ties would pick it: the copy would not draft alike)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    draft_dir = Path(drafter.draft.path)
    config = json.loads((draft_dir / "config.json").read_text())
    if not config.get("tie_word_embeddings", True):
        raise ValueError(f"draft '{draft_dir}': tie_word_embeddings={config['tie_word_embeddings']}; expand_draft_vocabulary handles a tied head only")
    target_vocab = int(target.model.vocab_size)
    unmapped = torch.ones(target_vocab, dtype=torch.bool)  # [V_t]
    unmapped[drafter.d2t] = False
    fallback_target_id = int(drafter.d2t[drafter.t2d[int(unmapped.nonzero()[0])]]) if bool(unmapped.any()) else -1
    if bool(unmapped.any()) and int(unmapped.nonzero()[0]) < fallback_target_id:
        raise ValueError(
            f"target id {int(unmapped.nonzero()[0])} is outside the draft vocabulary but below its fallback token "
            f"{fallback_target_id}: argmax ties would pick it, so the full-vocabulary copy would not draft alike"
        )
    with safe_open(str(draft_dir / "model.safetensors"), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    embedding_key = next(key for key in tensors if key.endswith("embed_tokens.weight"))
    tensors[embedding_key] = tensors[embedding_key][drafter.t2d].contiguous()  # [V_t, H]: row t = draft row t2d[t]
    tensors.pop("lm_head.weight", None)  # tied: the head is the embedding
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.update(vocab_size=target_vocab, tie_word_embeddings=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    target.tokenizer.save_pretrained(str(out_dir))  # same tokenizer: both libraries load the dir as it is
    return out_dir
