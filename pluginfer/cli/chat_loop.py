"""The terminal side of ``pluginfer chat``, shared by the local engine and a remote server."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

# Errors a turn may end with (a refused request, a broken stream); the conversation goes on.
TurnError = (ValueError, OSError, TypeError, AttributeError, RuntimeError)


def chat_loop(system: str | None, answer: Callable[[list[dict]], Iterator[str]]) -> int:
    """Read user turns until an empty line or EOF; stream each answer's pieces to stdout.

    A turn that fails prints the reason, is dropped from the history, and makes the exit status 1;
    Ctrl-C stops the answer being streamed and keeps what arrived.
    """
    messages = [{"role": "system", "content": system}] if system else []
    interactive = sys.stdin.isatty()
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
        try:
            for piece in answer(messages):
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
        messages.append({"role": "assistant", "content": "".join(pieces)})
    return status
