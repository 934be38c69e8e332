"""The engine client's patch of ``hyperframe.frame.Frame.__repr__`` (``sidecar/engine/_client.py``): still needed, and
in effect.

h2 formats every frame it receives for a trace log that does nothing by default (``H2Connection._receive_frame``),
and hyperframe's repr re-serialises the frame body to hex-dump it. When h2 stops doing that, the first test fails:
drop the patch then.
"""

from __future__ import annotations

import hyperframe.frame
import pytest

from sidecar.engine import _client
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
        text = _client.HYPERFRAME_REPR(frame)
        formatted.append(text)
        return text

    monkeypatch.setattr(hyperframe.frame.Frame, "__repr__", spy)
    _receive_one_data_frame(serialisations)
    data = [text for text in formatted if text.startswith("DataFrame")]
    assert data, "h2 no longer formats received frames eagerly: the Frame.__repr__ patch in _client.py can go"
    assert serialisations, "hyperframe's repr no longer re-serialises the body: the patch may no longer pay"


def test_the_patch_is_in_effect_and_formats_nothing(serialisations: list[int]) -> None:
    assert hyperframe.frame.Frame.__repr__ is _client._cheap_frame_repr
    _receive_one_data_frame(serialisations)
    assert serialisations == []
    assert repr(hyperframe.frame.DataFrame(3, data=PAYLOAD)) == "DataFrame(stream_id=3)"
