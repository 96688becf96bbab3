"""A tiny demo tokenizer, trained offline on text shipped with the package."""
