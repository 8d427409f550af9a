"""The minimal root a sandboxed program sees, and the interpreter it runs.

A run's root (built by ``sandbox_launcher.py`` in the run's mount namespace) is a small tmpfs
holding, read-only and at the same paths as on the host, only what ``RootLayout.paths`` lists:

  * the interpreter's executable;
  * its standard library directories (``sys.path`` of ``python -I -S``: the stdlib, its zip,
    ``lib-dynload``), with every ``site-packages`` / ``dist-packages`` directory inside them
    covered by an empty one (``RootLayout.hidden``: installed packages are the trainer's, the
    standard library is not);
  * the shared objects the interpreter and every extension module of ``lib-dynload`` load (the
    names the dynamic loader opened them by, so symlinks such as ``/lib -> usr/lib`` are copied
    as symlinks) and ``/etc/ld.so.cache``;

plus ``/dev/null``, ``/dev/zero``, ``/dev/urandom``, ``/dev/random`` and a private ``/tmp``
(the work directory ``/tmp/work``). No ``/proc``, no ``/sys``, no home directories, no other
``/etc``: the trainer's virtualenv, project tree, data files and run directories are not there.

``probe(python)`` asks an interpreter (run on the host: it is the host's own, trusted binary)
for its layout; ``candidates()`` lists the interpreters to try, the trainer's own first;
``choose`` picks the first that runs in the sandbox.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable

SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
LOADER_CACHE = "/etc/ld.so.cache"
_PACKAGE_DIRS = ("site-packages", "dist-packages")

# Run as ``python -I -S -c PROBE`` on the host. Imports every extension module of the standard
# library so that the dynamic loader maps every shared object any of them needs, then lists the
# loaded objects under the names the loader opened them by (``dl_iterate_phdr``).
PROBE = r"""
import ctypes, importlib, json, os, sys, sysconfig
for d in sys.path:
    if os.path.isdir(d):
        for f in sorted(os.listdir(d)):
            if f.endswith('.so'):
                try:
                    importlib.import_module(f.split('.')[0])
                except Exception:
                    pass
class Info(ctypes.Structure):
    _fields_ = [('addr', ctypes.c_void_p), ('name', ctypes.c_char_p)]
CB = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(Info), ctypes.c_size_t, ctypes.c_void_p)
names = []
def collect(info, size, data):
    if info.contents.name:
        names.append(os.fsdecode(info.contents.name))
    return 0
ctypes.CDLL(None).dl_iterate_phdr(CB(collect), None)
paths = sysconfig.get_paths()
json.dump({
    'executable': os.path.realpath(sys.executable),
    'version': list(sys.version_info[:2]),
    'sys_path': [p for p in sys.path if os.path.exists(p)],
    'objects': [n for n in names if os.path.isabs(n)],
    'packages': [paths.get('purelib'), paths.get('platlib')],
}, sys.stdout)
"""


@dataclasses.dataclass(frozen=True)
class RootLayout:
    """What of the host a run's root holds (see module docstring).

    Attributes:
      python: the interpreter's executable (a real path, no symlink).
      version: its ``(major, minor)``.
      paths: absolute host paths bind-mounted read-only at the same place (files or
        directories; symlinks on the way are reproduced as symlinks).
      hidden: directories inside ``paths`` covered by an empty read-only directory.
    """

    python: str
    version: tuple[int, int]
    paths: tuple[str, ...]
    hidden: tuple[str, ...]

    def spec(self) -> dict:
        """The layout as the launcher reads it (plain lists)."""
        return {"paths": list(self.paths), "hidden": list(self.hidden), "devices": list(DEVICES)}


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def probe(python: str, timeout_s: float = 60.0) -> RootLayout:
    """The root layout of interpreter ``python`` (module docstring).

    Raises:
      OSError: the interpreter does not run, or its answer is not what the probe prints.
    """
    try:
        out = subprocess.run(
            [python, "-I", "-S", "-c", PROBE],
            capture_output=True,
            timeout=timeout_s,
            env={"PATH": SYSTEM_PATH, "LANG": "C.UTF-8"},
            cwd="/",
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise OSError(f"{python} does not run: {e}") from e
    if out.returncode != 0:
        tail = out.stderr.decode(errors="replace").strip()[-300:]
        raise OSError(f"{python} -c PROBE exited with {out.returncode}: {tail}")
    try:
        info = json.loads(out.stdout)
        version = (int(info["version"][0]), int(info["version"][1]))
        executable = str(info["executable"])
        dirs = [os.path.normpath(p) for p in info["sys_path"]]
        objects = [os.path.normpath(p) for p in info["objects"]]
        packages = [os.path.normpath(p) for p in info["packages"] if p]
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise OSError(f"{python} answered the probe with {out.stdout[:200]!r}") from e
    paths = [executable, *dirs]
    paths += [o for o in objects if not any(_inside(o, d) for d in paths)]
    if os.path.exists(LOADER_CACHE):
        paths.append(LOADER_CACHE)
    hidden = {p for p in packages if any(_inside(p, d) and p != d for d in dirs)}
    for d in dirs:
        if os.path.isdir(d):
            hidden |= {os.path.join(d, n) for n in _PACKAGE_DIRS}
    hidden = {h for h in hidden if os.path.isdir(h)}
    return RootLayout(
        python=executable,
        version=version,
        paths=tuple(dict.fromkeys(paths)),
        hidden=tuple(sorted(hidden)),
    )


def candidates() -> list[str]:
    """Interpreters to try, in order: the trainer's base interpreter (the same binary without
    the venv), a system Python of the same version, the venv's own executable (a copy, when the
    venv was made with ``--copies``), any system ``python3``."""
    major, minor = sys.version_info[:2]
    base = getattr(sys, "_base_executable", None) or sys.executable
    found = [os.path.realpath(base)]
    same = shutil.which(f"python{major}.{minor}", path=SYSTEM_PATH)
    found += [os.path.realpath(same)] if same else []
    found.append(os.path.realpath(sys.executable))
    any3 = shutil.which("python3", path=SYSTEM_PATH)
    found += [os.path.realpath(any3)] if any3 else []
    return list(dict.fromkeys(found))


def choose(python: str | None, fails: Callable[[RootLayout], str | None]) -> RootLayout:
    """The layout of ``python`` (or, when None, of the first of ``candidates()`` with the
    trainer's Python version, else the first of any version) that runs in the sandbox.

    Args:
      python: the interpreter asked for, or None.
      fails: runs a program in a root of the given layout; returns why it failed, or None.

    Raises:
      LookupError: no interpreter runs in the sandbox (the message names what was tried).
    """
    want = sys.version_info[:2]
    tried: dict[str, str] = {}
    found: list[RootLayout] = []
    for cand in [python] if python is not None else candidates():
        try:
            layout = probe(cand)
        except OSError as e:
            tried[cand] = str(e)
            continue
        why = fails(layout)
        if why is not None:
            tried[cand] = why
            continue
        found.append(layout)
        if layout.version == want:
            return layout
    if found:
        return found[0]
    raise LookupError(
        f"no Python interpreter runs in the sandbox's root (tried {tried}); pass "
        "Sandbox(python=...) an interpreter whose files are readable by others"
    )
