"""Registers the built-in model pipelines and their image processors (cheap: the modules load only when
selected)."""

from pluginfer.core.hookspecs import ModelSpec, MultimodalProcessorSpec, hookimpl


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
                  description="Qwen2-VL, Qwen2.5-VL (images in)"),
        ModelSpec(name="llava", architectures=("LlavaForConditionalGeneration",),
                  factory="pluginfer.models.llava:build",
                  description="LLaVA-1.5 style: CLIP tower, MLP projector, Llama decoder (images in)"),
        ModelSpec(name="glm4", architectures=("Glm4ForCausalLM",),
                  factory="pluginfer.models.glm4:build",
                  converters={"gguf": {"glm4": "pluginfer.models.gguf_glm4:convert"}},
                  description="GLM-4-0414"),
        ModelSpec(name="stablelm", aliases=("stable-lm",), architectures=("StableLmForCausalLM",),
                  factory="pluginfer.models.stablelm:build",
                  converters={"gguf": {"stablelm": "pluginfer.models.gguf_stablelm:convert"}},
                  description="StableLM-3B-4E1T, StableLM 2"),
        ModelSpec(name="gemma", aliases=("gemma2", "gemma3"),
                  architectures=("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"),
                  factory="pluginfer.models.gemma:build",
                  converters={"gguf": dict.fromkeys(("gemma", "gemma2", "gemma3"), "pluginfer.models.gguf_gemma:convert")},
                  description="Gemma 1, Gemma 2, Gemma 3 (text)"),
        ModelSpec(name="phi", aliases=("phi2", "phi3"),
                  architectures=("PhiForCausalLM", "Phi3ForCausalLM"),
                  factory="pluginfer.models.phi:build",
                  converters={"gguf": dict.fromkeys(("phi2", "phi3"), "pluginfer.models.gguf_phi:convert")},
                  description="Phi-1/1.5/2, Phi-3, Phi-3.5, Phi-4-mini"),
        # llama.cpp writes Mixtral as a "llama" file with merged experts: the llama spec's reader hands it on.
        ModelSpec(name="mixtral", architectures=("MixtralForCausalLM",),
                  factory="pluginfer.models.mixtral:build",
                  description="Mixtral 8x7B, 8x22B (sparse mixture of experts)"),
        ModelSpec(name="qwen2-moe", aliases=("qwen2_moe",), architectures=("Qwen2MoeForCausalLM",),
                  factory="pluginfer.models.qwen2_moe:build",
                  converters={"gguf": {"qwen2moe": "pluginfer.models.gguf_moe:convert"}},
                  description="Qwen2 mixture-of-experts (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B; shared expert)"),
        ModelSpec(name="qwen3-moe", aliases=("qwen3_moe",), architectures=("Qwen3MoeForCausalLM",),
                  factory="pluginfer.models.qwen3_moe:build",
                  converters={"gguf": {"qwen3moe": "pluginfer.models.gguf_moe:convert"}},
                  description="Qwen3 mixture-of-experts (Qwen3-30B-A3B, Qwen3-235B-A22B)"),
        ModelSpec(name="deepseek", aliases=("deep-seek", "deepseek_v2", "deepseek_v3"),
                  architectures=("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
                  factory="pluginfer.models.deepseek:build",
                  converters={"gguf": {"deepseek2": "pluginfer.models.gguf_deepseek:convert"}},
                  description="DeepSeek-V2, V2-Lite, V3, R1 (latent attention, routed + shared experts)"),
        ModelSpec(name="bert", aliases=("roberta", "xlm-roberta"),
                  architectures=("BertModel", "BertForSequenceClassification", "RobertaModel",
                                 "RobertaForSequenceClassification", "XLMRobertaModel",
                                 "XLMRobertaForSequenceClassification"),
                  factory="pluginfer.models.bert:build",
                  description="BERT, RoBERTa, XLM-RoBERTa encoders: embeddings, cross-encoders (scores)"),
        ModelSpec(name="modernbert", architectures=("ModernBertModel", "ModernBertForSequenceClassification"),
                  factory="pluginfer.models.modernbert:build",
                  description="ModernBERT encoders: embeddings, cross-encoders (scores)"),
    ]


@hookimpl
def pluginfer_multimodal_processors() -> list[MultimodalProcessorSpec]:
    return [
        MultimodalProcessorSpec(name="qwen2-vl-images",
                                architectures=("Qwen2VLForConditionalGeneration",
                                               "Qwen2_5_VLForConditionalGeneration"),
                                factory="pluginfer.models.qwen2_vl_processor:build",
                                description="Qwen2-VL, Qwen2.5-VL: the checkpoint's image processor, M-RoPE positions"),
        MultimodalProcessorSpec(name="llava-images", architectures=("LlavaForConditionalGeneration",),
                                factory="pluginfer.models.llava_processor:build",
                                description="LLaVA-1.5: the checkpoint's CLIP image processor"),
    ]
