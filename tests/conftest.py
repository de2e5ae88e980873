import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The embedded default model with a short warm-up (some rewards > 0), built once per test session."""
    from tiny_gsm8k import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", warmup_steps=60)
