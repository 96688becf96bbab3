"""``pluginfer generate`` (one prompt, or several) and ``pluginfer chat`` (interactive, streamed)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pluginfer.cli.chat_loop import TurnEnd, chat_loop, sampling_note

if TYPE_CHECKING:
    from pluginfer.core.config import EngineConfig, SamplingDefaults
    from pluginfer.engine.engine import LLMEngine
    from pluginfer.engine.sequence import SamplingParams


def _sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser = parser.add_argument_group("this command's requests (over the request defaults)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    unset = "; unset: --default-{} or the config's sampling section, else the model's generation_config.json"
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature" +
                        unset.format("temperature") + ", else 1.0")
    parser.add_argument("--top-p", type=float, default=None, help="top-p" + unset.format("top-p") + ", else 1.0")
    parser.add_argument("--top-k", type=int, default=None, help="top-k" + unset.format("top-k") + ", else 0: off")
    parser.add_argument("--min-p", type=float, default=None, help="min-p" + unset.format("min-p") + ", else 0")
    parser.add_argument("--repetition-penalty", type=float, default=None,
                        help="repetition penalty" + unset.format("repetition-penalty") + ", else 1.0")
    parser.add_argument("--sampling-seed", type=int, default=None, help="seed of the sampler for this request")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")


def register(commands: argparse._SubParsersAction, add_engine_arguments: Callable) -> None:
    generate = commands.add_parser("generate", help="complete one or more prompts and print the text",
                                   usage="%(prog)s --model MODEL --prompt TEXT [--prompt TEXT ...] [options]")
    add_engine_arguments(generate)
    generate.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    generate.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user message")
    _sampling_arguments(generate)
    generate.set_defaults(run=run_generate)

    chat = commands.add_parser("chat", help="interactive chat with streamed answers (empty line or Ctrl-D ends)",
                               usage="%(prog)s (--model MODEL | --base-url URL [--model NAME]) [options]")
    add_engine_arguments(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--base-url", default=None,
                      help="talk to a running OpenAI-compatible server instead (--model: the name to ask for)")
    chat.add_argument("--api-key", default=None, help="with --base-url: sent as 'Authorization: Bearer KEY'")
    _sampling_arguments(chat)
    chat.set_defaults(run=run_chat)


def _params(args: argparse.Namespace, defaults: SamplingDefaults) -> SamplingParams:
    from pluginfer.engine.sequence import SamplingParams

    def pick(name: str) -> float | int:
        given = getattr(args, name)
        return getattr(defaults, name) if given is None else given

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=pick("temperature"), top_p=pick("top_p"), top_k=pick("top_k"),
        min_p=pick("min_p"), repetition_penalty=pick("repetition_penalty"), seed=args.sampling_seed,
        stop=args.stop, ignore_eos=args.ignore_eos,
    )


def _engine(args: argparse.Namespace) -> tuple[LLMEngine, EngineConfig]:
    from pluginfer.cli import engine_config
    from pluginfer.engine.engine import LLMEngine

    config = engine_config(args)
    return LLMEngine(config), config


def run_generate(args: argparse.Namespace) -> int:
    from pluginfer.text.tokenizer import render_chat

    engine, config = _engine(args)
    params = _params(args, engine.sampling_defaults)
    order = []
    for prompt in args.prompt:
        if args.chat_template:
            text = render_chat(engine.tokenizer, [{"role": "user", "content": prompt}])
            prompt = engine.tokenizer.encode(text, add_special_tokens=False)
        order.append(engine.add_request(prompt, params))
    done = {}
    while len(done) < len(order):
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    for index, (request_id, prompt) in enumerate(zip(order, args.prompt), 1):
        output = done[request_id]
        if len(order) > 1:
            # several prompts: each answer under a line naming its prompt
            print(f"--- prompt {index}: {prompt}")
        if output.error:
            print(f"pluginfer: error: {output.error}", file=sys.stderr)
            continue
        for choice in output.outputs:
            print(choice.text)
    return 1 if any(done[r].error for r in order) else 0


def run_chat(args: argparse.Namespace) -> int:
    if args.base_url:
        from pluginfer.cli import remote_chat

        return remote_chat.run(args)
    from pluginfer.text.tokenizer import render_chat

    engine, config = _engine(args)
    params = _params(args, engine.sampling_defaults)

    def answer(messages: list[dict]) -> Iterator[str | TurnEnd]:
        prompt = engine.tokenizer.encode(render_chat(engine.tokenizer, messages), add_special_tokens=False)
        request_id = engine.add_request(prompt, params)
        printed = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    text = output.outputs[0].text
                    yield text[printed:]
                    printed = len(text)
                    if output.finished and output.error:
                        raise ValueError(output.error)
                    if output.finished:
                        yield TurnEnd(output.outputs[0].finish_reason)
        finally:
            engine.abort_request(request_id)  # Ctrl-C mid-answer: free its blocks (no-op once finished)

    name = config.server.served_model_name or Path(config.model).name
    sampling = sampling_note({"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                              "min_p": params.min_p, "repetition_penalty": params.repetition_penalty})
    return chat_loop(args.system, answer, model=name, max_tokens=args.max_tokens, sampling=sampling)
