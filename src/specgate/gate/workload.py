"""Workloads for the gate: prompts with a category, a math set with answers, a text for perplexity.

Prompt JSONL, one object per line, either
- specgate's form: {"prompt": "...", "category": "code", "id": "optional", "max_tokens": optional int}, or
- Spec-Bench's question.jsonl as is: {"question_id": 81, "category": "writing", "turns": ["...", ...]}
  (the first turn is the prompt).
Math JSONL (GSM8K style): {"question": "...", "answer": "... #### 42"} (the number after '####' is the answer;
without '####', the last number in `answer`). Text: any UTF-8 file (Wikitext style is fine).
The built-ins ship as package data under specgate/data/workloads/: builtin.jsonl (code, prose, grounded,
math), arithmetic.jsonl (240 sums, differences and products of small integers, enough items for the gate's paired
exact-match test to rule out a 5-point regression), perplexity.txt.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

BUILTIN = "builtin"
BUILTIN_CATEGORIES = ("code", "prose", "grounded", "math")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    prompt: str
    max_tokens: int | None = None


@dataclass(frozen=True)
class MathItem:
    id: str
    question: str
    answer: str  # the normalised final number, e.g. "42"


def builtin_path(name: str) -> Path:
    """Path of a built-in workload file (builtin.jsonl, arithmetic.jsonl, perplexity.txt)."""
    return Path(str(resources.files("specgate") / "data" / "workloads" / name))


def _read_lines(path: str | Path, what: str) -> list[tuple[int, dict]]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{what} {str(path)!r} does not exist: give a JSONL file (one JSON object per line)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what} {str(path)!r} cannot be read ({exc}): give a readable UTF-8 JSONL file") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what} {path}: line {number} is not valid JSON ({exc.msg}): fix or remove that line") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{what} {path}: line {number} is a {type(obj).__name__}, not a JSON object: write one object per line")
        rows.append((number, obj))
    if not rows:
        raise ValueError(f"{what} {path} has no records: give at least one JSON object per line")
    return rows


def load_prompts(path: str | Path = BUILTIN) -> list[Prompt]:
    """Prompts from a JSONL file (specgate or Spec-Bench form, module docstring) or the built-in set."""
    source = builtin_path("builtin.jsonl") if str(path) == BUILTIN else Path(path)
    prompts = []
    for number, obj in _read_lines(source, "--workload"):
        where = f"--workload {source}: line {number}"
        if "turns" in obj:
            turns = obj["turns"]
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0]:
                raise ValueError(f"{where}: 'turns' must be a non-empty list of strings (Spec-Bench question.jsonl)")
            text, ident = turns[0], obj.get("question_id", number)
        elif "prompt" in obj:
            text, ident = obj["prompt"], obj.get("id", number)
            if not isinstance(text, str) or not text:
                raise ValueError(f"{where}: 'prompt' must be a non-empty string")
        else:
            raise ValueError(f"{where}: needs 'prompt' (specgate form) or 'turns' (Spec-Bench form); found keys {sorted(obj)}")
        category = obj.get("category")
        if not isinstance(category, str) or not category:
            raise ValueError(f"{where}: 'category' must be a non-empty string (e.g. \"code\")")
        max_tokens = obj.get("max_tokens")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"{where}: 'max_tokens'={max_tokens!r} must be an integer >= 1 (or left out)")
        prompts.append(Prompt(str(ident), category, text, max_tokens))
    return prompts


def final_number(text: str) -> str | None:
    """The answer number of a GSM8K answer or model output: after '####' if present, else the last number."""
    if "####" in text:
        text = text.split("####", 1)[1]
        found = _NUMBER.findall(text)
        return _normalise(found[0]) if found else None
    found = _NUMBER.findall(text)
    return _normalise(found[-1]) if found else None


def first_number(text: str) -> str | None:
    """The answer number of a model's short answer: on its first line, the first number after the last '='
    if there is one (a model that restates "12 + 64 = 76"), else the first number."""
    line = text.strip().split("\n", 1)[0] if text.strip() else ""
    if "=" in line:
        line = line.rsplit("=", 1)[1]
    found = _NUMBER.findall(line)
    return _normalise(found[0]) if found else None


def _normalise(number: str) -> str:
    number = number.replace(",", "")
    if "." in number:
        number = number.rstrip("0").rstrip(".")
    return number


def load_math(path: str | Path = BUILTIN) -> list[MathItem]:
    """A GSM8K-style JSONL (question, answer) or the built-in arithmetic set."""
    source = builtin_path("arithmetic.jsonl") if str(path) == BUILTIN else Path(path)
    items = []
    for number, obj in _read_lines(source, "--math"):
        question, answer = obj.get("question"), obj.get("answer")
        if not isinstance(question, str) or not question or answer is None:
            raise ValueError(f"--math {source}: line {number} needs 'question' (string) and 'answer' (GSM8K form '... #### 42')")
        final = final_number(str(answer))
        if final is None:
            raise ValueError(f"--math {source}: line {number}: 'answer' {str(answer)[:40]!r} holds no number")
        items.append(MathItem(str(obj.get("id", number)), question, final))
    return items


def load_text(path: str | Path = BUILTIN) -> str:
    """The perplexity text: a UTF-8 file or the built-in one."""
    source = builtin_path("perplexity.txt") if str(path) == BUILTIN else Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--text {str(source)!r} cannot be read ({exc}): give a UTF-8 text file") from None
    if not text.strip():
        raise ValueError(f"--text {source} is empty: give a file with some text")
    return text


def take_balanced(prompts: list[Prompt], per_category: int) -> list[Prompt]:
    """The first `per_category` prompts of each category, interleaved (code, prose, ... , code, ...)."""
    by_category: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    columns = [items[:per_category] for items in by_category.values()]
    return [column[i] for i in range(per_category) for column in columns if i < len(column)]
