"""Finding and reading model files: HF folders, GGUF files, the embedded default model, tokenizers."""
