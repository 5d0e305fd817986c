"""`specgate generate`: --json on a tiny model dir and on Gemma-3-270M, streaming, and bad input."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from specgate.cli.main import app

runner = CliRunner()


def test_json_on_a_tiny_model(tiny_model_dir, tmp_path):
    """Greedy (the default) n-gram speculation emits exactly the target's greedy tokens: the same command with
    speculation off, and transformers' own greedy generate on the same checkpoint, prompt and dtype."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = str(tiny_model_dir("llama"))
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("hello hello hello", encoding="utf-8")
    common = ["generate", "--target", model_dir, "--max-new-tokens", "12", "--seed", "1", "--dtype", "float32",
              "--prompt-file", str(prompt_file), "--json"]
    result = runner.invoke(app, [*common, "--draft", "ngram", "--gamma", "3"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out) == {"tokens", "text", "stats"}
    off = runner.invoke(app, [*common, "--draft", "none", "--gamma", "0"])
    assert off.exit_code == 0, off.output
    baseline = json.loads(off.stdout)
    assert baseline["stats"]["drafted_tokens"] == 0 and out["stats"]["drafted_tokens"] > 0
    assert out["tokens"] == baseline["tokens"] and out["text"] == baseline["text"]
    ids = AutoTokenizer.from_pretrained(model_dir)("hello hello hello", return_tensors="pt")["input_ids"]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        greedy = reference.generate(ids, do_sample=False, max_new_tokens=12)[0, ids.shape[1] :].tolist()
    assert out["tokens"] == greedy
    assert len(out["tokens"]) == out["stats"]["new_tokens"] <= 12
    for key in ("iterations", "draft_forward_passes", "target_forward_passes", "drafted_tokens", "accepted_tokens",
                "accepted_per_position", "acceptance_rate", "acceptance_length", "draft_ms_per_step",
                "verify_ms_per_step", "measured_c", "measured_alpha", "predicted_speedup", "lossless", "wall_s"):
        assert key in out["stats"], key
    assert out["stats"]["lossless"] is True and out["stats"]["gamma"] == 3


def test_baseline_and_streaming_on_a_tiny_model(tiny_model_dir):
    args = ["generate", "--target", str(tiny_model_dir("llama")), "--draft", "none", "--gamma", "0",
            "--max-new-tokens", "6", "--prompt", "hello", "--temperature", "0.8", "--top-k", "5"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "6 tokens" in result.output and "finish: length" in result.output


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--gamma", "-2"], "--gamma -2"),
        (["--max-new-tokens", "0"], "max_new_tokens=0"),
        (["--temperature", "-1"], "temperature=-1"),
        (["--draft", "default"], "no default draft"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tiny_model_dir, extra, message):
    cmd = [sys.executable, "-m", "specgate", "generate", "--target", str(tiny_model_dir("llama")), "--prompt", "hi", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_json_on_gemma_with_ngram(gemma):
    prompt = "Repeat after me: red, green, blue, red, green, blue, red, green, blue,"
    result = runner.invoke(app, ["generate", "--draft", "ngram", "--max-new-tokens", "16", "--prompt", prompt, "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["stats"]["target_forward_passes"] == out["stats"]["iterations"] + 1
    assert out["stats"]["accepted_tokens"] > 0 and out["text"]
