"""The file-discovery key of our own registration, as Dynamo 1.6.1 writes it (observed with a real runtime)."""

from __future__ import annotations

from pathlib import Path

from sidecar.dynamo import DynamoSettings, file_discovery_keys, lora_card_key, lora_slug


def test_keys_encode_every_non_alphanumeric_byte_like_dynamo() -> None:
    # Dynamo wrote v1/instances/dynamo%2Fa%2Db%5Fc%7Ed%2Fgenerate%2F1d8af11ac83b2ca for component "a-b_c~d".
    settings = DynamoSettings(component="a-b_c~d")
    instance, mdc = file_discovery_keys(settings, 0x1D8AF11AC83B2CA, root=Path("/kv"))
    assert instance == Path("/kv/v1/instances/dynamo%2Fa%2Db%5Fc%7Ed%2Fgenerate%2F1d8af11ac83b2ca")
    assert mdc == Path("/kv/v1/mdc/dynamo%2Fa%2Db%5Fc%7Ed%2Fgenerate%2F1d8af11ac83b2ca")


def test_lora_card_keys_use_dynamos_slug() -> None:
    # Dynamo wrote …%2F6c711334e2a380d9%2Flora%2Da for "lora-a" and …%2Fmy%5Flora%5Fv2%5Fx for "My_Lora.v2 x".
    base = Path("/kv/v1/mdc/dyn%2Fbackend%2Fgenerate%2F6c711334e2a380d9")
    assert lora_card_key(base, "lora-a") == Path(f"{base}%2Flora%2Da")
    assert lora_card_key(base, "My_Lora.v2 x") == Path(f"{base}%2Fmy%5Flora%5Fv2%5Fx")
    assert lora_slug("Org/Adapter:v1") == lora_slug("org_adapter_v1") == "org_adapter_v1"
