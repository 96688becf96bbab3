"""docs/protocols.md is the contracts as the code declares them (tests/protocol_reference.py renders it)."""

from __future__ import annotations

from tests.protocol_reference import PAGE, render


def test_the_protocol_reference_is_up_to_date() -> None:
    assert PAGE.read_text() == render(), "docs/protocols.md is out of date: python -m tests.protocol_reference"


def test_every_protocol_member_is_documented() -> None:
    """A member the core calls without a contract would leave a plugin author guessing."""
    page = render()
    for member in ("`forward(", "`create_weights(", "`paged_attention(", "`all_reduce(", "`parse(", "`split(",
                   "`define_op(", "`implement(", "`call_syntax:"):
        assert member in page, member
