"""Terminal escape sequences in job logs (service.logs): stripped whole, also when a followed log cuts
one in two."""

from __future__ import annotations

import pytest

from service.logs import AnsiStripper, strip_ansi

COLOURED = "\x1b[32mINFO\x1b[0m step 1 \x1b[1;31mloss\x1b[0m 2.3\r\x1b[2K\x1b]0;title\x07done\x1b(B\n"


def test_colours_cursor_moves_and_titles_are_stripped() -> None:
    assert strip_ansi(COLOURED) == "INFO step 1 loss 2.3\rdone\n"
    assert strip_ansi("no escapes [32m here\n") == "no escapes [32m here\n"


@pytest.mark.parametrize("cut", range(1, len(COLOURED)))
def test_a_sequence_cut_between_two_chunks_is_stripped_whole(cut: int) -> None:
    stripper = AnsiStripper()
    assert stripper.feed(COLOURED[:cut]) + stripper.feed(COLOURED[cut:]) == strip_ansi(COLOURED)


def test_a_chunk_that_ends_in_plain_text_is_sent_whole() -> None:
    stripper = AnsiStripper()
    assert stripper.feed("step 1\n") == "step 1\n"
    assert stripper.feed("\x1b[") == ""  # held until the rest of the sequence arrives
    assert stripper.feed("0mstep 2\n") == "step 2\n"
