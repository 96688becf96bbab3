"""The typed messages between the server and the engine core (pluginfer/engine/messages.py) and their framing.

Every message type goes through a frame and comes back equal (fields and type); a frame split anywhere
decodes the same; a frame that is not a message is an error naming what it held, and the reader goes on with
the next frame.
"""

from __future__ import annotations

import dataclasses
import pickle
import socket
import struct

import pytest

from pluginfer.engine.client import EngineStats, ModelInfo
from pluginfer.engine.messages import (
    MESSAGE_TYPES,
    AbortRequest,
    AddRequest,
    Call,
    CallResult,
    ChoiceDelta,
    Failure,
    FrameReader,
    MalformedFrame,
    Outputs,
    PromptInfo,
    Ready,
    Rejected,
    RequestDelta,
    ServerTokenizer,
    StartFailed,
    Stop,
    decode,
    encode,
    receive_frame,
)
from pluginfer.engine.pooling import PoolingParams
from pluginfer.engine.sequence import SamplingParams
from pluginfer.engine.structured import StructuredOutputsParams

STATS = EngineStats(num_running=3, num_waiting=1, kv_cache_usage=0.25, num_free_blocks=48, num_blocks=64,
                    num_preemptions=2, prefix_cache_queries=100, prefix_cache_hits=40)
INFO = ModelInfo(model_path="/models/tiny", max_model_len=256, vocab_size=512, eos_token_ids=frozenset({2, 7}),
                 num_blocks=64, block_size=8)
DELTAS = [
    RequestDelta("cmpl-1", PromptInfo("hello", [1, 15043], [None, {15043: -3.5, 2: -4.0}]),
                 [ChoiceDelta(0, [29871, 3186], " world", [{29871: -0.1}, {3186: -0.2}], None),
                  ChoiceDelta(1, [], "", None, "length")], False, None, 8, None),
    RequestDelta("embd-2", None, [], True, None, 0, [0.125, -0.5, 1.0]),
    RequestDelta("cmpl-3", None, [ChoiceDelta(0, [9], "\ufffd", None, "error")], True, "prompt too long", 0, None),
]
MESSAGES = [
    ServerTokenizer(None),
    ServerTokenizer({"vocab": ["a", "b"]}),
    AddRequest("cmpl-1", "hello", SamplingParams(temperature=0.0, max_tokens=4, logprobs=2)),
    AddRequest("cmpl-2", [1, 2, 3], SamplingParams(n=2, stop=["\n"], seed=5,
                                                   structured_outputs=StructuredOutputsParams(regex="[ab]+"))),
    AddRequest("embd-1", [1, 2], PoolingParams(dimensions=8)),
    AbortRequest("cmpl-1"),
    Call(4, "compile_grammar", (StructuredOutputsParams(json={"type": "object"}),)),
    Stop(),
    Ready(pid=1234, model_info=INFO, tokenizer=pickle.dumps(["a", "b"]), startup_times={"load": 0.5}, stats=STATS),
    StartFailed("ValueError", "no config.json in /models/missing"),
    Outputs(DELTAS, STATS),
    Outputs([], EngineStats()),
    Rejected("cmpl-9", "ValueError", "token ids must be in [0, 512)"),
    CallResult(4),
    CallResult(5, error_type="StructuredOutputError", message="unknown type 'objekt'"),
    Failure("RuntimeError: device lost"),
]


def test_every_message_type_is_covered():
    assert {type(message) for message in MESSAGES} == set(MESSAGE_TYPES)


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_a_message_comes_back_equal_through_its_frame(message):
    frame = encode(message)
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    back = decode(frame[4:])
    assert type(back) is type(message) and back == message
    assert dataclasses.asdict(back) == dataclasses.asdict(message)


def test_messages_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        AbortRequest("a").request_id = "b"
    with pytest.raises(dataclasses.FrozenInstanceError):
        STATS.num_running = 0


def test_frames_split_anywhere_decode_the_same():
    stream = b"".join(encode(message) for message in MESSAGES)
    for piece in (1, 3, 7, 64, len(stream)):
        reader = FrameReader()
        got = []
        for start in range(0, len(stream), piece):
            got += reader.feed(stream[start:start + piece])
        assert got == MESSAGES


def test_anything_but_a_message_is_refused_when_sent():
    with pytest.raises(TypeError, match="not an engine message: tuple"):
        encode(("out", [], (0, 0, 0.0, 0)))


@pytest.mark.parametrize(("payload", "says"), [
    (pickle.dumps(("add", "r1", [1, 2], None)), "holds a tuple, not an engine message: ('add', 'r1'"),
    (pickle.dumps(STATS), "holds a EngineStats, not an engine message"),
    (b"\x80\x05garbage", "does not decode (UnpicklingError"),
    (b"", "a frame of 0 bytes does not decode"),
])
def test_a_malformed_frame_is_an_error_naming_it(payload, says):
    with pytest.raises(MalformedFrame, match=None) as caught:
        decode(payload)
    assert says in str(caught.value)


def test_a_reader_drops_a_malformed_frame_and_reads_the_next():
    junk = pickle.dumps({"kind": "out"})
    stream = encode(AbortRequest("a")) + struct.pack(">I", len(junk)) + junk + encode(Stop())
    dropped: list[MalformedFrame] = []
    assert FrameReader(on_malformed=dropped.append).feed(stream) == [AbortRequest("a"), Stop()]
    assert len(dropped) == 1 and "holds a dict" in str(dropped[0])
    with pytest.raises(MalformedFrame, match="holds a dict"):  # without a handler the reader raises
        FrameReader().feed(stream)


def test_receive_frame_reads_one_message_and_names_a_malformed_one():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        junk = pickle.dumps([1, 2])
        ours.sendall(encode(Failure("x")) + struct.pack(">I", len(junk)) + junk)
        assert receive_frame(theirs) == Failure("x")
        with pytest.raises(MalformedFrame, match="holds a list"):
            receive_frame(theirs)
