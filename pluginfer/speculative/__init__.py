"""Speculative proposers shipped with pluginfer (the ``proposer`` plugin kind)."""
