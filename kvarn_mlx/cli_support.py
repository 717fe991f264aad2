"""What the commands share (kvarn-generate, kvarn-server, the chat app): one
function per rule, so that each says the same thing everywhere.

- add_kv_flags: the KV-cache flags, with one help text each;
- flag: a flag's value in an argv that argparse leaves to another parser;
- load_error: the one line for a model that failed to load;
- model_context: the model's context length;
- CtrlC and INTERRUPTED: Ctrl-C stops a generation at the next token, and the
  command exits with the shell's code for it.
"""

import signal
import threading

from .config import DEFAULT_PRESET, FP16, PRESETS, default_tail_words

INTERRUPTED = 130  # the shell's exit code for a process stopped by Ctrl-C


def add_kv_flags(
    p, sink=True, fp16="mlx-lm's plain cache", context_default="the model's context length"
):
    """Add the KV-cache flags to parser (or argument group) p: --kv-preset, --kv-sink
    (unless sink=False: the chat app's --cli has no setting for it), --kv-tail-tokens,
    --kv-profile, --kv-bytes-like, --kv-max-kl and --kv-context. fp16: what
    --kv-preset fp16 is there; context_default: --kv-context's default there."""
    p.add_argument(
        "--kv-preset",
        default=DEFAULT_PRESET,
        help=f"KV cache preset (default {DEFAULT_PRESET}): {', '.join(PRESETS)}, any "
        f"kXvY_gG[_auto]; or {FP16}: {fp16}",
    )
    if sink:
        p.add_argument(
            "--kv-sink",
            type=int,
            default=None,
            help="Leading tokens kept in full precision (default: the preset's, one tile)",
        )
    p.add_argument(
        "--kv-tail-tokens",
        type=int,
        default=None,
        metavar="N",
        help="Newest tokens kept in full precision besides the tile being filled, a multiple of "
        f"the tile size (default {default_tail_words()}, else 0; 0 with --kv-profile)",
    )
    p.add_argument(
        "--kv-profile",
        default=None,
        metavar="PROFILE.json",
        help="Per-layer key and value widths from this model's calibration profile "
        "(python -m kvarn_mlx.calibrate) instead of --kv-preset's",
    )
    p.add_argument(
        "--kv-bytes-like",
        default=None,
        metavar="PRESET",
        help=f"With --kv-profile: at most this preset's bytes, the least predicted KL "
        f"(default {DEFAULT_PRESET})",
    )
    p.add_argument(
        "--kv-max-kl",
        type=float,
        default=None,
        metavar="KL",
        help="With --kv-profile: the fewest bytes whose predicted KL (nats) is at most this "
        "at --kv-context tokens",
    )
    p.add_argument(
        "--kv-context",
        type=int,
        default=None,
        metavar="TOKENS",
        help="With --kv-max-kl: the context length the KL is predicted at (default: "
        + context_default
        + "; the profile's growth measurement scales the KL to it)",
    )


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
