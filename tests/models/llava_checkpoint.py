"""A tiny random LLaVA checkpoint (transformers builds and saves it) with its CLIP image processor, a tokenizer
trained offline with ``<image>`` added, and a ChatML template that renders image parts as ``<image>``."""

from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<image>\\n' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
IMAGE_SIZE, PATCH = 56, 14
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH) ** 2


def save_llava(out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> torch.nn.Module:
    """Build, save and return a float32 ``LlavaForConditionalGeneration`` (2 Llama layers, a 3-layer CLIP)."""
    from transformers import AutoTokenizer, CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                         image_seq_length=TOKENS_PER_IMAGE)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    for name, param in model.named_parameters():  # biases and norms random too, so that each one matters
        if "vision_tower" in name or "projector" in name:
            param.data.normal_(0, 0.2)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                       crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return model


def hf_llava_greedy(model: torch.nn.Module, image_processor, prompt_ids: list[int], images: list,
                    max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, each ``<image>`` expanded to the tower's patches first."""
    image_id = model.config.image_token_id
    expanded = [t for token in prompt_ids for t in ([token] * TOKENS_PER_IMAGE if token == image_id else [token])]
    kwargs = {"pixel_values": image_processor(images=images, return_tensors="pt")["pixel_values"]} if images else {}
    with torch.inference_mode():
        generated = model.generate(torch.tensor([expanded]), max_new_tokens=max_new_tokens,
                                   min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                   pad_token_id=0, **kwargs)
    return generated[0, len(expanded):].tolist()
