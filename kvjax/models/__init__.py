"""Model ports (Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5): configs, RoPE scaling, loading, presets."""
