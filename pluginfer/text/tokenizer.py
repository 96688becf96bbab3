"""Tokenizer and chat template: a GGUF file's through the ``tokenizers`` library alone
(``formats/gguf/tokenizer.py``), a checkpoint's ``tokenizer.json`` the same way where transformers 5 would use it
unchanged (``text/hf_tokenizer.py``), and any other through transformers' AutoTokenizer.

A GGUF tokenizer that only transformers builds (unigram; Gemma's and Phi-3's SentencePiece variants) takes
seconds for a large vocabulary: it is pickled into ``$PLUGINFER_CACHE/tokenizers`` and unpickled on the next
load, keyed by the file, the library versions and this module's source (16 newest entries kept).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)
# the most recently written entries are kept; older ones are removed
MAX_CACHED_TOKENIZERS = 16


def load_tokenizer(path: str | Path) -> Any:
    path = Path(path)
    try:
        if path.suffix.lower() == ".gguf" and path.is_file():
            return _gguf_tokenizer(path)
        native = native_tokenizer(path)
        if native is not None:
            return native
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)  # never a model's own code
    except Exception as exc:
        raise _load_error(path, exc) from None


def _load_error(path: Path, exc: BaseException) -> ValueError:
    """One line: transformers' messages span several."""
    return ValueError(f"cannot load a tokenizer from {path}: {type(exc).__name__}: {' '.join(str(exc).split())}")


class TokenizerBuild:
    """A ``.gguf`` file's tokenizer built by ``formats/gguf/tokenizer.py`` in a thread, started before the
    weights load: the tokenizer's build holds the interpreter while the load's ``pread`` and the repack's
    native calls release it, so on two cores the two overlap.

    Only the ``tokenizers`` library's own build runs there (nothing that imports transformers, whose import
    beside the engine's could meet a module half imported); ``result()`` joins the thread and returns the
    tokenizer, or raises ``load_tokenizer``'s error; a kind transformers must build is built then, in the
    caller's thread, as ``load_tokenizer`` builds it.

    ``receive``: where the tokenizer comes from instead, called in the thread (the engine core process takes
    the one its server built, ``engine/engine_core.py``); it returns the tokenizer, or None when there is none
    to take, and then ``result()`` is None too (the caller loads one with ``load_tokenizer``)."""

    def __init__(self, path: str | Path, receive: Callable[[], Any] | None = None) -> None:
        import tokenizers  # noqa: F401 - imported here, not in the thread beside the engine's own imports

        self.path = Path(path).expanduser()
        self.received = receive is not None
        self.seconds = 0.0  # the build's wall-clock time in its thread
        self._source = receive or (lambda: native_gguf_tokenizer(self.path))
        self._tokenizer: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._build, name="pluginfer-tokenizer", daemon=True)
        self._thread.start()

    @staticmethod
    def applies(path: str | Path) -> bool:
        """Whether ``path`` is a local ``.gguf`` file (whose tokenizer this class builds)."""
        path = Path(path).expanduser()
        return path.suffix.lower() == ".gguf" and path.is_file()

    def _build(self) -> None:
        started = time.perf_counter()
        try:
            self._tokenizer = self._source()
        except BaseException as exc:  # noqa: BLE001 - raised again by result(), in the caller's thread
            self._error = exc
        self.seconds = time.perf_counter() - started

    def join(self) -> None:
        self._thread.join()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise _load_error(self.path, self._error) from None
        if self._tokenizer is not None or self.received:
            return self._tokenizer
        try:  # a kind the tokenizers library alone does not build
            return transformers_gguf_tokenizer(self.path)
        except Exception as exc:
            raise _load_error(self.path, exc) from None


def gguf_tokenizer_cache_path(path: str | Path) -> Path:
    """Where the tokenizer transformers built from the GGUF file ``path`` is cached."""
    from importlib.metadata import version

    path = Path(path).resolve()
    stat = path.stat()
    source = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()  # how it is built is part of the key
    identity = (f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{version('transformers')}|{version('tokenizers')}|"
                f"{sys.version_info[:2]}|{source}")
    root = Path(os.environ.get("PLUGINFER_CACHE", Path.home() / ".cache" / "pluginfer"))
    return root / "tokenizers" / f"{hashlib.sha256(identity.encode()).hexdigest()[:32]}.pickle"


def _gguf_tokenizer(path: Path) -> Any:
    tokenizer = native_gguf_tokenizer(path)
    return tokenizer if tokenizer is not None else transformers_gguf_tokenizer(path)


def native_tokenizer(path: str | Path) -> Any:
    """The tokenizer of a GGUF file or a checkpoint directory built without transformers (nor torch), or None
    where transformers must build it (``formats/gguf/tokenizer.py``, ``text/hf_tokenizer.py`` say when)."""
    from pluginfer.text.hf_tokenizer import build_hf_tokenizer

    path = Path(path).expanduser()
    return build_hf_tokenizer(path) if path.is_dir() else native_gguf_tokenizer(path)


def native_gguf_tokenizer(path: str | Path) -> Any:
    """A ``.gguf`` file's tokenizer built by ``formats/gguf/tokenizer.py`` (neither torch nor transformers is
    imported); None for a path that is not a GGUF file, or a tokenizer kind that transformers must build."""
    from pluginfer.formats.gguf.reader import GGUFFile
    from pluginfer.formats.gguf.tokenizer import build_gguf_tokenizer

    path = Path(path)
    if path.suffix.lower() != ".gguf" or not path.is_file():
        return None
    return build_gguf_tokenizer(GGUFFile(path, tensors=False))


def transformers_gguf_tokenizer(path: Path) -> Any:
    """The GGUF file's tokenizer as transformers builds it, cached (the module's docstring says how)."""
    from transformers import AutoTokenizer

    cached = gguf_tokenizer_cache_path(path)
    if cached.is_file():
        try:
            return pickle.loads(cached.read_bytes())
        except Exception as exc:  # a broken entry: build the tokenizer again, and replace it
            logger.info("tokenizer cache %s unreadable (%s: %s); building the tokenizer", cached,
                        type(exc).__name__, exc)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except ValueError:
        # an architecture transformers reads no model config of (gemma, phi2, glm4): its vocabulary
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        data = pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{os.getpid()}.partial")
        partial.write_bytes(data)
        os.replace(partial, cached)  # a reader never sees half an entry
        _prune(cached.parent)
    except Exception as exc:
        # no cache entry; the tokenizer is built, nothing else changes
        logger.info("cannot cache the tokenizer of %s in %s: %s: %s", path, cached, type(exc).__name__, exc)
    return tokenizer


def eos_token_ids(tokenizer: Any, model_path: Path, hf_config: dict) -> set[int]:
    """EOS ids from the tokenizer, config.json and generation_config.json (which may list several)."""
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))

    add(tokenizer.eos_token_id)
    add(hf_config.get("eos_token_id"))
    generation = model_path / "generation_config.json"
    if generation.is_file():
        add(json.loads(generation.read_text()).get("eos_token_id"))
    return ids


def template_renders_tools(template: Any) -> bool:
    """Whether a chat template reads ``tools`` (one that does not would drop them silently)."""
    return bool(re.search(r"\btools\b", str(template or "")))


def render_chat(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None, **template_kwargs: Any) -> str:
    """The prompt text for a conversation (and the tools it may call, OpenAI's format), from the
    checkpoint's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat_template; use completions with a plain prompt")
    if tools and not template_renders_tools(tokenizer.chat_template):
        raise ValueError("tools: this model's chat template does not render tools")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         tokenize=False, tools=tools, **template_kwargs)


def _prune(directory: Path) -> None:
    """Keep the ``MAX_CACHED_TOKENIZERS`` newest entries (one per file and version: tests and rewritten files
    would otherwise add entries without end)."""
    entries = []
    for entry in directory.glob("*.pickle"):
        try:
            entries.append((entry.stat().st_mtime_ns, entry))
        except FileNotFoundError:  # another process pruned it meanwhile
            continue
    entries.sort(reverse=True)
    for _, stale in entries[MAX_CACHED_TOKENIZERS:]:
        stale.unlink(missing_ok=True)
