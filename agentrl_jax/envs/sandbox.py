"""Isolated execution of untrusted (model-written) programs.

``Sandbox(limits).run(files, argv, timeout_s)`` runs one program:

  * in fresh network, pid and mount namespaces (util-linux ``unshare``): no network (only a
    loopback interface that is down), no view of the host's processes, and everything the
    program starts (daemons that call ``setsid`` included) dies when the run ends;
  * in a minimal root of its own (``sandbox_root``): the interpreter, its standard library and
    the shared libraries they load, read-only; ``/dev/null``, ``/dev/zero``, ``/dev/urandom``,
    ``/dev/random``; a private, size-limited tmpfs on ``/tmp`` holding the work directory
    ``/tmp/work`` with only ``files``. Nothing else of the host: no ``/proc``, no home
    directories, no virtualenv, project tree, data files or run directories, no ``/etc`` but
    the loader's cache. The root is entered with ``pivot_root`` and the host's is detached;
  * with rlimits on CPU seconds, address space, file size, processes and open files;
  * under a wall-clock timeout that kills the whole namespace;
  * with a scrubbed environment (``PATH``, ``HOME``, ``TMPDIR``, ``LANG``, a few ``PYTHON*``
    settings such as a fixed hash seed, and nothing else);
  * without capabilities and with ``no_new_privs``: as an unprivileged uid when the trainer is
    root (each concurrent run on the host takes its own uid ``uid_base + slot``; slots are
    locked host-wide with ``flock``, so runs cannot signal each other or share a process
    limit), else as uid 0 of an unprivileged user namespace whose capabilities are dropped;
  * with stdout and stderr captured up to ``Limits.output_bytes`` (more kills the run);
  * optionally with ``stdin`` bytes (a memory file, never on disk) and a private *channel*: a
    pipe to the trainer on the program's fd 3 that only the program itself holds (a judge
    writes its verdict there, out of reach of what it runs; ``Result.channel``).

The setup is done by ``sandbox_launcher.py`` (its source is passed with ``python -I -S -c``; the
child never imports this package). When the trainer is not root, the run uses an unprivileged
user namespace (``unshare --user --map-root-user``). If the host allows neither, or the root
cannot be built, ``Sandbox`` raises ``SandboxUnavailable`` saying how to enable it: a program is
never run without its isolation (there is no weaker mode to fall back to).

``argv[0] == "python"`` means the interpreter of the root (``sandbox_root.candidates``: the
trainer's base interpreter, without the venv's packages, if it runs in the root; else a system
Python of the same version, then any ``python3``); the choice is logged once. Other absolute
``argv[0]`` must exist in the root. ``sandbox_pool.SandboxPool`` runs many programs at once.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import marshal
import os
import pathlib
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from agentrl_jax.envs import sandbox_root
from agentrl_jax.envs.sandbox_root import SYSTEM_PATH as _SYSTEM_PATH
from agentrl_jax.envs.sandbox_root import RootLayout

logger = logging.getLogger(__name__)

KILLED_BY = ("timeout", "cpu", "memory", "file_size", "procs", "open_files", "output")
_LAUNCHER = (pathlib.Path(__file__).parent / "sandbox_launcher.py").read_text()
_HOW_TO_ENABLE = (
    "run the trainer as root (or with CAP_SYS_ADMIN), or enable unprivileged user namespaces "
    "(sysctl -w kernel.unprivileged_userns_clone=1 and user.max_user_namespaces > 0; in a "
    "container: --security-opt seccomp=unconfined or --cap-add SYS_ADMIN); util-linux "
    "`unshare` must be installed"
)
# stderr markers of a program that died of a limit without a signal (the error line of the
# traceback Python prints), in order of precedence.
_ERROR_MARKERS = (
    ("memory", "MemoryError"),
    ("procs", "BlockingIOError: [Errno 11] Resource temporarily unavailable"),
    ("open_files", "Too many open files"),
    ("file_size", "[Errno 27] File too large"),  # Python ignores SIGXFSZ: writes fail instead
)


class SandboxUnavailable(RuntimeError):
    """The host cannot isolate a run (no namespaces, no usable interpreter, setup refused)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed run (frozen; validated on construction).

    Attributes:
      cpu_s: CPU seconds per process (``SIGXCPU``, then ``SIGKILL`` a second later), 1..3600.
      address_space_bytes: virtual memory per process, 64 MiB..1 TiB (allocations past it fail
        with ``MemoryError``).
      file_size_bytes: largest file a process may write, 0..1 GiB (``SIGXFSZ``).
      n_procs: processes (threads included) the run's uid may have, 1..4096.
      n_open_files: open file descriptors per process, 16..65536.
      output_bytes: stdout + stderr kept; a program that writes more is killed, 1 KiB..256 MiB.
      disk_bytes: size of the tmpfs holding the work directory and ``/tmp``, 1 MiB..4 GiB.
    """

    cpu_s: int = 10
    address_space_bytes: int = 1 << 30
    file_size_bytes: int = 16 << 20
    n_procs: int = 64
    n_open_files: int = 256
    output_bytes: int = 1 << 20
    disk_bytes: int = 64 << 20

    def __post_init__(self):
        for name, lo, hi in (
            ("cpu_s", 1, 3600),
            ("address_space_bytes", 64 << 20, 1 << 40),
            ("file_size_bytes", 0, 1 << 30),
            ("n_procs", 1, 4096),
            ("n_open_files", 16, 65536),
            ("output_bytes", 1 << 10, 256 << 20),
            ("disk_bytes", 1 << 20, 4 << 30),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"{name}={value!r} must be an int in [{lo}, {hi}]")


@dataclasses.dataclass(frozen=True)
class Result:
    """What one sandboxed run returned.

    Attributes:
      returncode: the program's exit status; ``-N`` when signal ``N`` ended it.
      stdout, stderr: captured output (UTF-8, undecodable bytes replaced), at most
        ``Limits.output_bytes`` together.
      timed_out: the wall-clock timeout ended the run.
      killed_by: the limit that ended the run, one of ``KILLED_BY``, or None. ``memory``,
        ``procs``, ``open_files`` and (for Python, which ignores ``SIGXFSZ``) ``file_size`` are
        read from the error the program died of: the limit makes a call fail rather than
        sending a signal.
      wall_s: wall-clock seconds of the run, setup included.
      truncated: output past ``Limits.output_bytes`` was dropped.
      channel: what the program wrote to fd 3 (``run(..., channel=True)``), at most
        ``Limits.output_bytes``; empty otherwise.
    """

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    killed_by: str | None
    wall_s: float
    truncated: bool = False
    channel: bytes = b""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed_by is None


class _Slots:
    """Host-wide exclusive slots (``flock`` on one lock file per slot)."""

    def __init__(self, directory: str, n: int):
        self.directory, self.n = directory, n
        os.makedirs(directory, mode=0o700, exist_ok=True)
        st = os.stat(directory)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise SandboxUnavailable(f"slot_dir {directory} must be owned by us and private (0700)")

    def acquire(self) -> tuple[int, int]:
        while True:
            for slot in range(self.n):
                fd = os.open(
                    os.path.join(self.directory, f"slot-{slot}.lock"), os.O_CREAT | os.O_RDWR
                )
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return slot, fd
                except BlockingIOError:
                    os.close(fd)
            time.sleep(0.01)

    @staticmethod
    def release(fd: int) -> None:
        os.close(fd)  # closing the descriptor drops the lock


class Sandbox:
    """Runs programs in isolation (see module docstring); thread-safe.

    Args:
      limits: resource limits (default ``Limits()``).
      python: interpreter that ``argv[0] == "python"`` names (default: see module docstring);
        its root layout is probed on the host (``sandbox_root.probe``).
      uid_base: first uid of the per-slot unprivileged uids (root only), 1000..2**31 - 4096.
      max_slots: concurrent runs on the host (root only), 1..4096.
      slot_dir: where the slot lock files live (root only; default a root-private directory
        under the system temp dir, outside what any run can see).

    Raises:
      ValueError: bad ``uid_base`` or ``max_slots``.
      SandboxUnavailable: the host cannot isolate a run (the message says how to enable it).
    """

    def __init__(
        self,
        limits: Limits | None = None,
        *,
        python: str | None = None,
        uid_base: int = 1_500_000_000,
        max_slots: int = 256,
        slot_dir: str | None = None,
    ):
        if not 1000 <= uid_base <= 2**31 - 4096:
            raise ValueError(f"uid_base={uid_base} must be in [1000, {2**31 - 4096}]")
        if not 1 <= max_slots <= 4096:
            raise ValueError(f"max_slots={max_slots} must be in [1, 4096]")
        self.limits = limits or Limits()
        self.uid_base, self.max_slots = uid_base, max_slots
        self.as_root = os.geteuid() == 0
        unshare = shutil.which("unshare", path=_SYSTEM_PATH + ":/sbin:/usr/sbin")
        if unshare is None:
            raise SandboxUnavailable(f"no `unshare` executable: {_HOW_TO_ENABLE}")
        self._prefix = [unshare, "--net", "--pid", "--fork", "--kill-child", "--mount"]
        if not self.as_root:
            self._prefix += ["--user", "--map-root-user"]
        self._prefix += ["--", sys.executable, "-I", "-S", "-c", _LAUNCHER]
        self._slots = None
        if self.as_root:
            default_dir = os.path.join("/tmp" if os.path.isdir("/tmp") else "/", ".agentrl-sandbox")
            self._slots = _Slots(slot_dir or default_dir, max_slots)
        self.layout = _resolve_layout(self, python)
        self.python = self.layout.python

    def run(
        self,
        files: Mapping[str, str],
        argv: Sequence[str],
        timeout_s: float,
        *,
        stdin: bytes = b"",
        channel: bool = False,
    ) -> Result:
        """Runs ``argv`` in a fresh sandbox holding ``files``.

        Args:
          files: relative path -> text content (UTF-8), written before the program starts.
          argv: the command; ``argv[0] == "python"`` is the sandbox's interpreter, any other
            ``argv[0]`` must be an absolute path (present in the root).
          timeout_s: wall-clock limit in seconds, in (0, 3600].
          stdin: what the program reads on fd 0 (a memory file; ``/dev/null`` when empty), at
            most 256 MiB.
          channel: give the program a private pipe to the trainer on fd 3
            (``Result.channel``).

        Returns:
          A ``Result`` (a program that fails or breaks a limit is a result, not an exception).

        Raises:
          ValueError: a file path that is absolute, empty or leaves the directory; empty
            ``argv``; a relative ``argv[0]`` other than ``python``; ``timeout_s`` out of
            range; ``stdin`` not bytes or too large.
          SandboxUnavailable: the namespaces or the root could not be set up.
        """
        spec = self._spec(files, argv, timeout_s, stdin)
        lock = None
        if self._slots is not None:
            slot, lock = self._slots.acquire()
            uid = self.uid_base + slot
            spec["drop_to"] = [uid, uid]
        try:
            return self._launch(spec, timeout_s, channel)
        finally:
            if lock is not None:
                _Slots.release(lock)

    def _spec(
        self, files: Mapping[str, str], argv: Sequence[str], timeout_s: float, stdin: bytes
    ) -> dict:
        if not 0 < timeout_s <= 3600:
            raise ValueError(f"timeout_s={timeout_s} must be in (0, 3600]")
        if not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError(f"argv={argv!r} must be a non-empty list of strings")
        if not isinstance(stdin, bytes) or len(stdin) > 256 << 20:
            raise ValueError("stdin must be bytes of at most 256 MiB")
        argv = list(argv)
        if argv[0] == "python":
            argv[0] = self.python
        elif not os.path.isabs(argv[0]):
            raise ValueError(f"argv[0]={argv[0]!r} must be 'python' or an absolute path")
        for rel, text in files.items():
            parts = pathlib.PurePosixPath(rel).parts
            if not rel or os.path.isabs(rel) or ".." in parts or not isinstance(text, str):
                raise ValueError(f"files key {rel!r} must be a relative path inside the directory")
        env = {
            "PATH": _SYSTEM_PATH,
            "HOME": "/tmp/work",
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONIOENCODING": "utf-8",
            "PYTHONHASHSEED": "0",  # reproducible set and dict-of-str orders
        }
        return {
            "files": dict(files),
            "argv": argv,
            "env": env,
            "limits": dataclasses.asdict(self.limits),
            "root": self.layout.spec(),
            "stdin": stdin,
            "drop_to": None,
        }

    def _launch(self, spec: dict, timeout_s: float, channel: bool) -> Result:
        start = time.monotonic()
        status_r, status_w = os.pipe()
        chan_r, chan_w = os.pipe() if channel else (None, None)
        spec["status_fd"], spec["channel_fd"] = status_w, chan_w
        try:
            proc = subprocess.Popen(
                self._prefix,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={"PATH": _SYSTEM_PATH, "LANG": "C.UTF-8"},
                pass_fds=(status_w,) if chan_w is None else (status_w, chan_w),
                start_new_session=True,
            )
        except BaseException:
            os.close(status_r)
            if chan_r is not None:
                os.close(chan_r)
            raise
        finally:
            os.close(status_w)
            if chan_w is not None:
                os.close(chan_w)
        try:
            outputs, reason = _communicate(
                proc,
                marshal.dumps(spec),
                chan_r,
                start + timeout_s,
                self.limits.output_bytes,
            )
            with os.fdopen(status_r, "rb") as f:
                status = f.read()
        finally:
            if proc.poll() is None:
                _kill(proc)
            if chan_r is not None:
                os.close(chan_r)
        wall = time.monotonic() - start
        return self._result(status, outputs, reason, wall)

    def _result(self, status: bytes, outputs: list[bytes], reason, wall: float) -> Result:
        out, err, chan = outputs
        kind, _, rest = status.decode(errors="replace").partition(" ")
        if kind == "error":
            raise SandboxUnavailable(f"{rest}: {_HOW_TO_ENABLE}")
        if kind != "ok" and reason is None:
            detail = err.decode(errors="replace").strip()[-500:]
            raise SandboxUnavailable(f"the sandbox did not start ({detail}): {_HOW_TO_ENABLE}")
        stdout = out.decode("utf-8", errors="replace")
        stderr = err.decode("utf-8", errors="replace")
        killed_by = reason
        code, cpu_s = -signal.SIGKILL, 0.0
        if kind == "ok":
            wait_status, cpu = rest.split()
            code, cpu_s = os.waitstatus_to_exitcode(int(wait_status)), float(cpu)
        if killed_by is None:
            # SIGXCPU at the soft limit; SIGKILL at the hard one (a program that ignores SIGXCPU)
            if code == -signal.SIGXCPU or (code == -signal.SIGKILL and cpu_s >= self.limits.cpu_s):
                killed_by = "cpu"
            elif code == -signal.SIGXFSZ:
                killed_by = "file_size"
            elif code != 0:
                tail = stderr[-2048:]  # forked processes may interleave their tracebacks
                killed_by = next((k for k, m in _ERROR_MARKERS if m in tail), None)
        return Result(
            returncode=code,
            stdout=stdout,
            stderr=stderr,
            timed_out=reason == "timeout",
            killed_by=killed_by,
            wall_s=wall,
            truncated=reason == "output",
            channel=chan,
        )


def _kill(proc: subprocess.Popen) -> None:
    """Kills the run: ``unshare`` and namespace init share a process group; the kernel then
    kills everything else in the pid namespace."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _communicate(
    proc: subprocess.Popen, spec: bytes, channel: int | None, deadline: float, limit: int
) -> tuple[list[bytes], str | None]:
    """Feeds the spec, collects stdout, stderr and the channel until EOF, the deadline or the
    output limit (stdout and stderr together; the channel on its own).

    Returns ``([stdout, stderr, channel], reason)`` with reason ``"timeout"``, ``"output"`` or
    None.
    """
    sel = selectors.DefaultSelector()
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    chunks: dict[int, list[bytes]] = {out_fd: [], err_fd: []}
    sel.register(proc.stdout, selectors.EVENT_READ)
    sel.register(proc.stderr, selectors.EVENT_READ)
    if channel is not None:
        chunks[channel] = []
        sel.register(channel, selectors.EVENT_READ)
    sel.register(proc.stdin, selectors.EVENT_WRITE)
    os.set_blocking(proc.stdin.fileno(), False)
    pending, totals, reason = memoryview(spec), {"output": 0, "channel": 0}, None
    try:
        while len(sel.get_map()) > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                reason = "timeout"
                break
            for key, _ in sel.select(min(left, 1.0)):
                if key.fileobj is proc.stdin:
                    try:
                        pending = pending[os.write(key.fd, pending[:65536]) :]
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                data = os.read(key.fd, 65536)
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                which = "channel" if key.fd == channel else "output"
                chunks[key.fd].append(data[: max(limit - totals[which], 0)])
                totals[which] += len(data)
                if totals[which] > limit:
                    reason = "output"
                    break
            if reason:
                break
    finally:
        sel.close()
        if reason is not None:
            _kill(proc)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if not f.closed:
                f.close()
    if reason is None:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            _kill(proc)
            reason = "timeout"
    outputs = [b"".join(chunks[out_fd]), b"".join(chunks[err_fd])]
    outputs.append(b"".join(chunks[channel]) if channel is not None else b"")
    return outputs, reason


_LAYOUTS: dict[tuple[bool, str, str | None], RootLayout] = {}
_LAYOUTS_LOCK = threading.Lock()


def _resolve_layout(sandbox: Sandbox, python: str | None) -> RootLayout:
    """The root layout of ``python``, or of the interpreter ``sandbox_root.choose`` picks
    (probed once per process).

    Raises:
      SandboxUnavailable: no candidate runs inside the sandbox.
    """
    key = (sandbox.as_root, sys.executable, python)
    with _LAYOUTS_LOCK:
        if key in _LAYOUTS:
            return _LAYOUTS[key]

        def fails(layout: RootLayout) -> str | None:
            sandbox.layout, sandbox.python = layout, layout.python  # what run() uses
            res = sandbox.run({}, ["python", "-I", "-S", "-c", "pass"], 60)
            return f"exit {res.returncode}: {res.stderr.strip()[-300:]}" if res.returncode else None

        try:
            chosen = sandbox_root.choose(python, fails)
        except LookupError as e:
            raise SandboxUnavailable(str(e)) from None
        first = sandbox_root.candidates()[0]
        if python is None and chosen.python != first:
            version = ".".join(map(str, chosen.version))
            logger.info("sandbox runs %s (Python %s), not %s", chosen.python, version, first)
        _LAYOUTS[key] = chosen
        return chosen
