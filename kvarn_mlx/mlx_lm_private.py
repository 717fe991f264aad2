"""The private mlx-lm names the package uses outside the server, imported here
only (the server's are listed in server/hooks.py). tests/test_mlx_lm_private.py
looks each one up in the installed mlx-lm, so a release that moves one fails
there, naming it; pyproject.toml pins mlx-lm to the versions they were checked on.
"""

from mlx_lm.models.cache import _BaseCache as BaseCache

MLX_LM_PRIVATE = {
    "mlx_lm.models.cache:_BaseCache": "BaseCache: the base class of mlx-lm's caches (KVarNCache's)",
    "mlx_lm.utils:_get_classes": (
        "model_classes: a model's classes from its config, without loading weights"
    ),
}

__all__ = ["BaseCache", "MLX_LM_PRIVATE", "model_classes"]


def model_classes(config):
    """(Model class, ModelArgs class) of the model a config.json describes."""
    from mlx_lm.utils import _get_classes

    return _get_classes(config)
