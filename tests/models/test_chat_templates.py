"""Chat-template switches reach the template: Qwen3's ``enable_thinking`` through ``chat_template_kwargs``."""

from __future__ import annotations

from pathlib import Path

import pytest

from pluginfer import LLM, SamplingParams
from tests.checkpoints import save_hf_model

# The shape test_families.py uses (not imported: that module collects every family's case module).
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)

# Qwen3's template, cut down to what it does with enable_thinking: false pre-fills an empty think block.
QWEN3_STYLE_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
HELLO = [{"role": "user", "content": "Hello"}]
PROMPT = "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def qwen3_llm(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> LLM:
    out = tmp_path_factory.mktemp("qwen3_chat")
    save_hf_model("Qwen3ForCausalLM", {**BASE, "head_dim": 16}, out, tiny_tokenizer_dir)
    (out / "chat_template.jinja").write_text(QWEN3_STYLE_TEMPLATE)
    return LLM(model=str(out), dtype="float32", num_blocks=32, block_size=8)


@pytest.mark.parametrize(("kwargs", "expected"), [
    (None, PROMPT),
    ({"enable_thinking": True}, PROMPT),
    ({"enable_thinking": False}, PROMPT + "<think>\n\n</think>\n\n"),
], ids=["default", "thinking", "no-thinking"])
def test_enable_thinking_reaches_the_template(qwen3_llm: LLM, kwargs: dict | None, expected: str) -> None:
    [output] = qwen3_llm.chat(HELLO, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                              chat_template_kwargs=kwargs)
    tokenizer = qwen3_llm.get_tokenizer()
    assert tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False) == expected
    assert len(output.outputs[0].token_ids) == 2
