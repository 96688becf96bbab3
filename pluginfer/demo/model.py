"""The demo model: a small random-weight llama with a tokenizer trained offline.

It exists so a newcomer can run every command without a hub. Its output is noise.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pluginfer.core.config import EngineConfig

logger = logging.getLogger(__name__)

DEMO_VERSION = 1
NOISE_WARNING = "demo model: random weights, so its output is noise (it shows the machinery, not a language model)"


def demo_dir() -> Path:
    root = Path(os.environ.get("PLUGINFER_CACHE", Path.home() / ".cache" / "pluginfer"))
    return root / f"demo-v{DEMO_VERSION}"


def with_demo_model(config: EngineConfig) -> EngineConfig:
    """``model: demo`` -> the demo checkpoint's directory, built on first use (the engine sees only paths);
    the server keeps calling it "demo". Any other config unchanged."""
    if config.model != "demo":
        return config
    server = config.server
    if server.served_model_name is None:
        server = server.model_copy(update={"served_model_name": "demo"})
    return config.model_copy(update={"model": str(ensure_demo_model()), "server": server})


def ensure_demo_model() -> Path:
    """Build the demo checkpoint once (a few seconds) and return its directory."""
    target = demo_dir()
    if (target / "config.json").is_file():
        logger.warning(NOISE_WARNING)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="demo-", dir=target.parent))
    try:
        build_demo_model(staging)
        try:
            staging.rename(target)
        except OSError:  # another process built it first
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.warning(NOISE_WARNING)
    return target


def build_demo_model(out_dir: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pluginfer.demo.tokenizer import train_tokenizer

    train_tokenizer(out_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=704, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
