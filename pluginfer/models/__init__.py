"""Built-in plugins; registration lives in plugin.py (cheap to import)."""
