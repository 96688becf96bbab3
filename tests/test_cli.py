"""The ``pluginfer`` command, run as users run it: ``python -m pluginfer ...`` in a subprocess.

Each run imports torch and transformers (seconds), so only what needs a real process runs in
one; flag parsing and error reporting are checked in-process through ``pluginfer.cli.main``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pluginfer import LLM, SamplingParams
from pluginfer.cli import build_parser, engine_config, main


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """PLUGINFER_CACHE of every run in this module (the demo model is built here)."""
    return tmp_path_factory.mktemp("pluginfer_cache")


def run_cli(*args: str, cache: Path, stdin: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PLUGINFER_CACHE": str(cache), "PYTHONIOENCODING": "utf-8", "HF_HUB_OFFLINE": "1"}
    env.pop("PLUGINFER_PLUGINS", None)  # the built-ins must all load
    return subprocess.run([sys.executable, "-m", "pluginfer", *args], input=stdin, capture_output=True,
                          text=True, encoding="utf-8", env=env, cwd=cache, timeout=300)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_checkpoint) -> LLM:
    """The in-process oracle for what the command prints."""
    return LLM(model=str(tiny_llama_checkpoint[0]), dtype="float32", num_blocks=64, block_size=8)


def test_plugins_lists_the_builtins_as_usable(cache_dir):
    result = run_cli("plugins", cache=cache_dir)
    assert result.returncode == 0, result.stderr
    for kind, name in [("model", "llama"), ("backend", "cpu"), ("quant", "none"), ("collective", "single")]:
        line = re.search(rf"^\s+{kind} {name}\b.*$", result.stdout, re.MULTILINE)
        assert line and line.group(0).endswith("- usable"), (kind, name, result.stdout)


def test_config_schema_prints_json(cache_dir):
    result = run_cli("config-schema", cache=cache_dir)
    assert result.returncode == 0, result.stderr
    schema = json.loads(result.stdout)
    assert {"cache", "scheduler", "parallel"} <= set(schema["properties"])


def test_generate_prints_the_text(cache_dir, tiny_llama_checkpoint, llm):
    result = run_cli("generate", "--model", str(tiny_llama_checkpoint[0]), "--prompt", "hello",
                     "--max-tokens", "5", "--temperature", "0", "--ignore-eos", cache=cache_dir)
    assert result.returncode == 0, result.stderr
    [expected] = llm.generate("hello", _greedy(5))
    assert result.stdout == expected.outputs[0].text + "\n"


def test_generate_prints_each_prompt_and_its_text(cache_dir, tiny_llama_checkpoint, llm):
    prompts = ["hello", "the cat sat"]
    result = run_cli("generate", "--model", str(tiny_llama_checkpoint[0]), "--prompt", prompts[0], "--prompt",
                     prompts[1], "--max-tokens", "4", "--temperature", "0", "--ignore-eos", cache=cache_dir)
    assert result.returncode == 0, result.stderr
    expected = [o.outputs[0].text for o in llm.generate(prompts, _greedy(4))]
    assert result.stdout == (f"--- prompt 1: hello\n{expected[0]}\n"
                             f"--- prompt 2: the cat sat\n{expected[1]}\n")


def test_chat_answers_each_line_of_stdin(cache_dir, tiny_llama_checkpoint, llm):
    result = run_cli("chat", "--model", str(tiny_llama_checkpoint[0]), "--max-tokens", "5",
                     "--temperature", "0", "--ignore-eos", cache=cache_dir, stdin="Hello\nTell me more\n")
    assert result.returncode == 0, result.stderr
    # The same conversation through the API: the first answer becomes the assistant's turn.
    conversation = [{"role": "user", "content": "Hello"}]
    first = llm.chat(conversation, _greedy(5))[0].outputs[0].text
    conversation += [{"role": "assistant", "content": first}, {"role": "user", "content": "Tell me more"}]
    second = llm.chat(conversation, _greedy(5))[0].outputs[0].text
    assert result.stdout == f"{first}\n{second}\n"


def test_missing_model_is_one_line_naming_the_path(cache_dir, tmp_path):
    missing = tmp_path / "nonexistent"
    result = run_cli("generate", "--model", str(missing), "--prompt", "x", cache=cache_dir)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert str(missing) in line and "does not exist" in line


@pytest.mark.slow
def test_demo_model_is_built_once_and_called_noise(cache_dir, monkeypatch):
    result = run_cli("generate", "--model", "demo", "--prompt", "hello", "--max-tokens", "5", cache=cache_dir)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() and "noise" not in result.stdout
    assert "noise" in result.stderr
    demo = cache_dir / "demo-v1"
    assert (demo / "config.json").is_file() and (demo / "tokenizer.json").is_file()

    from pluginfer.demo.model import ensure_demo_model

    monkeypatch.setenv("PLUGINFER_CACHE", str(cache_dir))
    weights = demo / "model.safetensors"
    built_at = weights.stat().st_mtime_ns
    assert ensure_demo_model() == demo
    assert weights.stat().st_mtime_ns == built_at  # found, not rebuilt
    assert sorted(p.name for p in cache_dir.iterdir() if p.name.startswith("demo")) == ["demo-v1"]


def test_flags_override_the_config_file(tmp_path):
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("model: m\ncache:\n  block_size: 8\n  enable_prefix_caching: false\n"
                      "scheduler:\n  max_num_seqs: 4\n")
    parser = build_parser()
    base = ["generate", "--config", str(deploy), "--prompt", "p"]
    from_file = engine_config(parser.parse_args(base))
    assert from_file.cache.block_size == 8 and from_file.cache.enable_prefix_caching is False
    assert from_file.scheduler.max_num_seqs == 4

    flagged = engine_config(parser.parse_args(base + [
        "--model", "other", "--block-size", "32", "--kv-cache-memory", "2GiB", "--enable-prefix-caching",
        "--no-enable-chunked-prefill", "--dtype", "bfloat16"]))
    assert flagged.model == "other" and flagged.dtype == "bfloat16"
    assert flagged.cache.block_size == 32 and flagged.cache.kv_cache_memory == 2 * 2**30
    assert flagged.cache.enable_prefix_caching is True and flagged.scheduler.enable_chunked_prefill is False
    assert flagged.scheduler.max_num_seqs == 4


def test_invalid_config_file_is_one_line_naming_the_fields(tiny_llama_checkpoint, tmp_path, capsys):
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(f"model: {tiny_llama_checkpoint[0]}\ncache:\n  block_size: 0\nscheduler:\n  max_num_seq: 4\n")
    assert main(["generate", "--config", str(deploy), "--prompt", "x"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "cache.block_size" in line and "scheduler.max_num_seq" in line


def test_unknown_architecture_is_one_line(unknown_architecture_checkpoint, capsys):
    assert main(["generate", "--model", str(unknown_architecture_checkpoint), "--prompt", "x"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "FooForCausalLM" in line and "llama" in line


def test_serve_on_a_port_in_use_is_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """The port is checked first: the model named here does not exist, and the error is still the port's."""
    import socket

    monkeypatch.setenv("PLUGINFER_ENGINE_PROCESS", "0")  # no engine core process spawned ahead for this run
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert main(["serve", "--model", str(tmp_path / "no-such-model"), "--port", str(port)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"pluginfer: error: 127.0.0.1:{port} is in use"]
    assert main(["serve", "--model", str(tmp_path / "no-such-model"), "--host", "192.0.2.1", "--port", "8000"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("pluginfer: error: cannot listen on 192.0.2.1:8000: "), line


def _help(*command: str, capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*command, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def _group(text: str, title: str) -> str:
    """The lines of one --help group: from its title to the next unindented line."""
    start = text.index(f"\n{title}:\n") + len(title) + 3
    end = re.search(r"^\S", text[start:], re.MULTILINE)
    return text[start:start + end.start()] if end else text[start:]


def test_serve_help_groups_the_flags_by_config_section_and_hides_the_test_only_ones(capsys):
    from pluginfer.cli.options import options

    text = _help("serve", capsys=capsys)
    assert text.startswith("usage: pluginfer serve --model MODEL [--config FILE] [options]\n")
    titles = {"": "model and engine", "parallel": "parallel (config section parallel:)",
              "cache": "KV cache (config section cache:)", "scheduler": "scheduler (config section scheduler:)",
              "sampling": "request defaults (config section sampling:; what a request that sets none gets)",
              "speculative_config": "speculative decoding (config section speculative_config:)",
              "lora": "LoRA adapters (config section lora:)", "server": "server (config section server:)"}
    for option in options():
        if option.section == "testing":  # fault injection: accepted, not shown
            assert option.flag not in text
            assert build_parser().parse_args(["serve", option.flag, "5"]).__dict__[option.dotted] == 5
        else:
            assert re.search(rf"^  {option.flag}\b", _group(text, titles[option.section]), re.MULTILINE), option.flag
    model = " ".join(_group(text, "model and engine").split())
    assert "--model MODEL A Hugging Face checkpoint directory, a hub id, a .gguf file, or 'demo'" in model
    sampling = " ".join(_group(_help("generate", capsys=capsys),
                                "this command's requests (over the request defaults)").split())
    assert ("--temperature TEMPERATURE sampling temperature; unset: --default-temperature or the config's sampling "
            "section, else the model's generation_config.json, else 1.0") in sampling


class _Terminal:
    """``pluginfer`` on a pseudo-terminal, as a user types at it: what it writes, with the terminal's escape
    sequences and carriage returns taken out."""

    def __init__(self, *args: str, cache: Path) -> None:
        import pty

        self.master, worker = pty.openpty()
        env = {**os.environ, "PLUGINFER_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "TERM": "xterm",
               "PYTHONIOENCODING": "utf-8"}
        env.pop("PLUGINFER_PLUGINS", None)
        self.process = subprocess.Popen([sys.executable, "-m", "pluginfer", *args], stdin=worker, stdout=worker,
                                        stderr=worker, env=env, cwd=cache, close_fds=True)
        os.close(worker)
        self.seen = ""

    def read_until(self, text: str, timeout: float = 120, after: int = 0) -> str:
        """Read until ``text`` shows past the first ``after`` characters seen."""
        import select
        import time

        deadline = time.monotonic() + timeout
        while text not in self.seen[after:]:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"{text!r} never came: {self.seen!r}"
            if select.select([self.master], [], [], remaining)[0]:
                try:
                    chunk = os.read(self.master, 4096).decode("utf-8", "replace")
                except OSError:  # the process closed the terminal
                    break
                self.seen += re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]|\r", "", chunk)
        return self.seen

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def close(self) -> int:
        try:
            return self.process.wait(timeout=60)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            os.close(self.master)


def test_chat_on_a_terminal_has_a_banner_history_and_marks_a_cut_answer(cache_dir, tiny_llama_checkpoint, llm):
    checkpoint = tiny_llama_checkpoint[0]
    terminal = _Terminal("chat", "--model", str(checkpoint), "--max-tokens", "3", "--temperature", "0",
                         "--ignore-eos", cache=cache_dir)
    try:
        terminal.read_until("\n> ")
        assert (f"pluginfer chat with {checkpoint.name} (temperature 0, top_p 1, top_k 0, min_p 0, repetition_penalty "
                "1): an empty line or Ctrl-D ends, Ctrl-C stops an answer; up and down arrows recall earlier lines"
                ) in terminal.seen
        terminal.type("Hello\n")
        terminal.read_until("(--max-tokens 3)]\n> ")
        terminal.type("\x1b[A\n")  # the up arrow recalls "Hello" (readline's history), sent again
        terminal.read_until("(--max-tokens 3)]\n> ", after=terminal.seen.rindex("> "))
        terminal.type("\n")
    finally:
        code = terminal.close()
    conversation = [{"role": "user", "content": "Hello"}]
    first = llm.chat(conversation, _greedy(3))[0].outputs[0].text
    conversation += [{"role": "assistant", "content": first}, {"role": "user", "content": "Hello"}]
    second = llm.chat(conversation, _greedy(3))[0].outputs[0].text
    assert code == 0
    assert (f"> Hello\n{first}\n[stopped at the token limit (--max-tokens 3)]\n"
            f"> Hello\n{second}\n[stopped at the token limit (--max-tokens 3)]\n> ") in terminal.seen, terminal.seen
