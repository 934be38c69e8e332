from tests.mock.conftest import start_mock

__all__ = ["start_mock"]
