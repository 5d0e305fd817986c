"""specgate.models: the model runtime (own forward, position-indexed KV cache) and model loading.

    loaded = load_model("gemma-3-270m")                  # or a local HF dir, or a .gguf file
    cache = loaded.model.new_cache(num_slots=1, max_seq_len=256)
    logits = loaded.model(input_ids, positions, cache, slots)   # [B, T] ids and positions (-1 = pad), [B] slots
"""

from specgate.models.kv_cache import KVCache
from specgate.models.loading import DEFAULT_MODEL, LoadedModel, cache_root, load_model
from specgate.models.transformer import SUPPORTED_MODEL_TYPES, CausalLM, ModelArgs

__all__ = ["CausalLM", "DEFAULT_MODEL", "KVCache", "LoadedModel", "ModelArgs", "SUPPORTED_MODEL_TYPES", "cache_root", "load_model"]
