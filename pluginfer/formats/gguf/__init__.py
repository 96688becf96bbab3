"""llama.cpp's GGUF files: the reader, the checkpoint view over it, and the tokenizer it carries."""
