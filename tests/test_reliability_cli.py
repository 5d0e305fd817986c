"""Bad input to the CLI and the library: one line `error: ...` naming the value and the fix, exit 2, no traceback.

Each case runs the real console entry point (specgate.cli.main.main) in-process on real tiny model dirs;
two cases also run `python -m specgate` in a subprocess to show the process itself prints no traceback.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from specgate.cli.main import main

LONG_PROMPT = "x " * 1500  # ~3000 tokens: past the tiny models' 1024-position context


@pytest.fixture(scope="module")
def dirs(tiny_model_dir, tmp_path_factory):
    files = tmp_path_factory.mktemp("prompts")
    (files / "empty.txt").write_text("", encoding="utf-8")
    (files / "latin1.txt").write_bytes(b"caf\xe9 au lait")
    return {
        "target": str(tiny_model_dir("llama")),
        "other_tokenizer": str(tiny_model_dir("llama", tokenizer="other")),
        "other_vocab": str(tiny_model_dir("llama", vocab_size=256)),
        "empty": str(files / "empty.txt"),
        "latin1": str(files / "latin1.txt"),
    }


CASES = [
    # (argv with {placeholders}, substrings the one error line must contain)
    (["model", "--alpha", "1.5", "--gamma", "3", "--c", "0.1"], ["alpha=1.5", "[0, 1]"]),
    (["model", "--alpha", "nan", "--gamma", "3", "--c", "0.1"], ["alpha=nan"]),
    (["model", "--alpha", "0.5", "--gamma", "0", "--c", "0.1"], ["gamma=0", "at least 1"]),
    (["model", "--alpha", "0.5", "--gamma", "3", "--c", "-1"], ["c=-1", "[0, inf)"]),
    (["model", "--alpha", "0.5", "--gamma", "3", "--c", "inf"], ["c=inf"]),
    (["simulate", "--alpha", "2", "--gamma", "3", "--c", "0.1"], ["alpha=2"]),
    (["generate", "--target", "/nonexistent/model", "--prompt", "hi"], ["/nonexistent/model", "not found", "local"]),
    (["generate", "--target", "{target}", "--draft", "/nonexistent/draft", "--prompt", "hi"], ["/nonexistent/draft", "not found"]),
    (["generate", "--target", "{target}", "--draft", "{other_tokenizer}", "--prompt", "hi"], ["different tokenizer", "same model family"]),
    (["generate", "--target", "{target}", "--draft", "{other_vocab}", "--prompt", "hi"], ["different tokenizer", "256 vs 512"]),
    (["generate", "--target", "{target}", "--prompt", ""], ["prompt is empty", "non-empty"]),
    (["generate", "--target", "{target}", "--prompt-file", "{empty}"], ["prompt is empty"]),
    (["generate", "--target", "{target}", "--prompt-file", "{latin1}"], ["not UTF-8", "byte 3"]),
    (["generate", "--target", "{target}", "--prompt", LONG_PROMPT], ["context is 1024", "shorten the prompt to at most 1023"]),
    (["generate", "--target", "{target}", "--prompt", "hi", "--max-new-tokens", "0"], ["max_new_tokens=0", ">= 1"]),
    (["generate", "--target", "{target}", "--prompt", "hi", "--max-new-tokens", "5000"], ["max_new_tokens=5000", "use max_new_tokens <="]),
    (["generate", "--target", "{target}", "--prompt", "hi", "--gamma", "-1"], ["--gamma -1", ">= 0"]),
    (["generate", "--target", "{target}", "--prompt", "hi", "--temperature", "nan"], ["temperature=nan"]),
    (["check-lossless", "--target", "{target}", "--draft", "{other_tokenizer}"], ["different tokenizer"]),
    (["serve", "--target", "{target}", "--request-timeout-s", "-1"], ["--request-timeout-s -1", "seconds > 0"]),
    (["serve", "--target", "{target}", "--max-body-bytes", "0"], ["--max-body-bytes 0"]),
    (["serve", "--target", "{target}", "--port", "70000"], ["--port 70000", "0..65535"]),
    (["serve", "--target", "{target}", "--draft", "{other_vocab}", "--policy", "off"], ["different tokenizer"]),
]


@pytest.mark.parametrize("argv, needles", CASES, ids=[" ".join(c[0][:3]) + f" #{i}" for i, c in enumerate(CASES)])
def test_bad_input_is_one_line_exit_2(argv, needles, dirs, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([arg.format(**dirs) if arg.startswith("{") else arg for arg in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exit_info.value.code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.mark.parametrize("argv", [["generate", "--target", "{target}", "--draft", "{other_vocab}", "--prompt", "hi"], ["generate", "--target", "{target}", "--prompt", ""]])
def test_the_process_prints_no_traceback(argv, dirs):
    out = subprocess.run([sys.executable, "-m", "specgate", *[a.format(**dirs) for a in argv]], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr and out.stderr.startswith("error:"), out.stderr


def test_library_raises_value_errors_naming_the_value(dirs):
    from specgate import theory
    from specgate.drafting import NoDrafter, make_drafter
    from specgate.engine import generate
    from specgate.models import load_model
    from specgate.sampling import SamplingParams

    target = load_model(dirs["target"])
    greedy = SamplingParams(temperature=0.0)
    for kwargs, needle in (
        (dict(prompt=""), "prompt is empty"),
        (dict(prompt=[]), "prompt is empty"),
        (dict(prompt=LONG_PROMPT), "shorten the prompt"),
        (dict(prompt="hi", max_new_tokens=0), "max_new_tokens=0"),
        (dict(prompt="hi", max_new_tokens=2000), "max_new_tokens=2000"),
        (dict(prompt="hi", gamma=-3), "gamma=-3"),
    ):
        args = {"prompt": "hi", "gamma": 0, "max_new_tokens": 4, **kwargs}
        with pytest.raises(ValueError, match=needle):
            generate(args["prompt"], target, NoDrafter(), args["gamma"], greedy, max_new_tokens=args["max_new_tokens"])
    with pytest.raises(ValueError, match="different tokenizer"):
        make_drafter(dirs["other_vocab"], target)
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_model("/nonexistent/model")
    for call, needle in ((lambda: theory.speedup(1.5, 3, 0.1), "alpha=1.5"), (lambda: theory.speedup(0.5, 0, 0.1), "gamma=0"),
                         (lambda: theory.speedup(0.5, 3, -0.1), "c=-0.1"), (lambda: theory.speedup(float("nan"), 3, 0.1), "alpha=nan")):
        with pytest.raises(ValueError, match=needle):
            call()
    with pytest.raises(ValueError, match="prompt token ids"):
        from specgate.serving import Request, Scheduler

        Scheduler(target, "none", num_slots=1, max_seq_len=64).submit(Request(torch.tensor([10**6]), greedy, max_tokens=2))
