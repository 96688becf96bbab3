"""Checkpoint formats beside safetensors."""
