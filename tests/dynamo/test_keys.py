"""The file-discovery key of our own registration, as Dynamo 1.6.1 writes it (observed with a real runtime)."""

from __future__ import annotations

from pathlib import Path

from sidecar.dynamo import DynamoSettings, file_discovery_keys


def test_keys_encode_every_non_alphanumeric_byte_like_dynamo() -> None:
    # Dynamo wrote v1/instances/dynamo%2Fa%2Db%5Fc%7Ed%2Fgenerate%2F1d8af11ac83b2ca for component "a-b_c~d".
    settings = DynamoSettings(component="a-b_c~d")
    instance, mdc = file_discovery_keys(settings, 0x1D8AF11AC83B2CA, root=Path("/kv"))
    assert instance == Path("/kv/v1/instances/dynamo%2Fa%2Db%5Fc%7Ed%2Fgenerate%2F1d8af11ac83b2ca")
    assert mdc == Path("/kv/v1/mdc/dynamo%2Fa%2Db%5Fc%7Ed%2Fgenerate%2F1d8af11ac83b2ca")
