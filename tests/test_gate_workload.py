"""Workload parsing (specgate and Spec-Bench forms, math, text) and the gate CLI's input errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specgate.cli.main import app
from specgate.gate import workload


def test_builtin_workload_has_the_four_categories_and_balanced_takes():
    prompts = workload.load_prompts("builtin")
    assert {p.category for p in prompts} == set(workload.BUILTIN_CATEGORIES)
    assert len({p.id for p in prompts}) == len(prompts)
    two = workload.take_balanced(prompts, 2)
    assert len(two) == 8 and [p.category for p in two[:4]] == ["code", "prose", "grounded", "math"]
    math = workload.load_math("builtin")
    assert len(math) >= 20 and all(m.answer.lstrip("-").isdigit() for m in math)
    assert len(workload.load_text("builtin")) > 1000


def test_spec_bench_question_jsonl_is_accepted_as_is(tmp_path):
    path = tmp_path / "question.jsonl"
    rows = [{"question_id": 81, "category": "writing", "turns": ["Compose a travel blog post.", "Rewrite it."]},
            {"question_id": 82, "category": "math_reasoning", "turns": ["What is 2 + 2?"], "reference": ["4"]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    prompts = workload.load_prompts(path)
    assert [(p.id, p.category, p.prompt) for p in prompts] == [("81", "writing", "Compose a travel blog post."), ("82", "math_reasoning", "What is 2 + 2?")]


@pytest.mark.parametrize("bad, message", [
    ('{"prompt": "x", "category": "code"}\n{"prompt": "y", "category": \n', "line 2 is not valid JSON"),
    ('{"prompt": "x", "category": "code"}\n\n[1, 2]\n', "line 3 is a list"),
    ('{"prompt": "x"}\n', "line 1: 'category'"),
    ('{"text": "x", "category": "code"}\n', "line 1: needs 'prompt'"),
    ('{"turns": [], "category": "code"}\n', "line 1: 'turns'"),
    ('{"prompt": "x", "category": "code", "max_tokens": 0}\n', "line 1: 'max_tokens'"),
])
def test_malformed_workload_lines_are_named(tmp_path, bad, message):
    path = tmp_path / "w.jsonl"
    path.write_text(bad)
    with pytest.raises(ValueError, match=message):
        workload.load_prompts(path)


def test_gsm8k_answers_and_number_extraction(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text(json.dumps({"question": "Q?", "answer": "Natalia sold 48/2 = 24 clips.\n#### 1,072"}) + "\n")
    assert workload.load_math(path)[0].answer == "1072"
    assert workload.first_number(" 72.0 because 8 * 9") == "72" and workload.first_number("none") is None
    path.write_text(json.dumps({"question": "Q?"}) + "\n")
    with pytest.raises(ValueError, match="line 1 needs 'question'"):
        workload.load_math(path)


def test_cli_rejects_a_malformed_workload_and_an_unwritable_out_dir(tmp_path):
    from specgate.cli.main import main

    bad = tmp_path / "w.jsonl"
    bad.write_text('{"prompt": "a", "category": "code"}\nnot json\n')
    runner = CliRunner()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = runner.invoke(app, ["gate", "--out", str(blocker / "sub"), "--quick"], standalone_mode=False)
    assert isinstance(result.exception, ValueError) and "--out" in str(result.exception) and "writable" in str(result.exception)
    result = runner.invoke(app, ["gate", "--out", str(tmp_path / "o"), "--workload", str(bad), "--quick"], standalone_mode=False)
    assert isinstance(result.exception, ValueError) and "line 2" in str(result.exception)
    result = runner.invoke(app, ["gate", "--out", str(tmp_path / "o"), "--quick", "--target-concurrency", "3"], standalone_mode=False)
    assert "--target-concurrency 3" in str(result.exception)
    with pytest.raises(SystemExit) as exit_info:  # main(): one line on stderr, exit status 2
        main(["gate", "--out", str(blocker / "sub")])
    assert exit_info.value.code == 2
