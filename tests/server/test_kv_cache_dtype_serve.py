"""``pluginfer serve --kv-cache-dtype int8``: the flag reaches the engine, the server answers the official client
with the quantized cache on one rank and on two tensor-parallel ranks alike; a bad value names the flag."""

from __future__ import annotations

import pytest

from pluginfer.cli import build_parser, main
from pluginfer.cli.serve import serve_config
from pluginfer.layers import kv_quant
from pluginfer.server.launch import BackgroundServer
from tests.server.conftest import MODEL_NAME, make_client, start_engine

PROMPT = [11, 57, 203, 99, 14, 301, 42, 7, 88, 150, 12, 64]


def _logprobs(checkpoint: str, tensor_parallel_size: int) -> tuple[list[str], list[float]]:
    args = build_parser().parse_args(["serve", "--model", checkpoint, "--kv-cache-dtype", "int8", "--dtype",
                                      "float32", "--num-blocks", "64", "--block-size", "8", "--port", "0",
                                      "--served-model-name", MODEL_NAME,
                                      "--tensor-parallel-size", str(tensor_parallel_size)])
    config = serve_config(args)
    assert config.cache.kv_cache_dtype == "int8"
    engine = start_engine(config)
    server = BackgroundServer(engine, config)
    try:
        with make_client(server) as client:
            done = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0.0,
                                             logprobs=1)
        logprobs = done.choices[0].logprobs
        return logprobs.tokens, logprobs.token_logprobs
    finally:
        server.stop()
        engine.shutdown()


@pytest.mark.slow
def test_serve_with_an_int8_cache_on_one_and_two_ranks(tiny_llama_checkpoint) -> None:
    """Each rank quantizes its own KV heads' rows: two ranks give one rank's tokens and logprobs. The ranks' keys
    differ from one rank's in float32 rounding only (the all-reduce's order), which flips a code only at a
    rounding boundary: 1e-3 leaves room for a few such codes (measured: 1e-6)."""
    tokens, logprobs = _logprobs(str(tiny_llama_checkpoint[0]), 1)
    tp_tokens, tp_logprobs = _logprobs(str(tiny_llama_checkpoint[0]), 2)
    assert len(tokens) == 6 and tp_tokens == tokens
    assert tp_logprobs == pytest.approx(logprobs, abs=1e-3)


def test_a_bad_kv_cache_dtype_is_refused_naming_the_flag(capsys) -> None:
    with pytest.raises(SystemExit) as exit_status:
        main(["serve", "--model", "/no/such/model", "--kv-cache-dtype", "int4"])
    assert exit_status.value.code == 2
    error = capsys.readouterr().err
    assert "--kv-cache-dtype" in error and "'int4'" in error
    assert all(name in error for name in kv_quant.QUANTIZED_KV_DTYPES)
