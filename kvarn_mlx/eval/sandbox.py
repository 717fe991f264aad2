"""Run model-written Python against its tests, fenced in.

Each program runs in its own `python -I` (isolated: no site-packages of the
user, no PYTHON* variables, no current folder on sys.path) in a fresh
temporary folder that is its working directory and is deleted afterwards, in
a new session killed as a whole on timeout, under resource limits (CPU
seconds, address space, file size, open files, no core dumps). A preamble
runs first and takes away the network (every socket) and what could reach or
harm files outside the folder: `open` outside it, deleting, renaming,
changing permissions, running programs, forking. It is a guard against the
mistakes of a code model, not a security boundary against a hostile one.
"""

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

# Limits are set by the program itself, first thing: a preexec_fn would run
# Python in a child forked from a multi-threaded process (MLX, OpenBLAS),
# which can deadlock there.
_LIMITS = r"""
import resource
for _limit, _value in [(resource.RLIMIT_CPU, {cpu}), (resource.RLIMIT_AS, {memory}),
                       (resource.RLIMIT_FSIZE, 16 << 20), (resource.RLIMIT_NOFILE, 64),
                       (resource.RLIMIT_CORE, 0)]:
    try:
        resource.setrlimit(_limit, (_value, _value))
    except (ValueError, OSError):
        pass  # macOS refuses some (RLIMIT_AS): the others still hold
"""

_PREAMBLE = r"""
import builtins, io, os, shutil, socket, subprocess, sys
_root = os.path.realpath(os.getcwd())
def _inside(path):
    if isinstance(path, int):
        return True  # an already open descriptor
    p = os.path.realpath(os.fsdecode(path))
    return p == _root or p.startswith(_root + os.sep)
def _denied(what):
    def deny(*args, **kwargs):
        raise PermissionError(f"{what} is disabled in the sandbox")
    return deny
_open, _os_open = builtins.open, os.open
def _guarded_open(file, *args, **kwargs):
    if not _inside(file):
        raise PermissionError(f"open({file!r}): only files in the sandbox folder")
    return _open(file, *args, **kwargs)
def _guarded_os_open(path, *args, **kwargs):
    if not _inside(path):
        raise PermissionError(f"os.open({path!r}): only files in the sandbox folder")
    return _os_open(path, *args, **kwargs)
builtins.open = io.open = _guarded_open
os.open = _guarded_os_open
for _name in ("socket", "socketpair", "create_connection", "create_server", "fromfd", "getaddrinfo",
              "gethostbyname", "gethostbyname_ex", "gethostbyaddr"):
    setattr(socket, _name, _denied("the network"))
for _name in ("system", "popen", "fork", "forkpty", "kill", "killpg", "remove", "unlink", "rmdir",
              "removedirs", "rename", "renames", "replace", "truncate", "ftruncate", "chmod",
              "fchmod", "lchmod", "chown", "fchown", "lchown", "link", "symlink", "chdir",
              "fchdir", "chroot", "putenv", "unsetenv", "setuid", "setgid", "mkfifo", "mknod",
              "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe",
              "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp",
              "spawnvpe", "posix_spawn", "posix_spawnp"):
    if hasattr(os, _name):
        setattr(os, _name, _denied(f"os.{_name}"))
for _name in ("rmtree", "move", "copy", "copy2", "copyfile", "copytree", "chown", "make_archive"):
    setattr(shutil, _name, _denied(f"shutil.{_name}"))
subprocess.Popen = _denied("subprocess")
for _name in ("_socket", "_posixsubprocess", "ctypes", "_ctypes", "resource", "multiprocessing"):
    sys.modules[_name] = None  # importing them raises ImportError
del _name
"""


@dataclass
class Outcome:
    status: str  # "passed", "failed" or "timeout"
    output: str  # the end of stdout + stderr

    @property
    def passed(self):
        return self.status == "passed"


def run(program, timeout=10.0, memory_bytes=2 << 30):
    """Run `program` (Python source) fenced in; "passed" when it exits with 0
    within `timeout` seconds of wall time."""
    with tempfile.TemporaryDirectory(prefix="kvarn-sandbox.") as folder:
        path = os.path.join(folder, "program.py")
        with open(path, "w") as f:
            f.write(
                _LIMITS.format(cpu=int(timeout) + 1, memory=memory_bytes)
                + _PREAMBLE
                + "\n"
                + program
                + "\n"
            )
        env = {"PATH": "/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8"}
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", path],
            cwd=folder,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
            status = "passed" if proc.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            status = "timeout"
        finally:
            if proc.poll() is None or status == "timeout":
                try:
                    os.killpg(proc.pid, 9)  # the session: the program and anything it started
                except ProcessLookupError:
                    pass
                out, _ = proc.communicate()
    return Outcome(status, out.decode(errors="replace")[-2000:])
