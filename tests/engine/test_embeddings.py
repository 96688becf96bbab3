"""LLM.embed through the engine's batched path, against sentence-transformers and transformers.

The oracles: sentence-transformers' own ``encode`` on the same checkpoint directory (it reads the
same modules.json / Pooling config we read), and transformers' ``AutoModel`` hidden states with the
pooling written out by hand. Tensor parallelism is checked against one rank.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pluginfer import LLM, PoolingParams, SamplingParams
from pluginfer.engine.pooling import PoolingState, read_pooler_config
from tests.embedding_models import QWEN3_MATRYOSHKA, sentence_transformer

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog, again and again and again", "a",
         "Embeddings of sentences of rather different lengths, batched together in one engine step."]
ATOL = 2e-5


def embed(path: Path, prompts: list, params: PoolingParams | None = None, **kwargs) -> torch.Tensor:
    options = {"dtype": "float32", "num_blocks": 64, "block_size": 8, **kwargs}
    with LLM(str(path), **options) as llm:
        return torch.tensor([o.embedding for o in llm.embed(prompts, params)])


def st_encode(path: Path, texts: list[str], **kwargs) -> torch.Tensor:
    return sentence_transformer(path).encode(texts, convert_to_tensor=True, batch_size=len(texts), **kwargs).float()


@pytest.mark.parametrize("name", ["qwen3", "llama", "llama_cls"])
def test_equal_to_sentence_transformers(embedding_checkpoints, name):
    """Last-token + normalize (Qwen3-Embedding style, bare Qwen3Model weights), mean without normalize
    (a LlamaForCausalLM checkpoint, pre-v6 files) and CLS + normalize, all four prompts in one batch."""
    path = embedding_checkpoints[name]
    ours = embed(path, TEXTS)
    reference = st_encode(path, TEXTS)
    assert ours.shape == reference.shape == (len(TEXTS), 64)
    torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)


def _pool_by_hand(hidden: torch.Tensor, method: str, normalize: bool) -> torch.Tensor:
    vector = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[method]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


@pytest.mark.parametrize("name,method,normalize", [("qwen3", "last", True), ("llama", "mean", False),
                                                   ("llama_cls", "cls", True)])
def test_equal_to_transformers_hidden_states_pooled_by_hand(embedding_checkpoints, name, method, normalize):
    from transformers import AutoModel, AutoTokenizer

    path = embedding_checkpoints[name]
    pooler = read_pooler_config(path, json.loads((path / "config.json").read_text()))
    assert (pooler.method, pooler.normalize, pooler.problem) == (method, normalize, None)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    expected = []
    for text in TEXTS:
        with torch.inference_mode():
            hidden = model(torch.tensor([tokenizer.encode(text)])).last_hidden_state[0]
        expected.append(_pool_by_hand(hidden, method, normalize))
    torch.testing.assert_close(embed(path, TEXTS), torch.stack(expected), atol=ATOL, rtol=0)


def test_token_ids_equal_text(embedding_checkpoints):
    path = embedding_checkpoints["qwen3"]
    # Without the prefix cache both calls run the same matmul shapes, so they agree to the bit.
    with LLM(str(path), dtype="float32", num_blocks=64, block_size=8, enable_prefix_caching=False) as llm:
        ids = [llm.get_tokenizer().encode(t) for t in TEXTS]
        by_text = [o.embedding for o in llm.embed(TEXTS)]
        by_ids = [o.embedding for o in llm.embed(ids)]
        one = llm.embed(ids[1])
    assert by_text == by_ids
    assert len(one) == 1  # alone rather than in a batch of four: equal up to the matmuls' summation order
    torch.testing.assert_close(torch.tensor(one[0].embedding), torch.tensor(by_ids[1]), atol=ATOL, rtol=0)


def test_prefix_cache_hit_changes_embeddings_only_within_rounding(embedding_checkpoints):
    """A second call reads the first one's cached blocks and prefills only the rest: the same values
    through matmuls of fewer rows, whose summation order (MKL's and oneDNN's choice, per CPU) may differ."""
    path = embedding_checkpoints["qwen3"]
    with LLM(str(path), dtype="float32", num_blocks=64, block_size=8) as llm:
        first = llm.embed(TEXTS)
        again = llm.embed(TEXTS)
    assert any(o.num_cached_tokens for o in again) and not any(o.num_cached_tokens for o in first)
    torch.testing.assert_close(torch.tensor([o.embedding for o in again]),
                               torch.tensor([o.embedding for o in first]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["qwen3", "llama", "llama_cls"])
def test_chunked_prefill_prefix_cache_and_generation_in_the_same_steps(embedding_checkpoints, name):
    """Prompts cut into 16-token chunks, prefix-cached blocks shared by repeated prompts, and embedding
    requests sharing steps with generating ones give the same embeddings as one prompt per step."""
    path = embedding_checkpoints[name]
    long_texts = [t * 3 for t in TEXTS]  # up to ~60 tokens: several chunks each
    alone = embed(path, long_texts)
    options = {"dtype": "float32", "num_blocks": 64, "block_size": 8, "max_num_batched_tokens": 16,
               "enable_chunked_prefill": True, "enable_prefix_caching": True}
    with LLM(str(path), **options) as llm:
        engine = llm.engine
        generating = name != "qwen3"  # the bare Qwen3Model has no LM head
        if generating:
            engine.add_request(TEXTS[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        ids = [engine.add_request(t, PoolingParams()) for t in long_texts + long_texts]
        done, cached = {}, {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished and output.request_id in ids:
                    done[output.request_id] = output.embedding
                    cached[output.request_id] = output.num_cached_tokens
    assert engine.step_count > len(ids)  # chunking spread the prompts over many steps
    mixed = torch.tensor([done[i] for i in ids])
    torch.testing.assert_close(mixed[: len(long_texts)], alone, atol=ATOL, rtol=0)
    torch.testing.assert_close(mixed[len(long_texts):], alone, atol=ATOL, rtol=0)
    hits = sum(cached[i] for i in ids[len(long_texts):])
    # Last-token pooling reads only the last position: the repeated prompts hit the prefix cache. Mean and
    # CLS read positions a hit would skip, so their prompts are computed whole.
    assert hits > 0 if name == "qwen3" else hits == 0


def test_preempted_embedding_is_recomputed(embedding_checkpoints):
    """A cache too small for everyone: generating requests preempt a half-read embedding prompt, which is
    read again from its start; the result equals the embedding computed alone."""
    path = embedding_checkpoints["llama"]
    text = list(range(40, 70))  # 30 tokens: 8 of the 10 blocks
    alone = embed(path, [text])
    options = {"dtype": "float32", "num_blocks": 10, "block_size": 4, "max_num_batched_tokens": 16,
               "enable_chunked_prefill": True, "enable_prefix_caching": False}
    with LLM(str(path), **options) as llm:
        engine = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        for prompt in ([11, 12, 13], [14, 15, 16]):
            engine.add_request(prompt, params)
        engine.step()
        embedding_id = engine.add_request(text, PoolingParams())
        result = None
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id == embedding_id and output.finished:
                    result = output.embedding
        preemptions = engine.scheduler.num_preemptions
    assert preemptions > 0
    torch.testing.assert_close(torch.tensor([result]), alone, atol=ATOL, rtol=0)


def test_matryoshka_dimensions_truncate_and_renormalize(embedding_checkpoints):
    path = embedding_checkpoints["qwen3"]
    full = st_encode(path, TEXTS)
    for dims in QWEN3_MATRYOSHKA:
        ours = embed(path, TEXTS, PoolingParams(dimensions=dims))
        expected = torch.nn.functional.normalize(full[:, :dims], dim=1)
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
        assert torch.allclose(ours.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)


def test_dimensions_refused_where_the_model_does_not_support_them(embedding_checkpoints):
    with LLM(str(embedding_checkpoints["qwen3"]), dtype="float32", num_blocks=32, block_size=8) as llm:
        with pytest.raises(ValueError, match=r"dimensions: must be one of \[16, 32, 64\], got 20"):
            llm.embed("hi", PoolingParams(dimensions=20))
    with LLM(str(embedding_checkpoints["llama"]), dtype="float32", num_blocks=32, block_size=8) as llm:
        with pytest.raises(ValueError, match="dimensions: this model does not support Matryoshka"):
            llm.embed("hi", PoolingParams(dimensions=16))
    with pytest.raises(ValueError, match="PoolingParams.dimensions: must be an integer >= 1"):
        PoolingParams(dimensions=0)


def test_too_long_and_empty_prompts_are_errors(embedding_checkpoints):
    with LLM(str(embedding_checkpoints["qwen3"]), dtype="float32", num_blocks=64, block_size=8,
             max_model_len=32) as llm:
        with pytest.raises(ValueError, match="prompt 1: the prompt has 40 tokens, more than the model's context "
                                             "of 32 tokens"):
            llm.embed([[5] * 8, [5] * 40])
        with pytest.raises(ValueError, match="prompt is empty"):
            llm.embed([[]])
        assert not llm.engine.has_unfinished_requests()
        assert len(llm.embed([[5] * 32])[0].embedding) == 64


def test_bare_decoder_checkpoint_refuses_generation(embedding_checkpoints):
    with LLM(str(embedding_checkpoints["qwen3"]), dtype="float32", num_blocks=16, block_size=8) as llm:
        with pytest.raises(ValueError, match=r"bare decoder without an LM head \(architectures \['Qwen3Model'\]\)"):
            llm.generate("hi")


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
                         ids=["tp2", "pp2"])
def test_two_ranks_equal_one(embedding_checkpoints, parallel):
    """Under tensor parallelism every rank computes the hidden states; under pipeline parallelism the last
    stage sends the pooled rows to the driver (which sits in the first stage)."""
    for name in ("qwen3", "llama"):
        path = embedding_checkpoints[name]
        one = embed(path, TEXTS)
        two = embed(path, TEXTS, **parallel)
        torch.testing.assert_close(two, one, atol=ATOL, rtol=0)


def _copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_missing_or_unsupported_pooling_config_says_what_is_wrong(embedding_checkpoints, tiny_llama_checkpoint,
                                                                 tmp_path):
    def problem(path: Path) -> str | None:
        return read_pooler_config(path, json.loads((path / "config.json").read_text())).problem

    assert "modules.json is missing" in problem(tiny_llama_checkpoint[0])
    with LLM(str(tiny_llama_checkpoint[0]), dtype="float32", num_blocks=16, block_size=8) as llm:
        with pytest.raises(ValueError, match="this model has no pooling config: .*modules.json is missing"):
            llm.embed("hi")
    maxed = _copy(embedding_checkpoints["llama"], tmp_path / "max")
    config = json.loads((maxed / "1_Pooling" / "config.json").read_text())
    config.update(pooling_mode_mean_tokens=False, pooling_mode_max_tokens=True)
    (maxed / "1_Pooling" / "config.json").write_text(json.dumps(config))
    assert "pooling_mode_max_tokens is not supported" in problem(maxed)
    dense = _copy(embedding_checkpoints["qwen3"], tmp_path / "dense")
    modules = json.loads((dense / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (dense / "modules.json").write_text(json.dumps(modules))
    assert "modules Transformer, Pooling, Dense, Normalize are not supported" in problem(dense)
    two = _copy(embedding_checkpoints["qwen3"], tmp_path / "two")
    (two / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": ["mean", "cls"]}))
    assert "pooling_mode ['mean', 'cls'] is not supported" in problem(two)


def test_pooling_state_folds_chunks_and_starts_over_on_recompute():
    hidden = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    mean = PoolingState("mean", normalize=False)
    assert mean.rows(0, 4, 6) == (0, 4) and mean.rows(4, 2, 6) == (0, 2)
    mean.add(0, hidden[:4])
    mean.add(0, hidden[:3])  # preempted and recomputed: the first chunk again
    mean.add(3, hidden[3:])
    assert mean.finish() == hidden.mean(dim=0).tolist()
    last = PoolingState("last", normalize=True, dimensions=1)
    assert last.rows(0, 4, 6) == (0, 0) and last.rows(4, 2, 6) == (1, 1)
    last.add(0, hidden[:0])
    last.add(4, hidden[5:])
    assert last.finish() == [1.0]
    cls = PoolingState("cls", normalize=False)
    assert cls.rows(0, 4, 6) == (0, 1) and cls.rows(4, 2, 6) == (0, 0)
    cls.add(0, hidden[:1])
    cls.add(4, hidden[4:4])
    assert cls.finish() == hidden[0].tolist()


def test_default_prompt_of_config_sentence_transformers_is_put_before_text(embedding_checkpoints, tmp_path):
    """sentence-transformers' encode puts ``prompts[default_prompt_name]`` before each text; so do we
    (token-id inputs are embedded as given)."""
    path = _copy(embedding_checkpoints["llama_cls"], tmp_path / "prompted")
    (path / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "query: ", "document": ""}, "default_prompt_name": "query"}))
    reference = st_encode(path, TEXTS)
    with LLM(str(path), dtype="float32", num_blocks=64, block_size=8) as llm:
        ours = torch.tensor([o.embedding for o in llm.embed(TEXTS)])
        prompted_ids = llm.get_tokenizer().encode("query: " + TEXTS[0])
        by_ids = llm.embed(prompted_ids)[0].embedding
    torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.tensor(by_ids), reference[0], atol=ATOL, rtol=0)
    assert not torch.allclose(ours, st_encode(embedding_checkpoints["llama_cls"], TEXTS), atol=1e-3)
    (path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {}, "default_prompt_name": "x"}))
    pooler = read_pooler_config(path, json.loads((path / "config.json").read_text()))
    assert "default_prompt_name 'x' names no prompt in prompts" in pooler.problem


@pytest.mark.parametrize("tied", [False, True], ids=["untied-no-head", "tied"])
def test_qwen3_embedding_hub_layout(embedding_checkpoints, tmp_path, tied):
    """Qwen3-Embedding's hub checkpoints say Qwen3ForCausalLM but store the bare decoder (no ``model.``
    prefix, no lm_head): the 8B's untied head is absent, so it only embeds; the 0.6B's is tied, so it
    generates too."""
    path = _copy(embedding_checkpoints["qwen3"], tmp_path / "hub")
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["Qwen3ForCausalLM"], tie_word_embeddings=tied)
    (path / "config.json").write_text(json.dumps(config))
    reference = st_encode(path, TEXTS)
    with LLM(str(path), dtype="float32", num_blocks=64, block_size=8) as llm:
        ours = torch.tensor([o.embedding for o in llm.embed(TEXTS)])
        assert llm.engine.can_generate is tied
        if tied:
            from transformers import AutoModelForCausalLM

            from tests.checkpoints import hf_greedy

            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
            prompt = llm.get_tokenizer().encode(TEXTS[1])
            out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
            assert out[0].outputs[0].token_ids == hf_greedy(model, prompt, 6)
        else:
            with pytest.raises(ValueError, match="without an LM head .*it serves embeddings only"):
                llm.generate("hi")
    torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)
