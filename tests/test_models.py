"""specgate.models on tiny random Llama, Qwen2, Mistral and Gemma-3 models: logits equal transformers' eager
reference, and the position-indexed KV cache gives the same logits however the tokens are fed (whole prompt,
token by token, G+1-token chunks, ragged batches, over stale drafts).

Tolerances (float32): against transformers, max |diff| <= 1e-4 on logits of magnitude ~5 (REF_ATOL); between
two runs of our own runtime that differ only in batching or chunking, max |diff| <= 1e-5 (SELF_ATOL).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_FAMILIES, TINY_SLIDING_WINDOW, build_tiny_tokenizer

from specgate.models import CausalLM, KVCache, load_model

REF_ATOL = 1e-4
SELF_ATOL = 1e-5
VOCAB = 512


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def pair(request, tiny_model_dir):
    """(our LoadedModel, transformers eager model) for one tiny family, same weights, float32."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(request.param)
    reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    return load_model(str(path)), reference


def tokens(length: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(4, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))  # [B, T]


def reference_logits(reference, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference(ids).logits.float()  # [B, T, V]


def run(model: CausalLM, ids: torch.Tensor, start: int, cache: KVCache, slot: int = 0, **kwargs) -> torch.Tensor:
    """Feed ids [1, T] at positions start.. into one slot."""
    positions = torch.arange(start, start + ids.shape[1])[None]  # [1, T]
    return model(ids, positions, cache, torch.tensor([slot]), **kwargs)


def close(actual: torch.Tensor, expected: torch.Tensor, atol: float) -> None:
    diff = (actual - expected).abs().max().item()
    assert diff <= atol, f"max |diff| {diff:.3g} > {atol}"


def test_full_prompt_matches_transformers(pair):
    model, reference = pair
    ids = tokens(3 * TINY_SLIDING_WINDOW)  # longer than the sliding window
    logits = run(model.model, ids, 0, model.model.new_cache(1, 64))
    assert logits.dtype == torch.float32 and logits.shape == (1, ids.shape[1], VOCAB)
    close(logits, reference_logits(reference, ids), REF_ATOL)


def test_incremental_decode_matches_transformers(pair):
    model, reference = pair
    ids = tokens(22, seed=1)
    expected = reference_logits(reference, ids)
    cache = model.model.new_cache(1, 32)
    prefill = run(model.model, ids[:, :5], 0, cache)
    close(prefill, expected[:, :5], REF_ATOL)
    for position in range(5, ids.shape[1]):  # past the window: local layers must drop the oldest keys
        step = run(model.model, ids[:, position : position + 1], position, cache, last_only=True)  # [1, V]
        close(step, expected[:, position], REF_ATOL)


def test_chunk_of_g_plus_one_equals_token_by_token(pair):
    model, _ = pair
    ids = tokens(16, seed=2)
    chunked = model.model.new_cache(1, 16)
    run(model.model, ids[:, :6], 0, chunked)
    chunk = run(model.model, ids[:, 6:11], 6, chunked)  # G + 1 = 5 tokens scored in one call  [1, 5, V]
    single = model.model.new_cache(1, 16)
    run(model.model, ids[:, :6], 0, single)
    steps = torch.stack([run(model.model, ids[:, p : p + 1], p, single)[:, 0] for p in range(6, 11)], dim=1)  # [1, 5, V]
    close(chunk, steps, SELF_ATOL)


def test_ragged_batch_equals_each_row_alone(pair):
    """Rows with different slots (not in order), start positions and lengths, padded with -1, in one call."""
    model = pair[0].model
    histories = {2: tokens(7, seed=3), 0: tokens(0, seed=4), 1: tokens(12, seed=5)}  # slot -> tokens already cached
    new = {2: tokens(4, seed=6), 0: tokens(3, seed=7), 1: tokens(1, seed=8)}  # slot -> tokens of this call
    order = [2, 0, 1]
    cache = model.new_cache(3, 24)
    for slot, history in histories.items():
        if history.shape[1]:
            run(model, history, 0, cache, slot=slot)
    width = max(new[s].shape[1] for s in order)
    ids = torch.full((3, width), -1)  # [B, T]
    positions = torch.full((3, width), -1)  # [B, T]
    for row, slot in enumerate(order):
        n, start = new[slot].shape[1], histories[slot].shape[1]
        ids[row, :n], positions[row, :n] = new[slot][0], torch.arange(start, start + n)
    logits, hidden = model(ids, positions, cache, torch.tensor(order), return_hidden=True)  # [B, T, V], [B, T, H]
    last = model(ids, positions, model.new_cache(3, 24), torch.tensor(order), last_only=True)  # [B, V]: no history
    assert hidden.shape == (3, width, model.args.hidden_size) and last.shape == (3, VOCAB)
    for row, slot in enumerate(order):
        alone = model.new_cache(1, 24)
        full = torch.cat([histories[slot], new[slot]], dim=1)
        expected = run(model, full, 0, alone)[:, histories[slot].shape[1] :]  # [1, n, V]
        n = new[slot].shape[1]
        close(logits[row, :n], expected[0], SELF_ATOL)
    fresh = run(model, new[0], 0, model.new_cache(1, 24), last_only=True)  # slot 0 had no history
    close(last[1], fresh[0], SELF_ATOL)


def test_stale_drafts_are_overwritten_without_undo(pair):
    model = pair[0].model
    ids = tokens(18, seed=9)
    clean = run(model, ids, 0, model.new_cache(1, 24))
    cache = model.new_cache(1, 24)
    run(model, ids[:, :10], 0, cache)
    run(model, tokens(5, seed=10), 10, cache)  # rejected drafts at positions 10..14
    after = run(model, ids[:, 10:12], 10, cache)  # the real tokens: overwrite 10, 11; 12..14 still hold garbage
    close(after, clean[:, 10:12], SELF_ATOL)
    close(run(model, ids[:, 12:], 12, cache), clean[:, 12:], SELF_ATOL)


def test_return_hidden_is_the_final_norm_state(pair):
    model, reference = pair
    ids = tokens(9, seed=11)
    logits, hidden = run(model.model, ids, 0, model.model.new_cache(1, 16), return_hidden=True)
    with torch.no_grad():
        expected = reference(ids, output_hidden_states=True).hidden_states[-1]  # after the final norm
    close(hidden, expected, REF_ATOL)
    last, last_hidden = run(model.model, ids, 0, model.model.new_cache(1, 16), last_only=True, return_hidden=True)
    close(last, logits[:, -1], SELF_ATOL)
    close(last_hidden, hidden[:, -1], SELF_ATOL)


def test_bfloat16_computes_in_bf16_and_returns_float32(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir("gemma3")
    model = load_model(str(path), dtype=torch.bfloat16).model
    assert model.dtype == torch.bfloat16
    reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.bfloat16).eval()
    ids = tokens(12, seed=12)
    logits = run(model, ids, 0, model.new_cache(1, 16))
    assert logits.dtype == torch.float32
    expected = reference_logits(reference, ids)
    # bf16 keeps 8 bits of mantissa: allow 3% of the logit range
    close(logits, expected, 0.03 * float(expected.abs().max()))


def test_sharded_checkpoint_loads_the_same(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_dir("llama")
    AutoModelForCausalLM.from_pretrained(path).save_pretrained(tmp_path, max_shard_size="100KB")
    AutoTokenizer.from_pretrained(path).save_pretrained(tmp_path)
    assert len(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) > 1
    ids = tokens(6, seed=13)
    original = run(load_model(str(path)).model, ids, 0, KVCache(2, 1, 2, 8, 16))
    close(run(load_model(str(tmp_path)).model, ids, 0, KVCache(2, 1, 2, 8, 16)), original, 0.0)


def test_tiny_tokenizers(tiny_model_dir):
    """The fixture's tokenizers: vocabulary = model vocabulary, BOS prepended, deterministic, 'other' differs."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    assert len(tokenizer) == VOCAB
    text = "def f(x):\n    return x + 1  # Once upon a time"
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id == 1 and tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert build_tiny_tokenizer(VOCAB).get_vocab() == tokenizer.get_vocab()
    other = AutoTokenizer.from_pretrained(tiny_model_dir("llama", tokenizer="other"))
    assert len(other) == VOCAB and other.get_vocab() != tokenizer.get_vocab()
    small = AutoTokenizer.from_pretrained(tiny_model_dir("llama", vocab_size=256))
    assert len(small) == 256 and load_model(str(tiny_model_dir("llama", vocab_size=256))).model.vocab_size == 256


def test_bad_inputs_raise_clear_errors(tiny_model_dir, tmp_path):
    model = load_model(str(tiny_model_dir("llama"))).model
    cache = model.new_cache(2, 8)
    with pytest.raises(ValueError, match="position 8 does not fit in the KV cache of max_seq_len=8"):
        run(model, tokens(3), 6, cache)
    with pytest.raises(ValueError, match="slot 2 is out of range 0..1"):
        run(model, tokens(3), 0, cache, slot=2)
    with pytest.raises(ValueError, match=r"slots \[1, 1\] repeat a cache row"):
        model(tokens(2, batch=2), torch.zeros(2, 2, dtype=torch.int64), cache, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="token id 512 is out of range 0..511"):
        run(model, torch.tensor([[512]]), 0, cache)
    with pytest.raises(ValueError, match="max_position_embeddings=1024"):
        model.new_cache(1, 2000)
    with pytest.raises(FileNotFoundError, match="model 'no-such-model' not found: pass a local Hugging Face directory"):
        load_model("no-such-model")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported: supported model types are llama, mistral, qwen2, gemma3_text"):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="dtype=torch.int8 is not supported"):
        load_model(str(tiny_model_dir("llama")), dtype=torch.int8)


def test_rope_scaling_types(tiny_model_dir, tmp_path):
    """linear and llama3 RoPE scaling match transformers; an unsupported type is refused by name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    source = tiny_model_dir("llama")
    scalings = [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ]
    ids = tokens(20, seed=14)
    for i, scaling in enumerate(scalings):
        reference = LlamaForCausalLM.from_pretrained(source, attn_implementation="eager")
        reference.config.rope_parameters = {**scaling, "rope_theta": 10000.0}
        out = tmp_path / f"scaled{i}"
        reference.save_pretrained(out)
        AutoTokenizer.from_pretrained(source).save_pretrained(out)
        reference = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        model = load_model(str(out)).model
        close(run(model, ids, 0, model.new_cache(1, 24)), reference_logits(reference, ids), REF_ATOL)
    config = json.loads((tmp_path / "scaled0" / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (tmp_path / "scaled0" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        load_model(str(tmp_path / "scaled0"))


def write_llama_gguf(hf_dir, out_path):
    """Write a tiny Llama HF dir as a float32 .gguf the way llama.cpp's converter does (q/k rows permuted)."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    writer = gguf.GGUFWriter(str(out_path), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    vocab = tokenizer["model"]["vocab"]
    writer.add_tokenizer_model("llama")  # SentencePiece-style: our Metaspace BPE with its merges
    writer.add_token_list(sorted(vocab, key=vocab.get))
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_token_scores([0.0] * len(vocab))
    writer.add_token_types([3 if i < 4 else 1 for i in range(len(vocab))])  # 3 = control (the specials)
    writer.add_bos_token_id(1), writer.add_eos_token_id(2), writer.add_unk_token_id(3), writer.add_pad_token_id(0)

    def permute(weight, heads):  # llama.cpp's rotary layout; transformers undoes it on load
        return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)

    top = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm", "lm_head.weight": "output"}
    per_layer = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    }
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        array = tensor.float().numpy()
        if name in top:
            writer.add_tensor(f"{top[name]}.weight", array)
            continue
        _, _, layer, *rest = name.split(".")
        module = ".".join(rest[:-1])
        if module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config["num_attention_heads" if module == "self_attn.q_proj" else "num_key_value_heads"]
            array = permute(array, heads).copy()
        writer.add_tensor(f"blk.{layer}.{per_layer[module]}.weight", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def test_gguf_file_loads_like_its_hf_dir(tiny_model_dir, tmp_path):
    """A .gguf path goes through transformers' GGUF reader (config, tokenizer, de-quantised weights) into our runtime."""
    source = tiny_model_dir("llama")
    from_dir = load_model(str(source))
    from_gguf = load_model(str(write_llama_gguf(source, tmp_path / "tiny-llama.gguf")))
    assert from_gguf.name == "tiny-llama" and from_gguf.model.vocab_size == VOCAB
    text = "def f(x):\n    return x + 1  # Once upon a time"
    assert from_gguf.tokenizer(text).input_ids == from_dir.tokenizer(text).input_ids
    ids = tokens(12, seed=15)
    close(run(from_gguf.model, ids, 0, from_gguf.model.new_cache(1, 16)), run(from_dir.model, ids, 0, from_dir.model.new_cache(1, 16)), 0.0)


def test_gemma3_final_logit_softcapping(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = tiny_model_dir("gemma3")
    reference = AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager")
    reference.config.final_logit_softcapping = 2.0  # below the tiny model's logit range, so capping bites
    reference.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    model = load_model(str(tmp_path)).model
    ids = tokens(10, seed=16)
    logits = run(model, ids, 0, model.new_cache(1, 16))
    assert logits.abs().max() < 2.0
    close(logits, reference_logits(reference, ids), REF_ATOL)
