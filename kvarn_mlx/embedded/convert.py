"""Convert a GGUF file (llama, gemma3 or qwen2 architecture) into an MLX model
folder.

`mx.load` reads GGUF directly: Q4_0, Q4_1 and Q8_0 tensors come back as MLX
affine group-32 (weight, scales, biases) triples, which `mx.dequantize` turns
back into the stored values (rounded to float16, the scales' type). Other
types it dequantizes itself to float16, and not always right: MLX 0.32.4's
Q4_K gives errors as large as the weights (Qwen2.5-Coder's attn_q). Files with
such tensors are read with the `gguf` package (llama.cpp's Python reader),
which dequantizes every type as llama.cpp does.
"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from .architectures import GLOBAL_NAMES, LAYER_NAMES, TENSOR_FIXES, model_config
from .tokenizer import build_tokenizer

# Bump when the conversion output changes, so cached folders are redone.
# 2: K-quant and Q5_0 files always through the gguf package (MLX's Q4_K is wrong).
# 3: Q4_0/Q4_1/Q8_0 files through mx.load again, as in 1 (2 sent them to the gguf
#    package too, which changed SmolLM2's weights in the last float16 bit).
CONVERTER_VERSION = 3


def _python_value(v):
    """GGUF metadata scalars arrive as 0-d mx.arrays; make them Python values."""
    if isinstance(v, mx.array):
        return v.item() if v.ndim == 0 else v.tolist()
    return v


def read_gguf(path):
    """Return (tensors, metadata) of a GGUF file, metadata as Python values.

    Tensors are named as `mx.load` names them: `<name>.weight`, plus
    `<name>.scales` and `<name>.biases` for the Q4_0/Q4_1/Q8_0 blocks it reads
    (MLX affine group-32). Files that only the `gguf` package reads arrive
    dequantized to float32.
    """
    try:
        tensors, metadata = mx.load(str(path), return_metadata=True)
        # A float16 weight with no scales beside it is an F16 tensor or one mx.load
        # dequantized itself (K-quants, Q5_0), which it may get wrong: the gguf
        # package reads both. (Q4_0/Q4_1/Q8_0 scales and biases are float16 too.)
        dequantized = [
            k
            for k, t in tensors.items()
            if t.dtype == mx.float16
            and k.endswith(".weight")
            and k.removesuffix(".weight") + ".scales" not in tensors
        ]
        if not dequantized:
            return tensors, {k: _python_value(v) for k, v in metadata.items()}
        mlx_error = "K-quant, Q5_0 or F16 tensors"
    except Exception as e:
        mlx_error = e
    try:
        import gguf
    except ImportError:
        raise ValueError(
            f"mx.load cannot read {path} ({mlx_error}; it reads only "
            "F32/Q4_0/Q4_1/Q8_0 tensors reliably). Install the gguf package for the "
            "other types: pip install 'kvarn-mlx[gguf]'"
        ) from None
    try:
        return _read_with_gguf(gguf, path)
    except Exception as e:
        raise ValueError(f"could not read GGUF file {path}: {e} (mx.load: {mlx_error})") from e


def _read_with_gguf(gguf, path):
    reader = gguf.GGUFReader(str(path))
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {
        t.name: mx.array(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
        for t in reader.tensors
    }
    return tensors, metadata


def _dequantize(tensors, name):
    w = tensors[f"{name}.weight"]
    if f"{name}.scales" not in tensors:
        return w
    scales, biases = tensors[f"{name}.scales"], tensors[f"{name}.biases"]
    # GGUF quant blocks are 32 wide; bits follow from the packed width.
    bits = w.shape[-1] // scales.shape[-1]
    return mx.dequantize(w, scales, biases, group_size=32, bits=bits)


def model_weights(tensors, config, dtype=mx.float32):
    """Dequantized weights in mlx-lm naming, cast to `dtype`."""
    model_type = config["model_type"]
    layer_names, fix = LAYER_NAMES[model_type], TENSOR_FIXES[model_type]
    weights = {}
    # "<name>.bias" is a float bias (qwen2's q/k/v); "<name>.scales" and
    # "<name>.biases" belong to a quantized "<name>.weight".
    bases = {k.rsplit(".", 1)[0] for k in tensors}
    for base in sorted(bases):
        if base.startswith("blk."):
            _, layer, part = base.split(".", 2)
            if part not in layer_names:
                raise ValueError(f"unexpected GGUF tensor {base}")
            name = f"model.layers.{layer}.{layer_names[part]}"
        elif base in GLOBAL_NAMES:
            part, name = base, GLOBAL_NAMES[base]
        else:
            raise ValueError(f"unexpected GGUF tensor {base}")
        w = fix(part, _dequantize(tensors, base), config)
        weights[f"{name}.weight"] = w.astype(dtype)
        if f"{base}.bias" in tensors:
            weights[f"{name}.bias"] = tensors[f"{base}.bias"].astype(dtype)
    return weights


def convert(gguf_path, out_dir, dtype="float32"):
    """Write an mlx-lm loadable folder (config.json, model.safetensors,
    tokenizer files) for a llama, gemma3 or qwen2 GGUF file. `out_dir` must exist.
    Every weight is dequantized: on CPU, MLX's quantized matmul is far slower
    than float32 BLAS for prompts."""
    out_dir = Path(out_dir)
    tensors, metadata = read_gguf(gguf_path)
    config = model_config(metadata, tied="output.weight" not in tensors)
    config["torch_dtype"] = dtype
    weights = model_weights(tensors, config, getattr(mx, dtype))
    mx.eval(weights)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, {"format": "mlx"})
    with open(out_dir / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    build_tokenizer(metadata).save_pretrained(str(out_dir))
    # transformers 5 writes tokenizer_class "TokenizersBackend" and the chat
    # template only to chat_template.jinja; older versions know neither.
    tokenizer_config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config["add_bos_token"] = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    if metadata.get("tokenizer.chat_template"):
        tokenizer_config["chat_template"] = metadata["tokenizer.chat_template"]
    tokenizer_config_path.write_text(json.dumps(tokenizer_config, indent=2))
    return config
