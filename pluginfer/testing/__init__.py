"""Helpers for testing pluginfer and its plugins: an in-process multi-rank collective, conformance checks."""
