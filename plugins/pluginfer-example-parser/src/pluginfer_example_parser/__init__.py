"""Parsers for "memo", a made-up chat format: ``reasoning ~~ answer`` and ``<<call NAME {json}>>``."""
