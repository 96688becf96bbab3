"""Registers the built-in checkpoint formats (cheap: a format's reader loads when a path is opened with it)."""

from pluginfer.core.hookspecs import CheckpointFormatSpec, hookimpl


@hookimpl
def pluginfer_checkpoint_formats() -> list[CheckpointFormatSpec]:
    return [
        CheckpointFormatSpec(name="safetensors", aliases=("hf",), claims="pluginfer.formats.safetensors:claims",
                             factory="pluginfer.formats.safetensors:SafetensorsCheckpoint",
                             description="Hugging Face directory: config.json, *.safetensors (pickles with "
                                         "--allow-pickle), tokenizer files"),
        CheckpointFormatSpec(name="gguf", claims="pluginfer.formats.gguf.checkpoint:is_gguf_file",
                             factory="pluginfer.formats.gguf.checkpoint:GGUFCheckpoint",
                             description="llama.cpp .gguf file: metadata, tokenizer and GGML tensors"),
    ]
