"""The model runtime: checkpoints in (Hugging Face folders, GGUF files), our Llama-family model
code, the paged KV cache, the runner of a flat batch and the CUDA graph runner."""
