"""GGUF files read in place: the container, GGML block decoding, the tokenizer from metadata."""
