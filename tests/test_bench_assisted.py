"""specgate.bench.assisted's full-vocabulary copy of a reduced-vocabulary draft drafts the same greedy tokens.

bench/bench_assisted.py runs the default draft under transformers' assisted generation as a copy whose embedding/head has every
target row (the draft's row, or its <unk> row for tokens it lacks). Here, on a tiny Gemma-3 target (vocabulary 512)
and a 1-layer draft over 128 of its tokens, with the <unk> row scaled (x0.8) so that <unk> wins the argmax in some
drafts and not in others (the tie case the copy relies on; the smallest top-1/top-2 logit gap is 0.0065, far above
float32 noise): the reduced drafter, the copy in specgate's runtime and the copy in transformers'
Gemma3ForCausalLM draft identical greedy tokens from contexts that are mostly outside the draft vocabulary. Negative
control: the naive copy (draft rows scattered, zeros elsewhere) drafts different tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specgate.bench.assisted import expand_draft_vocabulary
from specgate.drafting import distill, make_drafter
from specgate.models import load_model
from specgate.sampling import SamplingParams

from conftest import recipe_draft_info

GREEDY = SamplingParams(temperature=0.0)
GAMMA = 4
UNK = 3


def write_reduced_draft(target, out_dir: Path, d2t: torch.Tensor, unk_scale: float = 1.0) -> Path:
    """A 1-layer recipe-format draft of `target` over the target ids d2t, its <unk> row scaled by unk_scale."""
    config = distill.student_config(target.model.config, [0], d2t.numel())
    state = distill.student_state_from_target(target.model, [0], d2t)
    state["model.embed_tokens.weight"][d2t == UNK] *= unk_scale
    info = recipe_draft_info(target, d2t)
    distill.save_student(distill.build_student(config, state), config, d2t, out_dir, info)
    return out_dir


def hf_greedy_drafts(model_dir: Path, contexts: torch.Tensor, gamma: int) -> torch.Tensor:
    """gamma greedy tokens [B, G] from transformers' model of model_dir (argmax of the last logits, as its greedy does)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True).eval()
    ids = contexts
    with torch.inference_mode():
        for _ in range(gamma):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[:, contexts.shape[1] :]


@pytest.fixture(scope="module")
def tiny_target(tiny_model_dir):
    return load_model(str(tiny_model_dir("gemma3")))


@pytest.fixture(scope="module")
def reduced_draft(tiny_target, tmp_path_factory):
    vocab = int(tiny_target.model.vocab_size)
    rest = torch.randperm(vocab - 4, generator=torch.Generator().manual_seed(1))[:124] + 4
    d2t = torch.cat([torch.arange(4), rest]).sort().values  # [128]: specials 0..3 plus 124 random ids
    out = write_reduced_draft(tiny_target, tmp_path_factory.mktemp("reduced") / "draft", d2t, unk_scale=0.8)
    return make_drafter(str(out), tiny_target)


@pytest.fixture(scope="module")
def contexts(tiny_target):
    return torch.randint(4, int(tiny_target.model.vocab_size), (24, 10), generator=torch.Generator().manual_seed(2))  # [B, T]


def test_full_vocabulary_copy_drafts_the_same_greedy_tokens_in_both_runtimes(tiny_target, reduced_draft, contexts, tmp_path):
    full_dir = expand_draft_vocabulary(reduced_draft, tiny_target, tmp_path / "full")
    reduced_tokens, _ = reduced_draft.sample_batch(contexts, GAMMA, GREEDY, None)  # [B, G]
    full_tokens, _ = make_drafter(str(full_dir), tiny_target).sample_batch(contexts, GAMMA, GREEDY, None)  # [B, G]
    hf_tokens = hf_greedy_drafts(full_dir, contexts, GAMMA)  # [B, G]
    in_draft_vocab = torch.isin(contexts, reduced_draft.d2t)
    assert float(in_draft_vocab.float().mean()) < 0.5, "the contexts should be mostly outside the draft vocabulary"
    unk_drafts = int((reduced_tokens == UNK).sum())
    assert 4 <= unk_drafts < reduced_tokens.numel() // 2, f"{unk_drafts} <unk> drafts: the tie case must occur, among others"
    assert torch.equal(full_tokens, reduced_tokens)
    assert torch.equal(hf_tokens, reduced_tokens)


def test_naive_scatter_with_zero_rows_drafts_differently(tiny_target, reduced_draft, contexts, tmp_path):
    """Negative control: draft rows at their target ids and zeros elsewhere is NOT the same draft."""
    full_dir = expand_draft_vocabulary(reduced_draft, tiny_target, tmp_path / "full")
    naive_dir = tmp_path / "naive"
    shutil.copytree(full_dir, naive_dir)
    tensors = load_file(str(naive_dir / "model.safetensors"))
    outside = torch.ones(int(tiny_target.model.vocab_size), dtype=torch.bool)
    outside[reduced_draft.d2t] = False
    tensors["model.embed_tokens.weight"][outside] = 0
    save_file(tensors, str(naive_dir / "model.safetensors"), metadata={"format": "pt"})
    reduced_tokens, _ = reduced_draft.sample_batch(contexts, GAMMA, GREEDY, None)
    naive_tokens = hf_greedy_drafts(naive_dir, contexts, GAMMA)
    assert not torch.equal(naive_tokens, reduced_tokens)


def test_a_token_outside_the_draft_vocabulary_below_the_fallback_is_refused(tiny_target, tmp_path):
    d2t = torch.tensor([0, 2, 3, *range(10, 71)])  # bos (1) is missing and lies below the <unk> fallback (3)
    drafter = make_drafter(str(write_reduced_draft(tiny_target, tmp_path / "draft", d2t)), tiny_target)
    with pytest.raises(ValueError, match="below its fallback token 3"):
        expand_draft_vocabulary(drafter, tiny_target, tmp_path / "full")
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["vocab_size"] == 64


def test_head_lanes_run_in_specgate_only_and_pair_with_the_assisted_lanes(tiny_target, reduced_draft):
    """assisted_lanes(head=...) adds one own lane per gamma with that drafter (transformers cannot load a head on
    hidden states), paired with transformers' assisted lane of the same gamma, its greedy and its defaults; the
    lane runs the drafter for real and its greedy tokens equal the own baseline's."""
    from specgate.bench.assisted import HF_DEFAULTS_LANE, assisted_lanes

    lanes, pairs, same_draft = assisted_lanes(tiny_target, None, reduced_draft, reduced_draft, None, [2, 3], True, head=reduced_draft)
    assert [lane for lane in lanes if "--draft default" in lane] == ["own --draft default g2", "own --draft default g3"]
    for g in (2, 3):
        assert {(f"own --draft default g{g}", f"transformers assisted full-vocab copy g{g}"), (f"own --draft default g{g}", "transformers greedy"),
                (f"own --draft default g{g}", HF_DEFAULTS_LANE)} <= set(pairs)
    assert not any("--draft default" in a or "--draft default" in b for a, b in same_draft)
    prompt = [5, 9, 17, 33, 65, 129]
    run, baseline = lanes["own --draft default g3"](prompt, 12), lanes["own baseline"](prompt, 12)
    assert run["tokens"] == baseline["tokens"] and run["drafted"] > 0
    without, _, _ = assisted_lanes(tiny_target, None, reduced_draft, reduced_draft, None, [2], True)
    assert not any("--draft default" in lane for lane in without)
