"""--cli: chat in the terminal. Plain input() loop; MLX runs in this thread."""

import sys

from kvarn_mlx.cli_support import INTERRUPTED, CtrlC, load_error
from kvarn_mlx.guard import Refused
from kvarn_mlx.loader import ModelLoadError

from .engine import Engine

HELP = (
    "commands: /new (start over), /save FILE (/save! FILE replaces a file that is not a saved "
    "chat), /quit   (Ctrl-C stops a reply)"
)


def stats_line(s):
    line = (
        f"[{s['context_tokens']} ctx tokens | KV {s['held'] / 2**20:.2f} MiB vs fp16 "
        f"{s['fp16'] / 2**20:.2f} MiB = {s['ratio_fp16']:.2f}x | {s['tps']:.1f} tok/s | prefilled "
        f"{s['prefilled']}, reused {s['reused']}"
    )
    if s["kvarn_layers"]:
        line += f" | {s['tiles_per_layer']} tiles/layer"
    return line + "]"


def run_cli(engine_kwargs, resume=None, inp=input, out=sys.stdout):
    print("loading the model...", file=out, flush=True)
    try:
        eng = Engine(**engine_kwargs)
    except Refused as e:
        print(f"error: {e}", file=out)
        return 1
    except (ModelLoadError, RuntimeError, OSError, ValueError) as e:
        print(f"error: {load_error(engine_kwargs.get('models', [None])[0], e)}", file=out)
        return 1
    except KeyboardInterrupt:
        return INTERRUPTED
    messages = []
    if resume:
        try:
            messages = eng.load(resume)
        except Refused as e:
            print(f"error: {e}", file=out)
            return 1
        print(f"resumed {len(messages)} messages from {resume}", file=out)
    kv = f"KV preset {eng.preset}" if eng.profile[0] is None else f"KV widths from {eng.profile[0]}"
    print(f"{eng.name}, {kv}. {HELP}", file=out, flush=True)
    while True:
        try:
            line = inp("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=out)
            return 0
        except UnicodeDecodeError as e:
            print(
                f"error: that line is not valid UTF-8 ({e.reason} at byte {e.start}); set the "
                "terminal to UTF-8 and type it again",
                file=out,
            )
            continue
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "/quit":
            return 0
        if cmd == "/new":
            eng.new_chat()
            messages = []
            print("(new chat)", file=out)
            continue
        if cmd in ("/save", "/save!"):
            if not arg.strip():
                print("usage: /save FILE", file=out)
                continue
            try:
                print(f"saved to {eng.save(arg.strip(), overwrite=cmd == '/save!')}", file=out)
            except Exception as e:  # whatever failed, the conversation outlives it
                fix = " (/save! FILE replaces it)" if "refusing to overwrite" in str(e) else ""
                print(f"error: could not save: {e}{fix}", file=out)
            continue
        if cmd.startswith("/"):
            print(HELP, file=out)
            continue
        if not line.strip():
            continue
        turn = messages + [{"role": "user", "content": line}]
        try:
            # Ctrl-C ends the reply after the current token; the part already
            # written stays in the conversation.
            with CtrlC() as ctrl_c:
                for ev in eng.chat(turn, cancel=ctrl_c):
                    if ev["type"] == "token":
                        print(ev["text"], end="", file=out, flush=True)
                    elif ev["type"] == "done":
                        messages = turn + [{"role": "assistant", "content": ev["text"]}]
                        stopped = "\n(stopped)" if ev["finish_reason"] == "cancelled" else ""
                        print(stopped + "\n" + stats_line(ev["stats"]), file=out, flush=True)
        except Refused as e:
            print(f"error: {e}", file=out)
        except KeyboardInterrupt:
            # A second Ctrl-C: the engine keeps its cache consistent; this turn is dropped.
            print("\n(stopped)", file=out)
