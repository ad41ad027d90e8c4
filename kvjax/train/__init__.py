"""Training small Llama-architecture models on the synthetic long-context tasks (`python -m kvjax.train`)."""
