"""Text in and out: the tokenizer, the chat format (one rendering for app, CLI and server), the detokenizer."""
