"""Time to first token for one image on a random Qwen2-VL, pluginfer against transformers' generate.

    python benchmarks/vision_ttft.py                          # 0.5B text shape, Qwen2-VL's real tower, bfloat16
    python benchmarks/vision_ttft.py --vision-depth 2 --layers 2 --runs 1   # quick smoke run

The checkpoint is built in a temporary directory (random weights, the demo tokenizer with Qwen's vision tokens):
the text decoder at Qwen2-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864), the
vision tower at Qwen2-VL's (32 blocks, width 1280, 16 heads, MLP ratio 4, 14-pixel patches merged 2x2).
Each run sends a fresh image (the engine caches an image's encoding by content, so a repeated image would cost
nothing) of ``--size`` pixels square: 448x448 is 1024 patches, 256 image tokens. One run is the image
processor, the vision tower and the prefill of the whole prompt up to the first sampled token: ``llm.generate``
with ``max_tokens=1`` against ``processor(...)`` then ``model.generate(max_new_tokens=1)``. Medians of
``--runs`` runs, the two interleaved, after one warm-up each. ``--profile``: the top of torch's CPU profile
of one pluginfer run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pluginfer import LLM, SamplingParams

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this picture.<|im_end|>\n" \
         "<|im_start|>assistant\n"


def build_checkpoint(out: Path, args: argparse.Namespace) -> None:
    from transformers import (
        AutoTokenizer,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
    )

    from pluginfer.demo.tokenizer import train_tokenizer

    train_tokenizer(out)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.save_pretrained(out)
    start, end, image, video = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    half = args.hidden // args.heads // 2  # Qwen2-VL's [16, 24, 24] of a 64-wide half, scaled to this head
    section = [half // 4, 3 * half // 8, half - half // 4 - 3 * half // 8]
    text = dict(vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.intermediate,
                num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": section})
    vision = dict(depth=args.vision_depth, embed_dim=1280, hidden_size=args.hidden, num_heads=16, mlp_ratio=4,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, vision_start_token_id=start,
                           vision_end_token_id=end, image_token_id=image, video_token_id=video)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, args.dtype))  # built in the measured dtype: half the memory
    try:
        Qwen2VLForConditionalGeneration(config).eval().save_pretrained(out)
    finally:
        torch.set_default_dtype(default)
    Qwen2VLImageProcessor().save_pretrained(out)  # Qwen2-VL's defaults: 448x448 stays 448x448


def picture(size: int, seed: int):
    from PIL import Image

    return Image.fromarray(np.random.RandomState(seed).randint(0, 255, (size, size, 3), dtype=np.uint8))


class Transformers:
    def __init__(self, path: Path, dtype: torch.dtype) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLForConditionalGeneration

        self.model = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=dtype).eval()
        self.image_processor = AutoImageProcessor.from_pretrained(path)
        self.ids = AutoTokenizer.from_pretrained(path).encode(PROMPT)
        self.image_token_id = self.model.config.image_token_id

    def first_token(self, image) -> int:
        out = self.image_processor(images=[image], return_tensors="pt")
        count = int(out["image_grid_thw"].prod(-1)[0]) // 4
        ids = [t for token in self.ids for t in ([token] * count if token == self.image_token_id else [token])]
        input_ids = torch.tensor([ids])
        with torch.inference_mode():
            generated = self.model.generate(input_ids, pixel_values=out["pixel_values"],
                                            image_grid_thw=out["image_grid_thw"],
                                            mm_token_type_ids=(input_ids == self.image_token_id).int(),
                                            max_new_tokens=1, do_sample=False, pad_token_id=0)
        return int(generated[0, -1])


def ours_first_token(llm: LLM, image) -> int:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    return llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image}}, params)[0].outputs[0].token_ids[0]


def timed(fn, image) -> tuple[float, int]:
    start = time.perf_counter()
    token = fn(image)
    return time.perf_counter() - start, token


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--intermediate", type=int, default=4864)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vision-depth", type=int, default=32, help="vision blocks (Qwen2-VL: 32)")
    parser.add_argument("--size", type=int, default=448, help="image side in pixels")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--profile", action="store_true", help="print torch's CPU profile of one pluginfer run")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        build_checkpoint(path, args)
        hf = Transformers(path, dtype)
        with LLM(str(path), dtype=args.dtype, max_model_len=4096) as llm:
            seeds = iter(range(1000))
            timed(lambda image: ours_first_token(llm, image), picture(args.size, next(seeds)))  # warm-up
            timed(hf.first_token, picture(args.size, next(seeds)))
            ours, theirs, same = [], [], 0
            for _ in range(args.runs):
                image = picture(args.size, next(seeds))
                seconds, ours_token = timed(lambda image: ours_first_token(llm, image), image)
                ours.append(seconds)
                seconds, hf_token = timed(hf.first_token, image)
                theirs.append(seconds)
                same += ours_token == hf_token
            if args.profile:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                    ours_first_token(llm, picture(args.size, next(seeds)))
                print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=25))
    shape = (f"text hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads; "
              f"vision {args.vision_depth} blocks x 1280")
    print(f"{args.size}x{args.size} image, {shape}, {args.dtype}, {torch.get_num_threads()} threads, "
          f"medians of {args.runs}")
    print("| engine | time to first token (s) |")
    print("|---|---|")
    print(f"| pluginfer | {statistics.median(ours):.2f} |")
    print(f"| transformers generate | {statistics.median(theirs):.2f} |")
    print(f"same first token: {same}/{args.runs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
