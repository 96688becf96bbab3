"""Registers the built-in model pipelines (cheap: the model modules load only when selected)."""

from pluginfer.core.hookspecs import ModelSpec, hookimpl


@hookimpl
def pluginfer_models() -> list[ModelSpec]:
    return [
        ModelSpec(name="llama", aliases=("llama3", "mistral", "yi"),
                  architectures=("LlamaForCausalLM", "MistralForCausalLM"),
                  factory="pluginfer.models.llama:build",
                  converters={"gguf": {"llama": "pluginfer.models.gguf_llama:convert"}},
                  description="Llama 1-3, Mistral, Yi"),
        ModelSpec(name="qwen", aliases=("qwen2", "qwen3"),
                  architectures=("Qwen2ForCausalLM", "Qwen3ForCausalLM"),
                  factory="pluginfer.models.qwen:build",
                  converters={"gguf": dict.fromkeys(("qwen2", "qwen3"), "pluginfer.models.gguf_llama:convert")},
                  description="Qwen2, Qwen2.5, Qwen3 (dense)"),
        ModelSpec(name="qwen2-vl", aliases=("qwen2_vl", "qwen2.5-vl", "qwen2_5_vl"),
                  architectures=("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"),
                  factory="pluginfer.models.qwen2_vl:build",
                  multimodal_processor="pluginfer.models.qwen2_vl_processor:build",
                  description="Qwen2-VL, Qwen2.5-VL (images in)"),
        ModelSpec(name="glm4", architectures=("Glm4ForCausalLM",),
                  factory="pluginfer.models.glm4:build",
                  description="GLM-4-0414"),
        ModelSpec(name="stablelm", aliases=("stable-lm",), architectures=("StableLmForCausalLM",),
                  factory="pluginfer.models.stablelm:build",
                  description="StableLM-3B-4E1T, StableLM 2"),
        ModelSpec(name="gemma", aliases=("gemma2", "gemma3"),
                  architectures=("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"),
                  factory="pluginfer.models.gemma:build",
                  description="Gemma 1, Gemma 2, Gemma 3 (text)"),
        ModelSpec(name="phi", aliases=("phi2", "phi3"),
                  architectures=("PhiForCausalLM", "Phi3ForCausalLM"),
                  factory="pluginfer.models.phi:build",
                  description="Phi-1/1.5/2, Phi-3, Phi-3.5, Phi-4-mini"),
        ModelSpec(name="mixtral", architectures=("MixtralForCausalLM",),
                  factory="pluginfer.models.mixtral:build",
                  description="Mixtral 8x7B, 8x22B (sparse mixture of experts)"),
        ModelSpec(name="qwen3-moe", aliases=("qwen3_moe",), architectures=("Qwen3MoeForCausalLM",),
                  factory="pluginfer.models.qwen3_moe:build",
                  description="Qwen3 mixture-of-experts (Qwen3-30B-A3B, Qwen3-235B-A22B)"),
        ModelSpec(name="deepseek", aliases=("deep-seek", "deepseek_v2", "deepseek_v3"),
                  architectures=("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
                  factory="pluginfer.models.deepseek:build",
                  description="DeepSeek-V2, V2-Lite, V3, R1 (latent attention, routed + shared experts)"),
    ]
