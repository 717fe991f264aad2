"""A tiny random-weight MLX model folder with the embedded model's tokenizer:
loads through kvarn_mlx.loader like any --model folder, in well under a second."""

import json
import shutil

import mlx.core as mx
from mlx_lm.models import llama

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

CONFIG = dict(
    model_type="llama",
    hidden_size=128,
    num_hidden_layers=2,
    intermediate_size=256,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    rms_norm_eps=1e-5,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_model_folder(path, seed=0, dtype=mx.float32, **config):
    """Write a 2-layer llama with SmolLM2's tokenizer to `path`, weights in `dtype`;
    config overrides CONFIG."""
    from kvarn_mlx.loader import default_model_path

    cfg = {**CONFIG, **config}
    path.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    model.save_weights(str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    src = default_model_path()
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, path / name)
    return path
