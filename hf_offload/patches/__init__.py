"""Per-architecture adapters, only where the generic path (``cache.update`` followed by the registered attention
function with the same key tensor) cannot work. The architectures tested so far (Llama, Mistral, Qwen2, Qwen3,
Gemma 3, Phi-3) need none."""
