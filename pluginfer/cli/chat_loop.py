"""The terminal side of ``pluginfer chat``, shared by the local engine and a remote server."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

# Errors a turn may end with (a refused request, a broken stream); the conversation goes on.
TurnError = (ValueError, OSError, TypeError, AttributeError, RuntimeError)


@dataclass(frozen=True)
class TurnEnd:
    """The last item an answer may yield after its text pieces: why it ended (OpenAI's finish_reason)."""

    finish_reason: str | None


def _line_editing() -> None:
    """Arrow keys, editing and the history of this session's lines for ``input()``, where Python has readline."""
    try:
        import readline  # noqa: F401 - importing it is what gives input() line editing
    except ImportError:  # e.g. Windows without pyreadline: plain input
        pass


def sampling_note(values: dict[str, object]) -> str:
    """`` (temperature 0.6, top_p 0.95)`` for the banner: the sampling the answers take; empty when none is known."""
    known = [f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}"
             for name, value in values.items() if value is not None]
    return f" ({', '.join(known)})" if known else ""


def chat_loop(system: str | None, answer: Callable[[list[dict]], Iterator[str | TurnEnd]],
              model: str | None = None, max_tokens: int | None = None, sampling: str = "") -> int:
    """Read user turns until an empty line or EOF; stream each answer's pieces to stdout.

    On a terminal: line editing and history, a banner naming ``model``, its ``sampling`` (``sampling_note``)
    and how to quit (on stderr). An answer
    cut at ``max_tokens`` is marked on stderr, so stdout holds the answers alone. A turn that fails prints the
    reason, is dropped from the history, and makes the exit status 1; Ctrl-C stops the answer being streamed
    and keeps what arrived.
    """
    messages = [{"role": "system", "content": system}] if system else []
    interactive = sys.stdin.isatty()
    if interactive:
        _line_editing()
        print(f"pluginfer chat with {model or 'the model'}{sampling}: an empty line or Ctrl-D ends, Ctrl-C stops an "
              "answer; up and down arrows recall earlier lines", file=sys.stderr, flush=True)
    status = 0
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        pieces: list[str] = []
        reason = None
        try:
            for piece in answer(messages):
                if isinstance(piece, TurnEnd):
                    reason = piece.finish_reason
                    continue
                pieces.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            pass
        except TurnError as exc:
            sys.stdout.write("\n")
            print(f"pluginfer: error: {exc}", file=sys.stderr)
            messages.pop()
            status = 1
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        if reason == "length":
            limit = f" (--max-tokens {max_tokens})" if max_tokens else ""
            print(f"[stopped at the token limit{limit}]", file=sys.stderr, flush=True)
        messages.append({"role": "assistant", "content": "".join(pieces)})
    return status
