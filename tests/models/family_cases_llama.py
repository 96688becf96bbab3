"""Cases for tests/models/test_families.py: the llama pipeline's architectures."""

CASES = {
    "llama": ("LlamaForCausalLM", {}),
    "mistral-window-16": ("MistralForCausalLM", {"sliding_window": 16}),
}
