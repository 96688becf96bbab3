"""Chat templates rendered through jinja2 as transformers' ``apply_chat_template`` renders them, without
importing transformers.

As in transformers 5 (``utils/chat_template_utils.py``): an immutable sandbox with ``trim_blocks``,
``lstrip_blocks``, ``loopcontrols`` and a ``{% generation %}`` tag; its ``tojson``, ``raise_exception``,
``strftime_now``, ``dict`` and ``namespace``; inputs rebuilt from plain JSON types, None-valued message keys
dropped, ``reasoning_content`` filled from ``thinking``/``reasoning``; the special tokens as variables.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# apply_chat_template's own options that make no difference to the text (tokenize=False): not template variables
_TOKENIZING_OPTIONS = ("padding", "truncation", "max_length", "return_tensors", "return_dict", "tokenizer_kwargs")
_UNSUPPORTED_OPTIONS = ("sanitize_control_tokens", "return_assistant_tokens_mask")


def render_chat_template(template: str, messages: list[dict], special_tokens: Mapping[str, str],
                         add_generation_prompt: bool = False, tools: list[dict] | None = None,
                         documents: list[dict] | None = None, continue_final_message: bool | str = False,
                         **kwargs: Any) -> str:
    """The text of one conversation; ``kwargs`` are the template's own variables."""
    for name in _UNSUPPORTED_OPTIONS:
        if kwargs.pop(name, False):
            raise ValueError(f"{name} is not supported for this tokenizer's chat template")
    for name in _TOKENIZING_OPTIONS:
        kwargs.pop(name, None)
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    if tools is not None:
        for tool in tools:
            if not isinstance(tool, dict):
                raise ValueError("Tools should be JSON schemas (dicts)")
    if documents is not None:
        for document in documents:
            if not isinstance(document, dict):
                raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    chat = _plain([{key: value for key, value in message.items() if value is not None} for message in messages])
    for message in chat:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
    chat = _alias_reasoning_fields(chat)
    variables = _plain({**special_tokens, **kwargs})
    final_message = ""
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final_message = chat[-1].get(field)
        if final_message is None:
            raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
        fields = [field]
        if field in _REASONING_FIELDS:
            fields = [name for name in _REASONING_FIELDS if chat[-1].get(name) == final_message]
        if not any(name in template for name in fields):
            raise ValueError(f'continue_final_message is set to "{field}" but this is not an accepted field in the '
                             "chat_template")
        if isinstance(final_message, (list, tuple)):
            for block in reversed(final_message):
                if "text" in block:
                    final_message = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ValueError("continue_final_message is set but we could not find any text to continue in the "
                                 "final message!")
        else:
            for name in fields:
                chat[-1][name] = chat[-1][name] + _CONTINUE_TAG
    rendered = _compile(template).render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                         add_generation_prompt=add_generation_prompt, **variables)
    if continue_final_message:
        if final_message.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
            raise ValueError("continue_final_message is set but the final message does not appear in the chat after "
                             "applying the chat template")
        at = rendered.rindex(_CONTINUE_TAG.strip())
        rendered = rendered[:at] if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else rendered[:at].rstrip()
    return rendered


def _alias_reasoning_fields(chat: list[dict]) -> list[dict]:
    aliased = []
    for message in chat:
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _plain(value: Any) -> Any:
    """What a template may see: plain JSON types, rebuilt (objects with methods become ``<TypeName>``)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
        return _plain(value.item())  # a numpy scalar (np.bool_(False) must stay falsy)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers marks the assistant's tokens with it)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's own signature trick
            self, args = args[0], args[1:]
            attributes = dict(*args, **kwargs)
            for name in attributes:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attributes)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[GenerationBlock, loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    environment.globals["dict"] = TemplateDict()
    environment.globals["namespace"] = TemplateNamespace
    return environment.from_string(template)

