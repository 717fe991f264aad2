import pytest


@pytest.fixture(scope="session")
def smollm():
    """(model, tokenizer) of the embedded default model, SmolLM2-135M-Instruct
    in float32, converted once into $KVARN_MLX_HOME."""
    from kvarn_mlx import loader

    return loader.load()
