"""A tiny random Qwen2-VL checkpoint (transformers builds and saves it) with its image processor, a tokenizer
trained offline with Qwen's vision tokens added, and a ChatML template that renders image parts."""

from __future__ import annotations

from pathlib import Path

import torch

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# ChatML as Qwen2-VL's own template writes it: each image part is <|vision_start|><|image_pad|><|vision_end|>.
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def save_qwen2_vl(out_dir: Path, tokenizer_dir: Path, seed: int = 0, version: str = "2") -> torch.nn.Module:
    """Build, save and return a float32 ``Qwen2VLForConditionalGeneration`` (``version`` "2.5":
    ``Qwen2_5_VLForConditionalGeneration``, windowed tower) with 2 text layers and 2 vision blocks."""
    import transformers
    from transformers import AutoTokenizer, Qwen2VLImageProcessor

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    start, end, image, video = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    model_cls = transformers.Qwen2VLForConditionalGeneration
    if version == "2.5":  # windows of 2x2 merged patches, the second block full attention
        vision = dict(depth=2, hidden_size=32, intermediate_size=48, out_hidden_size=64, num_heads=4, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
        model_cls = transformers.Qwen2_5_VLForConditionalGeneration
    config = model_cls.config_class(text_config=text, vision_config=vision, vision_start_token_id=start,
                           vision_end_token_id=end, image_token_id=image, video_token_id=video)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    # small images stay small: 4..64 merged patches each
    Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 64).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return model


def hf_image_greedy(model: torch.nn.Module, image_processor, prompt_ids: list[int], images: list,
                    max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of a prompt whose single-token placeholders it expands itself."""
    config = model.config
    expanded = list(prompt_ids)
    kwargs = {}
    if images:
        out = image_processor(images=images, return_tensors="pt")
        counts = iter((out["image_grid_thw"].prod(-1) // 4).tolist())
        expanded = [t for token in prompt_ids
                    for t in ([token] * next(counts) if token == config.image_token_id else [token])]
        kwargs = dict(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                      mm_token_type_ids=(torch.tensor([expanded]) == config.image_token_id).int())
    with torch.inference_mode():
        generated = model.generate(torch.tensor([expanded]), max_new_tokens=max_new_tokens,
                                   min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                   pad_token_id=0, **kwargs)
    return generated[0, len(expanded):].tolist()
