"""The frame-repr tuning (``sidecar.http2.apply_tunings``): still needed, in effect once applied, and never applied by
an import.

h2 formats every frame it receives for a trace log that does nothing by default (``H2Connection._receive_frame``),
and hyperframe's repr re-serialises the frame body to hex-dump it. When h2 stops doing that, the first test fails:
drop the tuning then.
"""

from __future__ import annotations

import hyperframe.frame
import pytest

from sidecar.http2 import HYPERFRAME_REPR, apply_tunings, cheap_frame_repr, tunings_in_effect, undo_tunings
from sidecar.testing.h2pair import connected_pair

PAYLOAD = b"\x00\x00\x00\x00\x05hello"


def _receive_one_data_frame(serialisations: list[int]) -> None:
    client, server, stream_id = connected_pair()
    server.send_data(stream_id, PAYLOAD)
    data = server.data_to_send()
    serialisations.clear()  # sending serialised the frame; only what receiving costs counts
    client.receive_data(data)


@pytest.fixture
def serialisations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts ``DataFrame.serialize_body`` calls (what hyperframe's repr does to hex-dump a DATA frame)."""
    calls: list[int] = []
    original = hyperframe.frame.DataFrame.serialize_body

    def counting(self: hyperframe.frame.DataFrame) -> bytes:
        calls.append(1)
        return original(self)

    monkeypatch.setattr(hyperframe.frame.DataFrame, "serialize_body", counting)
    return calls


def test_h2_still_formats_every_received_frame_with_the_original_repr(
    monkeypatch: pytest.MonkeyPatch, serialisations: list[int]
) -> None:
    formatted: list[str] = []

    def spy(frame: hyperframe.frame.Frame) -> str:
        text: str = HYPERFRAME_REPR(frame)
        formatted.append(text)
        return text

    monkeypatch.setattr(hyperframe.frame.Frame, "__repr__", spy)
    _receive_one_data_frame(serialisations)
    data = [text for text in formatted if text.startswith("DataFrame")]
    assert data, "h2 no longer formats received frames eagerly: the frame-repr tuning can go"
    assert serialisations, "hyperframe's repr no longer re-serialises the body: the tuning may no longer pay"


def test_once_applied_the_tuning_formats_nothing(serialisations: list[int]) -> None:
    assert hyperframe.frame.Frame.__repr__ is HYPERFRAME_REPR, "applied before anyone asked"
    apply_tunings(lean_streams=False)
    try:
        assert hyperframe.frame.Frame.__repr__ is cheap_frame_repr
        assert tunings_in_effect() == {"frame_repr": True, "lean_streams": False}
        _receive_one_data_frame(serialisations)
        assert serialisations == []
        assert repr(hyperframe.frame.DataFrame(3, data=PAYLOAD)) == "DataFrame(stream_id=3)"
    finally:
        undo_tunings()
    assert hyperframe.frame.Frame.__repr__ is HYPERFRAME_REPR
