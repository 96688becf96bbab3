"""Helpers for testing pluginfer and its plugins: an in-process multi-rank collective, and the conformance
kits a plugin calls from its own tests (``backend_contract``, ``quant_contract``, ``model_contract``,
``collective_contract``, ``multimodal_contract``)."""
