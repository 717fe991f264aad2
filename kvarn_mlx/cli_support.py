"""What the commands share (kvarn-generate, kvarn-server, the chat app): one
function per rule, so that each says the same thing everywhere.

- flag: a flag's value in an argv that argparse leaves to another parser;
- load_error: the one line for a model that failed to load;
- model_context: the model's context length;
- CtrlC and INTERRUPTED: Ctrl-C stops a generation at the next token, and the
  command exits with the shell's code for it.
"""

import signal
import threading

INTERRUPTED = 130  # the shell's exit code for a process stopped by Ctrl-C


def flag(argv, name, default=None):
    """The value of flag `name` in argv (the last one given), else default."""
    value = default
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def load_error(spec, e):
    """One line for a model that failed to load (the loader's own message, or mlx's on
    damaged files)."""
    from .loader import ModelLoadError

    if isinstance(e, ModelLoadError):
        return str(e)
    return (
        f"cannot load the model {spec or 'embedded default'}: {e}. The weights file may be "
        "incomplete or corrupt; download or convert it again"
    )


def model_context(model):
    """The model's context length in tokens (its config's max_position_embeddings),
    or None when the model does not say."""
    return getattr(getattr(model, "args", None), "max_position_embeddings", None) or None


class CtrlC:
    """While active, Ctrl-C asks the generation to stop at the next token instead of
    raising KeyboardInterrupt inside MLX; a second Ctrl-C raises it at once."""

    def __init__(self):
        self.pressed = False

    def __enter__(self):
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, *_):
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)

    def is_set(self):  # as a threading.Event, for code that takes a cancel event
        return self.pressed
