from tests.helpers.fixtures import dynamo_env, frontend, model_dir

__all__ = ["dynamo_env", "frontend", "model_dir"]
