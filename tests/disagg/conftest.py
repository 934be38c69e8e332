from tests.helpers.scripted_engine import recorder
from tests.mock.conftest import start_mock

__all__ = ["recorder", "start_mock"]
