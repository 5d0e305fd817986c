"""Drafter names -> drafters: "none", "ngram", "default", "synthetic:...", "eagle", "eagle:<dir>", or a draft model's name / path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specgate.drafting.base import Drafter, NoDrafter
from specgate.drafting.ngram import NgramDrafter

_DRAFTS_DIR = Path(__file__).resolve().parent.parent / "data" / "drafts"
EAGLE_PREFIX = "eagle:"  # --draft eagle:<dir>: a head saved by specgate.drafting.eagle.save_head
# target name -> the EAGLE head shipped for it (`--draft eagle`), trained by specgate.drafting.eagle_train
EAGLE_HEADS: dict[str, Path] = {"gemma-3-270m": _DRAFTS_DIR / "gemma-3-270m-eagle"}
# Gemma-3-270M's small draft model, built by `python -m specgate.drafting.build_default` (docs/DRAFT_MODEL.md):
# reachable by this path (--draft PATH); the head drafts faster (docs/BENCHMARKS.md, the draft table)
DRAFT_MODEL_DIRS: dict[str, Path] = {"gemma-3-270m": _DRAFTS_DIR / "gemma-3-270m-default"}
# target name -> its default draft (`--draft default`): the best measured draft for it, as a --draft spec
# ("eagle:<dir>", a model name or path load_model understands, or a recipe-built draft dir)
DEFAULT_DRAFTS: dict[str, str] = {"gemma-3-270m": EAGLE_PREFIX + str(EAGLE_HEADS["gemma-3-270m"])}


def resolve_default(spec: str, target_name: str) -> str:
    """`default` -> the spec DEFAULT_DRAFTS registers for target_name (ValueError naming the options where none
    is); any other spec unchanged."""
    if spec.strip() != "default":
        return spec
    if target_name not in DEFAULT_DRAFTS:
        known = ", ".join(sorted(DEFAULT_DRAFTS)) or "none yet"
        raise ValueError(
            f"--draft default: target '{target_name}' has no default draft model (targets with one: {known}): "
            "use --draft ngram (prompt lookup) or --draft PATH to a small model that shares the target's tokenizer"
        )
    return DEFAULT_DRAFTS[target_name]


def resolve_eagle(spec: str, target_name: str) -> str:
    """`eagle` -> `eagle:<the head shipped for target_name>` (ValueError naming the fix where none is); any other
    spec unchanged."""
    if spec.strip() != "eagle":
        return spec
    head_dir = EAGLE_HEADS.get(target_name)
    if head_dir is None or not (head_dir / "eagle_config.json").is_file():
        known = ", ".join(sorted(name for name, path in EAGLE_HEADS.items() if (path / "eagle_config.json").is_file())) or "none"
        raise ValueError(f"--draft eagle: no EAGLE head ships for target '{target_name}' (targets with one: {known}): "
                         "train one (python -m specgate.drafting.eagle_train) and pass --draft eagle:DIR")
    return EAGLE_PREFIX + str(head_dir)


def make_eagle_drafter(spec: str, target: Any) -> Drafter:
    """--draft eagle:<dir> -> an EagleDrafter with the head in <dir>, checked against target (eagle.load_head)."""
    from specgate.drafting.eagle import load_head
    from specgate.drafting.eagle_drafter import EagleDrafter

    head_dir = spec[len(EAGLE_PREFIX) :].strip()
    if not head_dir:
        raise ValueError(f"--draft {spec!r} names no directory: use --draft eagle:PATH, PATH a head saved by eagle.save_head")
    return EagleDrafter(load_head(head_dir, target), target, name=f"eagle:{Path(head_dir).name}")


def make_drafter(spec: str, target: Any, *, dtype: Any = None, gamma: int | None = None) -> Drafter:
    """Build the drafter named by `spec` for `target` (a LoadedModel).

    spec: "none" (target only), "ngram" (prompt lookup, n = 1..3), "default" (the target's registered default
    draft, DEFAULT_DRAFTS: for gemma-3-270m its EAGLE head), "synthetic:<rates>" or "synthetic:AL=<x>" (LOSSY cost-study drafter, see specgate.drafting.synthetic;
    AL needs gamma), "eagle" (the EAGLE head shipped for the target, EAGLE_HEADS), "eagle:<dir>" (an EAGLE head saved by specgate.drafting.eagle.save_head, checked against the
    target; it computes in float32 whatever dtype says), or anything load_model accepts (a draft model name, HF
    directory or .gguf file), which gives a ModelDrafter. dtype: the draft model's weights dtype.
    """
    spec = resolve_eagle(resolve_default(spec.strip(), getattr(target, "name", "")), getattr(target, "name", ""))
    if spec == "none":
        return NoDrafter()
    if spec == "ngram":
        return NgramDrafter()
    if spec.startswith(EAGLE_PREFIX):
        return make_eagle_drafter(spec, target)
    if spec.startswith("synthetic"):
        from specgate.drafting.synthetic import SyntheticDrafter

        return SyntheticDrafter.from_spec(spec, gamma=gamma)
    from specgate.drafting.model_drafter import ModelDrafter, is_draft_dir, load_draft_dir
    from specgate.models import load_model

    if is_draft_dir(spec):  # a recipe-built reduced-vocabulary draft: borrows the target's tokenizer
        return ModelDrafter(load_draft_dir(spec, target, dtype), target)
    draft = load_model(spec) if dtype is None else load_model(spec, dtype=dtype)
    return ModelDrafter(draft, target)
