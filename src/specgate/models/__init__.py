"""specgate.models: the model runtime (own forward, position-indexed KV cache) and model loading.

    loaded = load_model("gemma-3-270m")                  # or a local HF dir, or a .gguf file
    cache = loaded.model.new_cache(num_slots=1, max_seq_len=256)
    logits = loaded.model(input_ids, positions, cache, slots)   # [B, T] ids and positions (-1 = pad), [B] slots

dtype: load_model defaults to float32 (the exactness tests compare float32 logits with transformers);
default_dtype() is bfloat16 (bf16 weights, float32 arithmetic) where the native kernel runs (AVX2 + FMA and a C
compiler) or the CPU has avx512_bf16 / amx_bf16, and float32 elsewhere; it is what the CLI's `--dtype auto` loads.
"""

from specgate.models.dtypes import default_dtype, native_bf16, resolve_dtype
from specgate.models.kv_cache import KVCache
from specgate.models.loading import DEFAULT_MODEL, LoadedModel, cache_root, load_model
from specgate.models.transformer import SUPPORTED_MODEL_TYPES, CausalLM, ModelArgs

__all__ = [
    "CausalLM", "DEFAULT_MODEL", "KVCache", "LoadedModel", "ModelArgs", "SUPPORTED_MODEL_TYPES", "cache_root",
    "default_dtype", "load_model", "native_bf16", "resolve_dtype",
]
