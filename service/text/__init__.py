"""Text in and out: tokenizers, chat templates, the GGUF vocabulary."""
