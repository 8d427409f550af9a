"""The judge: runs test modules against a solution that lives in another process.

Executed in the sandbox as a script, never imported: ``execution`` runs ``python -I -S -c
JUDGE PLAIN`` (or this file compiled on the host, when the versions match; ``PLAIN``, the last
argument: the source of ``plain.py``, the value codec, which the judge makes a module of).
Standard library only.

Input (stdin: a memory file only this process reads, never on disk): JSON ``{"jobs": [...],
"test_timeout_s": float, "report": bool}``, each job ``{"solution": src, "tests": src,
"test_file": name, "stop_at_first_failure": bool, "timeout_s": float | null}``. Output: the JSON
list of job results ``{"names", "outcomes", "errors", "collect_error", "failures"}`` on fd 3,
the sandbox's private channel to the trainer; stdout and stderr are never read for results.

How the solution is kept from the verdict:
  * before reading its input the judge makes itself non-dumpable (no ptrace, no access to its
    memory or descriptors) and forks a *zygote* that has seen nothing but this code; the zygote
    forks one *worker* per job (again after a worker dies or overruns a test). No process that
    runs the solution ever held a test, an expected value or the channel;
  * the tests run here: the names they import from ``solution`` are proxies that send the
    call's arguments to the worker and get back a *plain value* (``plain.encode`` / ``decode``:
    None, bool, int, float, complex, str, bytes, and lists, tuples, dicts, sets, frozensets of
    them, checked by exact type, so no subclass and no object with its own ``__eq__`` crosses).
    The value is rebuilt here from builtins: every comparison a test makes is between the
    judge's own objects, never a call into something the solution made;
  * the worker's stdout and stderr come back on their own pipe (a report's captured output);
  * a worker that exits, is killed, overruns the test's time limit (``SIGALRM`` here) or answers
    out of protocol fails the test and is replaced for the next one.
"""

import _socket
import ctypes
import io
import json
import linecache
import os
import select
import signal
import struct
import sys
import types

CHANNEL_FD = 3
SOLUTION_FILE = "solution.py"
CAPTURE_BYTES = 4000
MAX_REPLY_BYTES = 16 << 20
MAX_NAMES = 10000
PR_SET_DUMPABLE = 4
plain = types.ModuleType("plain")  # filled from the last argument by main()


# -- the worker: the solution's process ----------------------------------------------------


def _error_reply(e):
    import traceback

    try:
        message = str(e)[:1000]
    except BaseException:  # noqa: BLE001 - the solution's __str__ may do anything
        message = ""
    frames = [
        [f.filename, f.lineno, f.name, f.line or ""]
        for f in traceback.extract_tb(e.__traceback__)
        if f.filename == SOLUTION_FILE
    ]
    try:
        only = "".join(traceback.format_exception_only(e)).rstrip().split("\n")
    except BaseException:  # noqa: BLE001
        only = [type(e).__name__]
    return {"ok": False, "error": type(e).__name__, "message": message, "tb": frames, "only": only}


def worker_main():
    """Serves the judge: requests on fd 0 (one JSON line each), replies on fd 3; the
    solution's stdout and stderr go to the judge's capture pipe (fds 1 and 2)."""
    module = types.ModuleType("solution")
    with open(0, "rb", closefd=False) as requests:
        for line in requests:
            try:
                req = json.loads(line)
                if req["op"] == "load":
                    source = req["source"]
                    linecache.cache[SOLUTION_FILE] = (
                        len(source),
                        None,
                        source.splitlines(True),
                        SOLUTION_FILE,
                    )
                    module.__file__ = SOLUTION_FILE
                    sys.modules["solution"] = module
                    exec(compile(source, SOLUTION_FILE, "exec"), module.__dict__)
                    names = [n for n in vars(module) if type(n) is str and n[:2] != "__"]
                    reply = {"ok": True, "names": names}
                else:
                    fn = vars(module)[req["name"]]
                    value = fn(*plain.decode(req["args"]), **plain.decode(req["kwargs"]))
                    reply = {"ok": True, "value": plain.encode(value)}
            except BaseException as e:  # noqa: BLE001 - whatever the solution raises is a reply
                reply = _error_reply(e)
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except BaseException:  # noqa: BLE001, S110 - the solution may have replaced it
                    pass
            data = (json.dumps(reply) + "\n").encode()
            while data:
                data = data[os.write(CHANNEL_FD, data) :]


def _zygote_main(sock):
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    keep = sock.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, 1 << 16)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel
    while True:
        fds = _recv_fds(sock, 3)
        if len(fds) != 3:
            os._exit(0)
        pid = os.fork()
        if pid == 0:
            sock.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()
            for target, fd in zip((0, 1, 2, CHANNEL_FD), (fds[0], fds[1], fds[1], fds[2])):
                os.dup2(fd, target)
            os.closerange(CHANNEL_FD + 1, 1 << 16)
            try:
                worker_main()
            finally:
                os._exit(0)
        for fd in fds:
            os.close(fd)
        sock.sendall(struct.pack("i", pid))


def _send_fds(sock, fds):
    sock.sendmsg([b"w"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, struct.pack("3i", *fds))])


def _recv_fds(sock, n):
    size = struct.calcsize(f"{n}i")
    msg, ancillary, _, _ = sock.recvmsg(16, _socket.CMSG_SPACE(size))
    for level, kind, data in ancillary:
        if msg and level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            return list(struct.unpack(f"{len(data) // 4}i", data[: len(data) // 4 * 4]))
    return []


def start_zygote():
    """Forks the zygote (before this process has read anything); returns its socket."""
    ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
    if os.fork() == 0:
        ours.close()
        try:
            _zygote_main(theirs)
        finally:
            os._exit(0)
    theirs.close()
    return ours


# -- the judge side of a worker --------------------------------------------------------------


class TestTimeout(Exception):
    """The test ran past its time limit."""


class SolutionExited(Exception):
    """The solution's process ended (or closed its reply pipe) before answering."""


class BadReply(Exception):
    """The solution's process answered out of protocol."""


class SolutionError(Exception):
    """An exception the solution raised; the subclass carries the solution's class name."""

    frames = ()
    only = ()


def _remote_error(reply):
    name = reply.get("error")
    if not (type(name) is str and name.isidentifier() and len(name) <= 64):
        name = "SolutionError"
    e = type(name, (SolutionError,), {})(str(reply.get("message", ""))[:1000])
    tb, only = reply.get("tb"), reply.get("only")
    if type(tb) is list:
        e.frames = [[str(x)[:300] for x in f[:4]] for f in tb[:50] if type(f) is list]
    if type(only) is list:
        e.only = [str(x)[:300] for x in only[:20]]
    return e


class Worker:
    """One worker forked by the zygote, with its three pipes."""

    def __init__(self, zygote):
        req_r, self.req = os.pipe()
        self.out, out_w = os.pipe()
        self.rep, rep_w = os.pipe()
        _send_fds(zygote, [req_r, out_w, rep_w])
        for fd in (req_r, out_w, rep_w):
            os.close(fd)
        data = b""
        while len(data) < 4:
            chunk = zygote.recv(4 - len(data))
            if not chunk:
                raise SolutionExited("the zygote is gone")
            data += chunk
        self.pid = struct.unpack("i", data)[0]
        self.buf, self.output, self.busy, self.dead = b"", bytearray(), False, False
        self.output_open = True

    def ask(self, msg):
        """Sends one request; returns the parsed reply (raises ``SolutionExited``, ``BadReply``)."""
        if self.dead:
            raise SolutionExited("the solution's process has ended")
        self.busy = True
        pending = memoryview((json.dumps(msg) + "\n").encode())
        poll = select.poll()
        poll.register(self.rep, select.POLLIN)
        poll.register(self.req, select.POLLOUT)
        if self.output_open:
            poll.register(self.out, select.POLLIN)
        while b"\n" not in self.buf:
            for fd, _ in poll.poll():
                if fd == self.req:
                    try:
                        pending = pending[os.write(self.req, pending[:65536]) :]
                    except BrokenPipeError:
                        raise SolutionExited("the solution's process has ended") from None
                    if not pending:
                        poll.unregister(self.req)
                elif fd == self.out:
                    self._drain()
                    if not self.output_open:
                        poll.unregister(self.out)
                else:
                    chunk = os.read(self.rep, 65536)
                    if not chunk:
                        self.dead = True
                        raise SolutionExited("the solution's process ended before answering")
                    self.buf += chunk
                    if len(self.buf) > MAX_REPLY_BYTES:
                        raise BadReply(f"a reply of more than {MAX_REPLY_BYTES} bytes")
        line, _, self.buf = self.buf.partition(b"\n")
        self.busy = False
        try:
            reply = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise BadReply(f"a reply that is not JSON ({e})") from None
        if type(reply) is not dict or type(reply.get("ok")) is not bool:
            raise BadReply("a reply without ok")
        return reply

    def _drain(self):
        chunk = os.read(self.out, 65536)
        if not chunk:
            self.output_open = False
        room = CAPTURE_BYTES - len(self.output)
        if room > 0:
            self.output += chunk[:room]

    def take_output(self):
        poll = select.poll()
        poll.register(self.out, select.POLLIN)
        while self.output_open and poll.poll(0):
            self._drain()
        text = self.output.decode("utf-8", errors="replace")
        self.output = bytearray()
        return text

    def kill(self):
        for kill in (os.killpg, os.kill):
            try:
                kill(self.pid, signal.SIGKILL)
            except OSError:
                pass
        self.close()

    def close(self):
        if self.req is not None:
            for fd in (self.req, self.out, self.rep):
                os.close(fd)
            self.req = None
        self.dead = True


class SolutionLink:
    """The solution of one job, served by a worker (replaced when it breaks)."""

    def __init__(self, zygote, source):
        self.zygote, self.source, self.worker = zygote, source, None

    @property
    def broken(self):
        return self.worker is None or self.worker.dead or self.worker.busy

    def start(self):
        """A fresh worker with the solution loaded; returns the names it defines."""
        self.close()
        self.worker = Worker(self.zygote)
        reply = self.worker.ask({"op": "load", "source": self.source})
        if not reply["ok"]:
            raise _remote_error(reply)
        names = reply.get("names")
        if type(names) is not list or len(names) > MAX_NAMES:
            raise BadReply("a load reply without names")
        return [n for n in names if type(n) is str and n.isidentifier()]

    def call(self, name, args, kwargs):
        request = {"op": "call", "name": name, "args": plain.encode(list(args))}
        request["kwargs"] = plain.encode(dict(kwargs))
        reply = self.worker.ask(request)
        if not reply["ok"]:
            raise _remote_error(reply)
        try:
            return plain.decode(reply.get("value"))
        except (ValueError, TypeError, RecursionError, OverflowError) as e:
            raise BadReply(f"a value that is not plain ({e})") from None

    def take_output(self):
        return "" if self.worker is None or self.worker.req is None else self.worker.take_output()

    def close(self):
        if self.worker is not None:
            self.worker.kill()


class Remote:
    """What a test imports from ``solution``: calls go to the worker."""

    def __init__(self, link, name):
        self._link, self.__name__ = link, name

    def __call__(self, *args, **kwargs):
        return self._link.call(self.__name__, args, kwargs)

    def __repr__(self):
        return f"<function {self.__name__}>"


# -- running a job ---------------------------------------------------------------------------


def _alarm(signum, frame):
    raise TestTimeout("test took longer than its time limit")


class deadline:  # noqa: N801 - used as a context manager, like contextlib's
    """``SIGALRM`` (``TestTimeout``) after ``seconds`` unless the block ends first."""

    def __init__(self, seconds):
        self.seconds = seconds

    def __enter__(self):
        signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def __exit__(self, *exc):
        signal.setitimer(signal.ITIMER_REAL, 0)


def _load(name, source, filename):
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType(name)
    module.__file__ = filename
    sys.modules[name] = module
    exec(compile(source, filename, "exec"), module.__dict__)
    return module


def _short_tb(e, test_file, limit):
    """pytest ``--tb=short`` style: the test's frames, the solution's, ``E   Class: message``."""
    import traceback

    out = []
    for frame in traceback.extract_tb(e.__traceback__):
        if frame.filename == test_file:
            out.append(f"{test_file}:{frame.lineno}: in {frame.name}")
            if frame.line:
                out.append(f"    {frame.line}")
    for filename, lineno, name, line in getattr(e, "frames", ()):
        out += [f"{filename}:{lineno}: in {name}", f"    {line}"] if line else []
    if isinstance(e, SolutionError):
        lines = list(e.only) or [type(e).__name__]
    else:
        lines = "".join(traceback.format_exception_only(e)).rstrip().split("\n")
    if isinstance(e, AssertionError) and not str(e):
        lines = ["AssertionError: assert " + _assert_detail(e, limit)]
    return out + [f"E   {line}" for line in lines if line.strip()]


def _assert_detail(e, limit):
    """``assert <left> <op> <right>`` with the values of a failed comparison, when simple."""
    import ast
    import traceback

    tb = e.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    frame, line = tb.tb_frame, traceback.extract_tb(tb)[-1].line or ""
    try:
        node = ast.parse(line.strip()).body[0]
    except SyntaxError:
        return line.strip().removeprefix("assert ")
    if not (isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare)):
        return line.strip().removeprefix("assert ")
    test = node.test
    if len(test.ops) != 1:
        return ast.unparse(test)
    try:
        env = {**frame.f_globals, **frame.f_locals}
        with deadline(limit):
            left = eval(compile(ast.Expression(test.left), "<assert>", "eval"), env)
            right = eval(compile(ast.Expression(test.comparators[0]), "<assert>", "eval"), env)
    except Exception:  # noqa: BLE001 - re-evaluation is only for the message
        return ast.unparse(test)
    op = ast.unparse(ast.Compare(ast.Name("L"), test.ops, [ast.Name("R")])).split()[1:-1]
    return f"{_short_repr(left)} {' '.join(op)} {_short_repr(right)}"


def _short_repr(value):
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def run_job(job, zygote, limit, report):
    """One job's results (``failures``: ``[title, lines, captured]`` when ``report``)."""
    test_file = job["test_file"]
    result = {"names": [], "outcomes": [], "errors": [], "collect_error": None, "failures": []}
    link = SolutionLink(zygote, job["solution"])
    try:
        with deadline(limit):
            names = link.start()
            module = types.ModuleType("solution")
            for name in names:
                setattr(module, name, Remote(link, name))
            sys.modules["solution"] = module
            tests = _load("test_module", job["tests"], test_file)
    except BaseException as e:  # noqa: BLE001 - any failure at import is a collection error
        result["collect_error"] = type(e).__name__
        if report:
            lines = _short_tb(e, test_file, min(limit, 1.0))
            result["failures"].append(["ERROR collecting " + test_file, lines, ""])
        link.close()
        return result
    funcs = [
        f
        for name, f in vars(tests).items()
        if name.startswith("test_") and isinstance(f, types.FunctionType)
    ]
    funcs.sort(key=lambda f: f.__code__.co_firstlineno)
    for f in funcs:
        captured, outcome, error = io.StringIO(), "error", None
        try:
            with deadline(limit):
                if link.broken:
                    link.start()
                stdout, sys.stdout = sys.stdout, captured
                try:
                    f()
                finally:
                    sys.stdout = stdout
            outcome = "passed"
        except BaseException as e:  # noqa: BLE001 - a test's failure of any kind is its result
            outcome = "failed" if isinstance(e, AssertionError) else "error"
            error = type(e).__name__
            if report:
                text = captured.getvalue() + link.take_output()
                lines = _short_tb(e, test_file, min(limit, 1.0))
                link.take_output()  # what re-evaluating the assertion printed
                result["failures"].append([f.__name__, lines, text])
        result["names"].append(f.__name__)
        result["outcomes"].append(outcome)
        result["errors"].append(error)
        if outcome != "passed" and job.get("stop_at_first_failure"):
            break
    link.close()
    return result


def main():
    exec(compile(sys.argv[-1], "plain.py", "exec"), plain.__dict__)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        sys.exit("judge: cannot make itself non-dumpable")
    zygote = start_zygote()
    request = json.loads(sys.stdin.buffer.read())
    signal.signal(signal.SIGALRM, _alarm)
    results = []
    for job in request["jobs"]:
        limit = job.get("timeout_s") or request["test_timeout_s"]
        results.append(run_job(job, zygote, limit, request["report"]))
    data = json.dumps(results).encode()
    while data:
        data = data[os.write(CHANNEL_FD, data) :]
    os._exit(0)  # nothing left to run: skip the interpreter's teardown (the run's latency)


if __name__ == "__main__":
    main()
