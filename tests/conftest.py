"""Shared fixtures: the real Gemma-3-270M (loaded once per session) and tiny random HF models on disk.

tiny_model_dir(family, vocab_size=None, tokenizer="default", seed=0) -> Path
    Writes (once per argument tuple per session) a tiny randomly initialised Hugging Face causal LM with
    save_pretrained (config.json + model.safetensors) and a matching tokenizer (tokenizer.json,
    tokenizer_config.json), and returns the directory. load_model(str(dir)) and transformers'
    AutoModelForCausalLM / AutoTokenizer both load it.
    - family: "llama", "qwen2" (q/k/v biases, tied head), "mistral" (sliding window 8 on every layer) or
      "gemma3" (Gemma3ForCausalLM text model: layer 0 sliding with window 8, layer 1 global).
      All: 2 layers, hidden 64, 4 query heads and 2 KV heads (GQA), head_dim 16, max_position_embeddings 1024.
    - vocab_size: model and tokenizer vocabulary size (default 512; at least 128).
    - tokenizer: "default", or "other": a different tokenizer of the same size (trained on different text, so
      the same ids mean different strings), e.g. to check that a draft with another tokenizer is refused.
    - seed: the weights' seed (the tokenizer does not depend on it). Weights are drawn wider than HF's
      default init (std 0.15, random norm gains and biases) so next-token distributions are not near uniform.
    Tokenizer: a BPE over characters (Metaspace, like SentencePiece) trained deterministically by the
    `tokenizers` library; ids 0..3 are <pad>, <s> (bos), </s> (eos), <unk>; encoding with
    add_special_tokens=True (the default) prepends <s>, like Llama and Gemma tokenizers. Printable ASCII
    always encodes without <unk>; other characters become <unk>.

Skips (tests/ci_skips.py): every session ends with a count of its skips by reason; under CI (env CI set) a skip
of a test this machine can run (the native kernel on x86-64 with AVX2/FMA and a C compiler, the Chromium report
test on Debian with apt-get) fails the session.
"""

from __future__ import annotations

import random
import string
from pathlib import Path

import pytest
import torch
from ci_skips import Skip, hidden_skips, machine_facts, skip_reason, skip_summary, under_ci

TINY_FAMILIES = ("llama", "qwen2", "mistral", "gemma3")
TINY_SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0, 1, 2, 3
TINY_SLIDING_WINDOW = 8

_BASE_TEXT = """The quick brown fox jumps over the lazy dog. Speculative decoding drafts a few tokens with a
small model and verifies them with the large one in a single forward pass; rejected drafts are resampled
from the residual distribution, so the output distribution is exactly the target's.
def generate(prompt, max_new_tokens=16):
    tokens = tokenize(prompt)
    for step in range(max_new_tokens):
        logits = model(tokens)[-1]
        tokens.append(int(logits.argmax()))
    return detokenize(tokens)
Once upon a time there was a little robot who liked to count: one, two, three, four, five, six, seven.
"""
_SYLLABLES = {
    "default": ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "de", "ga", "ban", "tor", "vel", "quin", "sha"],
    "other": ["zu", "xe", "wy", "jo", "qi", "fu", "hy", "bo", "cy", "ux", "yev", "zal", "krum", "ploo", "ith"],
}


def _training_text(kind: str, vocab_size: int) -> list[str]:
    """Deterministic training lines: printable ASCII (so it always encodes), prose/code, seeded pseudo-words."""
    rng = random.Random(f"specgate-tiny-tokenizer-{kind}")
    syllables = _SYLLABLES[kind]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(40 * vocab_size)]
    lines = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    base = _BASE_TEXT.splitlines() if kind == "default" else [line[::-1] for line in _BASE_TEXT.splitlines()]
    return [string.printable, *base * 20, *lines]


def build_tiny_tokenizer(vocab_size: int, kind: str = "default"):
    """A PreTrainedTokenizerFast with exactly vocab_size tokens (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if kind not in _SYLLABLES:
        raise ValueError(f"tokenizer={kind!r}: use 'default' or 'other'")
    if vocab_size < 128:
        raise ValueError(f"vocab_size={vocab_size}: the tiny tokenizer needs at least 128 (characters + specials)")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=TINY_SPECIAL_TOKENS, limit_alphabet=1000, show_progress=False)
    tokenizer.train_from_iterator(_training_text(kind, vocab_size), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tiny tokenizer reached {tokenizer.get_vocab_size()} tokens, not {vocab_size}: add training text")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )


def tiny_config(family: str, vocab_size: int = 512):
    """The transformers config of a tiny model of `family` (see the module docstring)."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    if family == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=TINY_SLIDING_WINDOW, tie_word_embeddings=False)
    if family == "gemma3":
        return Gemma3TextConfig(
            **common, sliding_window=TINY_SLIDING_WINDOW, layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=24, rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            },
        )
    raise ValueError(f"family={family!r}: use one of {', '.join(TINY_FAMILIES)}")


def randomize_(model: torch.nn.Module, seed: int, std: float = 0.15) -> torch.nn.Module:
    """Redraw every parameter (norm gains around their identity value) so outputs are far from uniform."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * std
            is_gemma_norm = "norm" in name and type(model).__name__.startswith("Gemma")
            param.copy_(noise if is_gemma_norm or "norm" not in name else 1.0 + noise)
    return model


def write_tiny_model(out_dir: Path, family: str, vocab_size: int = 512, tokenizer: str = "default", seed: int = 0) -> Path:
    """Write a tiny random model + tokenizer to out_dir (the body of the tiny_model_dir fixture)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, vocab_size)
    torch.manual_seed(seed)
    model = randomize_(AutoModelForCausalLM.from_config(config), seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tiny_tokenizer(vocab_size, tokenizer).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: tiny_model_dir(family, vocab_size=None, tokenizer="default", seed=0) -> Path (module docstring)."""
    made: dict[tuple, Path] = {}

    def make(family: str, vocab_size: int | None = None, tokenizer: str = "default", seed: int = 0) -> Path:
        key = (family, vocab_size or 512, tokenizer, seed)
        if key not in made:
            out = tmp_path_factory.mktemp(f"tiny-{family}-{key[1]}-{tokenizer}-{seed}")
            made[key] = write_tiny_model(out, family, key[1], tokenizer, seed)
        return made[key]

    return make


@pytest.fixture(scope="session")
def gemma():
    """The embedded Gemma-3-270M in specgate's runtime, float32 (converted from the packaged GGUF on first use)."""
    from specgate.models import load_model

    return load_model("gemma-3-270m")


def recipe_draft_info(target, d2t: torch.Tensor) -> dict:
    """The specgate_draft.json fields of a test draft over the target ids d2t (what the recipe writes)."""
    from specgate.drafting.model_drafter import vocab_fingerprint

    special = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    return {
        "target": target.name,
        "target_vocab_size": int(target.model.vocab_size),
        "target_special_ids": {name: getattr(target.tokenizer, name) for name in special},
        "draft_vocab_sha256": vocab_fingerprint(target.tokenizer.convert_ids_to_tokens(d2t.tolist())),
        "recipe": "test",
    }


def read_json_object(proc) -> dict:
    """The first JSON object a subprocess prints on stdout (possibly over several lines), e.g. `serve --json`."""
    import json

    text = ""
    while True:
        line = proc.stdout.readline()
        assert line, f"serve exited early: {proc.stderr.read()}"
        text += line
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            continue


_SKIPS: list[Skip] = []
_HIDDEN: list[str] = []


def _note_skip(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):  # an xfail is reported as skipped too: not a skip
        _SKIPS.append(Skip(report.nodeid, skip_reason(report)))


def pytest_runtest_logreport(report) -> None:
    _note_skip(report)


def pytest_collectreport(report) -> None:  # a module skipped as a whole
    _note_skip(report)


def pytest_sessionfinish(session, exitstatus) -> None:
    """Under CI, a skip that this machine did not need fails the session (tests/ci_skips.py)."""
    if under_ci():
        _HIDDEN[:] = hidden_skips(machine_facts(), _SKIPS)
        if _HIDDEN and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    if _SKIPS:
        terminalreporter.section("skips by reason")
        for line in skip_summary(_SKIPS):
            terminalreporter.write_line(line)
    if _HIDDEN:
        terminalreporter.section("skips CI cannot accept (env CI is set): the session fails", red=True)
        for line in _HIDDEN:
            terminalreporter.write_line(line)


class StepGate:
    """Holds a scheduler's model thread inside a step until the test opens the gate (an event, not a timer).

    `with StepGate(scheduler, when) as gate:` wraps the target model's forward; the first forward called while
    `when(scheduler)` is true (on the model thread) sets `gate.held` and waits for `gate.open()`. A test can then
    act while a request is known to be mid-flight (disconnect, fill the queue, stop the engine) however fast the
    host decodes. Leaving the block opens the gate and restores the forward. A gate never opened raises in the
    model thread after timeout_s (the step fails its requests), so a broken test fails instead of hanging.
    """

    def __init__(self, scheduler, when, timeout_s: float = 60.0) -> None:
        import threading

        self.scheduler, self.when, self.timeout_s = scheduler, when, timeout_s
        self.held, self.opened = threading.Event(), threading.Event()
        self.model = scheduler.target.model

    def __enter__(self) -> "StepGate":
        self.real_forward = self.model.forward
        self.patched = "forward" not in vars(self.model)  # the class's forward: remove ours on exit
        self.model.forward = self._forward
        return self

    def __exit__(self, *exc) -> None:
        self.opened.set()
        if self.patched:
            del self.model.forward
        else:
            self.model.forward = self.real_forward

    def open(self) -> None:
        self.opened.set()

    def _forward(self, *args, **kwargs):
        if not self.opened.is_set() and self.when(self.scheduler):
            self.held.set()
            if not self.opened.wait(self.timeout_s):
                raise RuntimeError(f"StepGate: the test did not open the gate within {self.timeout_s} s")
        return self.real_forward(*args, **kwargs)


def has_text(scheduler) -> bool:
    """A StepGate condition: some running request has final text (a streaming client has had its first chunk)."""
    return any(request.text for request in scheduler.running)
