"""``rope_scaling.frequency_factors``: per-frequency divisors applied as given (a GGUF file's ``rope_freqs``)."""

from __future__ import annotations

import pytest
import torch

from pluginfer.layers.rotary import RotaryEmbedding, get_rope
from pluginfer.models.gguf_llama import llama3_rope_factors


def test_divisors_divide_each_frequency() -> None:
    factors = [1.0, 1.5, 2.0, 4.0, 8.0, 8.0, 16.0, 3.0]
    plain = RotaryEmbedding(16, 16, 64, 10000.0)
    scaled = get_rope({"rope_theta": 10000.0, "max_position_embeddings": 64,
                       "rope_scaling": {"rope_type": "default", "frequency_factors": factors}}, 16)
    assert torch.equal(scaled.inv_freq, plain.inv_freq / torch.tensor(factors))
    linear = RotaryEmbedding(16, 16, 64, 10000.0, {"rope_type": "linear", "factor": 2.0, "frequency_factors": factors})
    assert torch.equal(linear.inv_freq, plain.inv_freq / 2.0 / torch.tensor(factors))


def test_llama3_divisors_give_transformers_llama3_frequencies() -> None:
    """What llama.cpp's converter writes for llama3 scaling, divided out, is transformers' llama3 rope."""
    scaling = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 32.0,
               "original_max_position_embeddings": 1024}
    llama3 = RotaryEmbedding(16, 16, 64, 10000.0, scaling)
    divisors = llama3_rope_factors(10000.0, 16, scaling)
    given = RotaryEmbedding(16, 16, 64, 10000.0, {"rope_type": "default", "frequency_factors": divisors.tolist()})
    torch.testing.assert_close(given.inv_freq, llama3.inv_freq, rtol=1e-6, atol=0)


@pytest.mark.parametrize("factors", [[1.0] * 7, [1.0] * 7 + [0.0], [1.0] * 7 + [float("nan")]])
def test_divisors_that_do_not_fit_are_an_error(factors: list[float]) -> None:
    with pytest.raises(ValueError, match=r"rope_scaling.frequency_factors: expected 8 positive finite divisors"):
        RotaryEmbedding(16, 16, 64, 10000.0, {"rope_type": "default", "frequency_factors": factors})
    with pytest.raises(ValueError, match="not supported with rope_type 'dynamic'"):
        RotaryEmbedding(16, 16, 64, 10000.0, {"rope_type": "dynamic", "factor": 2.0, "frequency_factors": [1.0] * 8})
