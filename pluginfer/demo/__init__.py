"""The demo model: a small random llama and a tokenizer trained offline on text shipped with the package."""
