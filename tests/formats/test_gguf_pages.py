"""What a GGUF model copies at load keeps none of its file pages (formats/gguf/checkpoint.read_file_bytes,
release_file_pages).

The fused q/k/v and gate/up groups (read from the file with pread), llama's reordered q/k rows and a
tensor-parallel rank's columns (released after the copy) are copies; the file pages they came from must
not stay resident in the process, or every such weight counts twice. The tensors read in place (o_proj, down_proj) stay mapped and resident. Residency is read
per page from Linux's ``/proc/self/pagemap`` (bit 63: the page is mapped in this process).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from pluginfer import LLM, SamplingParams
from pluginfer.cli.convert import convert_to_gguf
from pluginfer.formats.gguf.checkpoint import GGMLTensor, read_file_bytes, release_file_pages
from pluginfer.formats.gguf.reader import GGUFFile
from tests.conftest import TINY_LLAMA

pytestmark = pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="needs Linux's /proc/self/pagemap")

PAGE = mmap.PAGESIZE
# A read fault maps the file's cached pages up to this far around it (Linux's fault_around_bytes default): a
# neighbour read after a release may map a released tensor's pages back within this distance of its ends.
FAULT_AROUND = 64 * 1024
# Tensors of whole pages well past the fault-around margin in Q8_0 (q/k/v 278 KB, gate/up 835 KB).
WIDE_LLAMA = dict(TINY_LLAMA, hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=8)


def resident(address: int, length: int) -> list[bool]:
    """For each page of ``[address, address + length)`` (page-aligned): whether it is mapped in this process."""
    assert address % PAGE == 0 and length % PAGE == 0
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(address // PAGE * 8)
        entries = struct.unpack(f"<{length // PAGE}Q", pagemap.read(length // PAGE * 8))
    return [bool(entry >> 63) for entry in entries]


def interior(base: int, start: int, length: int) -> tuple[int, int]:
    """The whole pages of file bytes ``[start, start + length)``, mapped from ``base``, farther than the
    fault-around margin from both ends, as (address, length); the range must hold some."""
    first = -(-(base + start + FAULT_AROUND) // PAGE) * PAGE
    end = (base + start + length - FAULT_AROUND) // PAGE * PAGE
    assert end - first >= 4 * PAGE, "the test's tensors are too small to see past the fault-around margin"
    return first, end - first


def mapping_base(path: Path, tensor: torch.Tensor) -> int:
    """Where this process maps byte 0 of ``path`` in the mapping that holds ``tensor`` (/proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path.resolve()):
            start, end = (int(address, 16) for address in fields[0].split("-"))
            if start <= tensor.data_ptr() < end:
                return start - int(fields[2], 16)
    raise AssertionError(f"a tensor read in place is not a view of a mapping of {path}")


@pytest.fixture(scope="module")
def wide_gguf(tiny_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.checkpoints import save_hf_model

    out = tmp_path_factory.mktemp("wide_llama")
    save_hf_model("LlamaForCausalLM", WIDE_LLAMA, out / "hf", tiny_tokenizer_dir)
    return convert_to_gguf(out / "hf", out / "wide.gguf", "q8_0", "q8_0")


def test_release_drops_the_file_pages_and_a_read_brings_back_the_file_bytes(wide_gguf: Path) -> None:
    file = GGUFFile(wide_gguf)
    info = max(file.tensors, key=lambda t: t.n_bytes)
    tensor = torch.from_numpy(info.data)
    expected = tensor.clone()
    address, length = interior(file.address, info.data_offset, info.n_bytes)
    assert all(resident(address, length))  # read by the clone
    released = release_file_pages(tensor)
    assert released >= length and released <= info.n_bytes
    assert not any(resident(address, length))
    assert torch.equal(tensor, expected)  # read again: the file's bytes, mapped back
    assert all(resident(address, length))


def test_read_file_bytes_copies_without_mapping_the_pages(wide_gguf: Path) -> None:
    file = GGUFFile(wide_gguf)
    info = max(file.tensors, key=lambda t: t.n_bytes)
    source = torch.from_numpy(info.data)
    address, length = interior(file.address, info.data_offset, info.n_bytes)
    release_file_pages(source)
    target = torch.empty_like(source)
    assert read_file_bytes(source, target)
    assert not any(resident(address, length))  # read from the file, not through the mapping
    assert torch.equal(target, source)  # (this comparison maps them)
    assert not read_file_bytes(target, torch.empty_like(target))  # not a view of a file: copy it another way
    assert not read_file_bytes(source[:, ::2], torch.empty_like(source[:, ::2]))  # not contiguous


def test_release_leaves_memory_that_is_not_a_mapped_file_alone() -> None:
    tensor = torch.arange(4 * PAGE, dtype=torch.int32)
    expected = tensor.clone()
    assert release_file_pages(tensor) == 0
    assert release_file_pages(tensor[::2]) == 0
    assert torch.equal(tensor, expected)


def test_a_loaded_model_keeps_only_the_pages_it_reads_in_place(wide_gguf: Path) -> None:
    llm = LLM(model=str(wide_gguf), num_blocks=16, block_size=8)
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    layers = llm.engine.executor.pipeline.model.layers
    base = mapping_base(wide_gguf, layers[0].self_attn.o_proj.gguf_groups[0][1])
    tensors = {t.name: t for t in GGUFFile(wide_gguf).tensors}  # offsets (this reading maps the file apart)
    for block in range(len(layers)):
        for copied in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up"):  # in the fused groups
            info = tensors[f"blk.{block}.{copied}.weight"]
            pages = resident(*interior(base, info.data_offset, info.n_bytes))
            assert not any(pages), f"{info.name}: {sum(pages)} of {len(pages)} pages resident after its copy"
        for in_place in ("attn_output", "ffn_down"):  # read by every step where they lie
            info = tensors[f"blk.{block}.{in_place}.weight"]
            assert all(resident(*interior(base, info.data_offset, info.n_bytes))), info.name


def test_tensor_parallel_ranks_keep_no_page_of_their_copies(tmp_path: Path) -> None:
    """Thread ranks of a merged (gate/up), a QKV and a row-parallel layer load Q8_0 tensors mapped from a file:
    each rank's rows (fused, so copied) and columns (copied) leave no resident page, and the ranks hold the
    same weights and outputs as from tensors in memory."""
    from tests.quant.tensor_parallel_harness import Case, float_cases, rand, rank_rows, run_layer
    from tests.quant.test_tensor_parallel import gguf_method, to_ggml

    world = 2
    cases = float_cases(1024, 4096, lambda w: to_ggml(w, GGMLQuantizationType.Q8_0), seed=0, qkv=(8, 4, 128),
                        out=512)
    writer = GGUFWriter(tmp_path / "layers.gguf", "llama")
    names = {}
    for kind in ("merged", "qkv-gqa", "row"):
        for index, (param, tensor, _) in enumerate(cases[kind].tensors):
            if param == "weight":
                names[(kind, index)] = f"{kind}.{index}"
                writer.add_tensor(f"{kind}.{index}", tensor.raw.numpy(), raw_dtype=tensor.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = GGUFFile(tmp_path / "layers.gguf")
    infos = {t.name: t for t in file.tensors}
    for kind in ("merged", "qkv-gqa", "row"):
        case = cases[kind]
        mapped = [(param, GGMLTensor(torch.from_numpy(infos[names[(kind, i)]].data), t.qtype, t.shape, t.name)
                   if (kind, i) in names else t, shard) for i, (param, t, shard) in enumerate(case.tensors)]
        mapped_case = Case(case.kind, case.make, mapped, case.input_size, case.projections, case.kv_heads)
        x = rand(5, case.input_size, seed=1000)
        ranks, expected = run_layer(world, gguf_method, mapped_case, x), run_layer(world, gguf_method, case, x)
        for rank, reference in zip(ranks, expected, strict=True):
            assert torch.equal(rank.weight, reference.weight) and torch.equal(rank.out, reference.out)
        for i, (_, tensor, shard) in enumerate(case.tensors):
            if (kind, i) not in names:
                continue
            info = infos[names[(kind, i)]]
            row_bytes = info.n_bytes // tensor.shape[0]
            # A row-parallel rank reads every row (its columns); a column-parallel one its own rows.
            projection = {"q": 0, "k": 1, "v": 2}.get(shard, shard)
            spans = [(0, tensor.shape[0])] if kind == "row" else \
                sorted({(rows.start, rows.stop) for rows in (rank_rows(case, projection, r, world) for r in range(world))})
            for start, stop in spans:
                pages = resident(*interior(file.address, info.data_offset + start * row_bytes, (stop - start) * row_bytes))
                assert not any(pages), f"{kind} tensor {i} rows {start}:{stop}: {sum(pages)} pages resident"
