"""Gemma-3-270M's shipped drafts (`--draft default`: the EAGLE head; the small draft model, by path) and the
recipe-built draft format (reduced vocabulary, no tokenizer).

Fast tests build a tiny recipe-format draft from the tiny Gemma-3 fixture with the recipe's own functions
(specgate.drafting.distill) and check loading, the map checks and exact greedy output. Slow tests load the
shipped drafts against the real Gemma-3-270M.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specgate.drafting import DEFAULT_DRAFTS, NoDrafter, make_drafter
from specgate.drafting import distill
from specgate.drafting.eagle_drafter import EagleDrafter
from specgate.drafting.registry import DRAFT_MODEL_DIRS, EAGLE_HEADS, EAGLE_PREFIX
from specgate.drafting.model_drafter import DRAFT_INFO_FILE, VOCAB_MAP_FILE, VOCAB_MAP_KEY, ModelDrafter, load_draft_dir
from specgate.engine import generate
from specgate.models import load_model
from specgate.sampling import SamplingParams

from conftest import recipe_draft_info
from test_eagle_drafting import count_draft_kinds

MAX_DRAFT_BYTES = 30_000_000
SHIPPED = DRAFT_MODEL_DIRS["gemma-3-270m"]  # the small draft model, reachable by path


def write_recipe_draft(target, out_dir: Path, vocab_size: int) -> Path:
    """A 1-layer reduced-vocabulary draft of `target` in the recipe's format (untrained: its layer 0)."""
    always = (0, 1, 2, 3)
    rest = torch.randperm(int(target.model.vocab_size) - 4, generator=torch.Generator().manual_seed(0))[: vocab_size - 4] + 4
    d2t = torch.cat([torch.tensor(always), rest]).sort().values
    config = distill.student_config(target.model.config, [0], vocab_size)
    student = distill.build_student(config, distill.student_state_from_target(target.model, [0], d2t))
    info = recipe_draft_info(target, d2t)
    distill.save_student(student, config, d2t, out_dir, info)
    return out_dir


@pytest.fixture(scope="module")
def tiny_gemma(tiny_model_dir):
    return load_model(str(tiny_model_dir("gemma3")))


@pytest.fixture(scope="module")
def tiny_recipe_draft(tiny_gemma, tmp_path_factory):
    return write_recipe_draft(tiny_gemma, tmp_path_factory.mktemp("recipe_draft") / "tiny-default", vocab_size=128)


def test_recipe_draft_loads_with_the_targets_tokenizer_and_its_map(tiny_gemma, tiny_recipe_draft):
    assert not list(tiny_recipe_draft.glob("tokenizer*")), "a recipe draft ships no tokenizer"
    drafter = make_drafter(str(tiny_recipe_draft), tiny_gemma)
    assert isinstance(drafter, ModelDrafter)
    assert drafter.draft.tokenizer is tiny_gemma.tokenizer
    assert drafter.num_outputs == 128
    assert torch.equal(drafter.d2t, load_file(str(tiny_recipe_draft / VOCAB_MAP_FILE))[VOCAB_MAP_KEY])


@pytest.mark.parametrize("gamma", [1, 3])
def test_recipe_draft_is_exact_in_greedy(tiny_gemma, tiny_recipe_draft, gamma):
    params = SamplingParams(temperature=0.0)
    prompt = "The quick brown fox jumps over"
    baseline = generate(prompt, tiny_gemma, NoDrafter(), 0, params, max_new_tokens=24)
    speculative = generate(prompt, tiny_gemma, make_drafter(str(tiny_recipe_draft), tiny_gemma), gamma, params, max_new_tokens=24)
    assert speculative.tokens == baseline.tokens
    assert speculative.stats.drafted_tokens > 0


def _tampered(source: Path, tmp_path: Path, d2t=None, info_update=None) -> Path:
    out = tmp_path / "tampered"
    shutil.copytree(source, out)
    if d2t is not None:
        save_file({VOCAB_MAP_KEY: d2t}, str(out / VOCAB_MAP_FILE))
    if info_update:
        info = json.loads((out / DRAFT_INFO_FILE).read_text())
        (out / DRAFT_INFO_FILE).write_text(json.dumps({**info, **info_update}))
    return out


def _map(draft_dir: Path) -> torch.Tensor:
    return load_file(str(draft_dir / VOCAB_MAP_FILE))[VOCAB_MAP_KEY].clone()


@pytest.mark.parametrize(
    "change, message",
    [
        ("swap", "name different tokens"),  # right size, in range, distinct, but the ids mean other tokens
        ("duplicate", "one-to-one"),
        ("out_of_range", "outside the target vocabulary"),
        ("short", "exactly one target id per draft output"),
        ("vocab_size", "target vocabulary of 262144"),
        ("special", "expects eos_token_id=99"),
    ],
)
def test_a_mismatched_map_is_refused_with_a_clear_error(tiny_gemma, tiny_recipe_draft, tmp_path, change, message):
    d2t, info_update = _map(tiny_recipe_draft), None
    if change == "swap":
        d2t[[10, 11]] = d2t[[11, 10]]
    elif change == "duplicate":
        d2t[10] = d2t[11]
    elif change == "out_of_range":
        d2t[-1] = int(tiny_gemma.model.vocab_size)
    elif change == "short":
        d2t = d2t[:-1]
    elif change == "vocab_size":
        d2t, info_update = None, {"target_vocab_size": 262144}
    elif change == "special":
        d2t, info_update = None, {"target_special_ids": {"eos_token_id": 99}}
    bad = _tampered(tiny_recipe_draft, tmp_path, d2t, info_update)
    with pytest.raises(ValueError, match=message):
        make_drafter(str(bad), tiny_gemma)


def test_the_shipped_draft_fits_the_size_budget_in_bf16():
    files = {path.name: path.stat().st_size for path in SHIPPED.iterdir() if path.is_file()}
    assert {"config.json", "model.safetensors", VOCAB_MAP_FILE, DRAFT_INFO_FILE} <= set(files)
    assert sum(files.values()) <= MAX_DRAFT_BYTES, f"{files} exceed {MAX_DRAFT_BYTES} bytes"
    with safe_open(str(SHIPPED / "model.safetensors"), framework="pt") as handle:
        assert {handle.get_slice(key).get_dtype() for key in handle.keys()} == {"BF16"}
    assert json.loads((SHIPPED / DRAFT_INFO_FILE).read_text())["target"] == "gemma-3-270m"


def test_gemmas_default_draft_is_its_shipped_eagle_head_within_the_size_bound_with_a_model_card():
    head_dir = EAGLE_HEADS["gemma-3-270m"]
    assert DEFAULT_DRAFTS["gemma-3-270m"] == EAGLE_PREFIX + str(head_dir)
    files = {f.name: f.stat().st_size for f in head_dir.iterdir()}
    assert {"eagle_head.safetensors", "eagle_config.json", VOCAB_MAP_FILE, "README.md"} <= set(files)
    assert sum(files.values()) <= MAX_DRAFT_BYTES, f"{files} exceed {MAX_DRAFT_BYTES} bytes"
    card = (head_dir / "README.md").read_text()
    for section in ("## Held-out acceptance", "## End to end", "## Limits", "training steps"):
        assert section in card, f"the model card lacks {section!r}"


@pytest.mark.slow
def test_the_shipped_heads_sample_temperature_is_its_calibration_and_the_command_rewrites_a_copy(tmp_path):
    """The shipped head's sample_temperature is the recorded calibration's choice, the best of its table; the
    calibrate command on a copy (2 short windows) writes a choice from its grid with the table it came from."""
    import subprocess
    import sys

    from specgate.drafting import eagle
    from specgate.drafting.eagle_train import CALIBRATION_TEMPERATURES

    head_dir = EAGLE_HEADS["gemma-3-270m"]
    info = json.loads((head_dir / eagle.HEAD_CONFIG_FILE).read_text())
    calibration = info["metadata"]["calibration"]
    assert info["config"]["sample_temperature"] == calibration["chosen"] != 1.0
    lengths = calibration["acceptance_length"]
    assert calibration["temperatures"][lengths.index(max(lengths))] == calibration["chosen"]
    copy = tmp_path / "head"
    shutil.copytree(head_dir, copy)
    info["config"]["sample_temperature"] = 1.0
    del info["metadata"]["calibration"]
    (copy / eagle.HEAD_CONFIG_FILE).write_text(json.dumps(info))
    run = subprocess.run([sys.executable, "-m", "specgate.drafting.eagle_train", "calibrate", "--head-dir", str(copy), "--windows", "2",
                          "--window-len", "24", "--gamma", "2"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    written = json.loads((copy / eagle.HEAD_CONFIG_FILE).read_text())
    result = written["metadata"]["calibration"]
    assert result["windows"] == 2 and result["window_len"] == 24 and len(result["rates"][0]) == 2
    assert written["config"]["sample_temperature"] == result["chosen"] == json.loads(run.stdout)["chosen"]
    assert result["chosen"] in CALIBRATION_TEMPERATURES and all(0.0 < rate < 1.0 for row in result["rates"] for rate in row)


@pytest.mark.slow
def test_default_on_gemma_is_the_eagle_head_and_exact_in_greedy(gemma):
    drafter = make_drafter("default", gemma)
    assert isinstance(drafter, EagleDrafter)
    params = SamplingParams(temperature=0.0)
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    baseline = generate(prompt, gemma, NoDrafter(), 0, params, max_new_tokens=48)
    kinds = count_draft_kinds(drafter)  # lookups (no head step) where the code repeats itself, the head elsewhere
    speculative = generate(prompt, gemma, drafter, 4, params, max_new_tokens=48)
    assert speculative.tokens == baseline.tokens
    assert speculative.stats.acceptance_length > 1.5  # a trained head: most steps emit more than the target's token
    assert kinds["head"] > 0 and kinds["lookup"] > 0, kinds
    drafter = make_drafter("default", gemma)
    drafter.lookup_min_n = 0  # the head alone
    alone = generate(prompt, gemma, drafter, 4, params, max_new_tokens=48)
    assert alone.tokens == baseline.tokens and alone.stats.acceptance_length > 1.3


@pytest.mark.slow
def test_the_shipped_draft_model_loads_by_path_with_a_consistent_map(gemma):
    drafter = make_drafter(str(SHIPPED), gemma)
    assert isinstance(drafter, ModelDrafter)
    config = json.loads((SHIPPED / "config.json").read_text())
    d2t = drafter.d2t
    assert d2t.numel() == config["vocab_size"] == drafter.num_outputs
    assert int(d2t.min()) >= 0 and int(d2t.max()) < gemma.model.vocab_size
    assert torch.unique(d2t).numel() == d2t.numel()
    for special in (gemma.tokenizer.bos_token_id, gemma.tokenizer.eos_token_id, gemma.tokenizer.unk_token_id):
        assert bool((d2t == special).any())
    assert drafter.draft.model.dtype == gemma.model.dtype  # draft computes in the target's dtype


@pytest.mark.slow
def test_the_shipped_draft_is_exact_in_greedy_on_gemma(gemma):
    params = SamplingParams(temperature=0.0)
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    baseline = generate(prompt, gemma, NoDrafter(), 0, params, max_new_tokens=32)
    speculative = generate(prompt, gemma, make_drafter(str(SHIPPED), gemma), 3, params, max_new_tokens=32)
    assert speculative.tokens == baseline.tokens
    assert speculative.stats.accepted_tokens > 0  # a trained draft: some drafts survive on plain code


def test_the_shipped_draft_refuses_a_target_with_another_vocabulary(tiny_gemma):
    with pytest.raises(ValueError, match="target vocabulary of 262144"):
        load_draft_dir(SHIPPED, tiny_gemma)
