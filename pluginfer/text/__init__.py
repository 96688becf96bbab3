"""Text in and out: tokenizers (with or without transformers) and chat templates."""
