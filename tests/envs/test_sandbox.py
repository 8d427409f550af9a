"""The sandbox under attack: each attack is contained, ends within its limit, comes back as a
clear result, and leaves nothing running and nothing written outside."""

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid

import pytest

from agentrl_jax.envs import sandbox as sandbox_mod
from agentrl_jax.envs.sandbox import Limits, Result, Sandbox
from agentrl_jax.envs.sandbox_pool import SandboxPool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(sandbox_mod.__file__))))
UID_BASE = 1_600_000_000
MAX_SLOTS = 16
LIMITS = Limits(cpu_s=1, n_procs=32, output_bytes=1 << 20, address_space_bytes=1 << 30)


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(LIMITS, uid_base=UID_BASE, max_slots=MAX_SLOTS)


def _processes() -> dict[int, tuple[int, int, bytes]]:
    """pid -> (uid, parent pid, command line) of every process on the machine."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            uid = os.stat(f"/proc/{name}").st_uid
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        table[int(name)] = (uid, ppid, cmd)
    return table


def _ours(table, token: str) -> set[int]:
    """Processes of this test: sandbox uids, descendants of this process, or the token."""
    me = os.getpid()
    found = set()
    for pid, (uid, _, cmd) in table.items():
        if pid == me:
            continue
        if UID_BASE <= uid < UID_BASE + MAX_SLOTS or token.encode() in cmd:
            found.add(pid)
        parent, seen = table[pid][1], 0
        while parent > 1 and parent in table and seen < 64:
            if parent == me:
                found.add(pid)
                break
            parent, seen = table[parent][1], seen + 1
    return found


@pytest.fixture
def guard():
    """Asserts that the process table and the files outside are as before the test."""
    token = f"agentrl-attack-{uuid.uuid4().hex}"
    outside = f"/tmp/{token}"
    os.mkdir(outside)
    os.chmod(outside, 0o777)  # writable by anyone: only the sandbox keeps the run out
    target = os.path.join(outside, "target.txt")
    with open(target, "w") as f:
        f.write("original")
    os.chmod(target, 0o666)
    before = _ours(_processes(), token)
    yield {"token": token, "outside": outside, "target": target}
    deadline = time.monotonic() + 2.0
    while (left := _ours(_processes(), token) - before) and time.monotonic() < deadline:
        time.sleep(0.05)  # the kernel tears a pid namespace down asynchronously
    assert not left, f"left running: {[_processes().get(p) for p in left]}"
    assert os.listdir(outside) == ["target.txt"]
    with open(target) as f:
        assert f.read() == "original"
    assert not os.path.exists("/tmp/work")
    shutil.rmtree(outside)


def _run(sandbox, code: str, timeout_s: float = 5.0) -> Result:
    return sandbox.run({"main.py": code}, ["python", "main.py"], timeout_s)


def test_runs_in_fresh_directory_with_only_its_files(sandbox, guard):
    code = (
        "import os\n"
        "print(os.getcwd(), sorted(os.listdir('.')), open('data/x.txt').read())\n"
        "open('made.txt', 'w').write('x')\n"
        "print(os.getuid())\n"
    )
    files = {"main.py": code, "data/x.txt": "hello"}
    res = sandbox.run(files, ["python", "main.py"], 5.0)
    assert res.ok and not res.timed_out and res.killed_by is None
    cwd, uid = res.stdout.splitlines()
    assert cwd == "/tmp/work ['data', 'main.py'] hello"
    if os.geteuid() == 0:
        assert UID_BASE <= int(uid) < UID_BASE + MAX_SLOTS
    again = _run(sandbox, "import os; print(sorted(os.listdir('.')))")
    assert again.stdout.strip() == "['main.py']"  # the previous run's files are gone


def test_exit_status_and_stderr(sandbox, guard):
    res = _run(sandbox, "import sys\nprint('out')\nraise SystemExit(3)")
    assert (res.returncode, res.stdout, res.killed_by) == (3, "out\n", None)
    res = _run(sandbox, "1 / 0")
    assert res.returncode == 1 and "ZeroDivisionError" in res.stderr and not res.ok


def test_no_network(sandbox, guard):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
    res = _run(sandbox, code)
    server.settimeout(0.2)
    with pytest.raises(socket.timeout):
        server.accept()
    server.close()
    assert res.returncode == 1 and "Network is unreachable" in res.stderr


def test_no_write_outside(sandbox, guard):
    paths = [guard["target"], os.path.join(guard["outside"], "new.txt"), "/var/tmp/x", "/dev/shm/x"]
    paths.append(os.path.abspath(__file__) + ".x")
    code = (
        "import os\n"
        f"for p in {paths!r} + ['../escape.txt']:\n"
        "    try:\n"
        "        with open(p, 'w') as f:\n"
        "            f.write('pwned')\n"
        "        print('wrote', p)\n"
        "    except OSError as e:\n"
        "        print('refused', p)\n"
    )
    res = _run(sandbox, code)
    assert res.ok
    # writes either fail or land in the run's own tmpfs, which vanishes with it
    assert not os.path.exists("/var/tmp/x") and not os.path.exists("/dev/shm/x")
    assert not os.path.exists(paths[-1])
    assert "refused /var/tmp/x" in res.stdout


def test_scrubbed_environment(sandbox, guard, monkeypatch):
    monkeypatch.setenv("AGENTRL_SECRET", "s3cret")
    res = _run(sandbox, "import os\nprint(sorted(os.environ), os.environ.get('AGENTRL_SECRET'))")
    assert "s3cret" not in res.stdout and res.stdout.rstrip().endswith("None")
    assert set(eval(res.stdout.rsplit(" ", 1)[0])) <= {
        "PATH", "HOME", "TMPDIR", "LANG", "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING",
        "PYTHONHASHSEED", "LC_CTYPE",
    }  # fmt: skip


def test_fork_bomb_is_contained(sandbox, guard):
    code = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    start = time.monotonic()
    res = _run(sandbox, code, timeout_s=1.0)
    assert time.monotonic() - start < 3.0
    assert res.timed_out and res.killed_by == "timeout" and res.returncode < 0
    res = _run(sandbox, "import os\nwhile True:\n    os.fork()\n", timeout_s=5.0)
    assert res.killed_by == "procs" and "BlockingIOError" in res.stderr


def test_ten_gigabytes_fail(sandbox, guard):
    res = _run(sandbox, "b = bytearray(10 * 2**30)\n")
    assert res.killed_by == "memory" and res.returncode == 1 and res.wall_s < 5.0


def test_infinite_loop_hits_cpu_limit(sandbox, guard):
    res = _run(sandbox, "while True:\n    pass\n", timeout_s=10.0)
    assert res.killed_by == "cpu" and not res.timed_out and res.wall_s < 5.0


def test_sleep_forever_hits_timeout(sandbox, guard):
    res = _run(sandbox, "import time\ntime.sleep(10**6)\n", timeout_s=0.5)
    assert res.timed_out and res.killed_by == "timeout" and 0.5 <= res.wall_s < 2.0


def test_printing_a_gigabyte_is_cut(sandbox, guard):
    code = (
        "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(chunk)\n"
    )
    res = _run(sandbox, code, timeout_s=10.0)
    assert res.killed_by == "output" and res.truncated and res.wall_s < 5.0
    assert len(res.stdout) + len(res.stderr) <= LIMITS.output_bytes


def test_setsid_daemon_does_not_outlive_the_run(sandbox, guard):
    code = (
        "import subprocess, sys\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1000)', "
        f"'{guard['token']}'], start_new_session=True)\n"
        "print('started')\n"
    )
    res = _run(sandbox, code)
    assert res.ok and res.stdout == "started\n" and res.wall_s < 5.0
    # the guard asserts that no process carrying the token is left


def test_killing_its_parent_reaches_nothing(sandbox, guard):
    me = os.getpid()
    code = (
        "import os, signal\n"
        f"for pid in (os.getppid(), {me}, -1):\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "        print('killed', pid)\n"
        "    except OSError as e:\n"
        "        print('refused', pid, e.errno)\n"
    )
    res = _run(sandbox, code)
    assert res.ok, res
    assert "killed 1" not in res.stdout and f"killed {me}" not in res.stdout


def test_file_size_limit(guard):
    sb = Sandbox(Limits(file_size_bytes=1024), uid_base=UID_BASE, max_slots=MAX_SLOTS)
    res = _run(sb, "with open('big', 'w') as f:\n    f.write('x' * 4096)\n")
    assert res.killed_by == "file_size" and "File too large" in res.stderr


def test_pool_runs_concurrently_with_distinct_uids(sandbox, guard):
    code = "import os, time\ntime.sleep(0.4)\nprint(os.getuid())\n"
    with SandboxPool(sandbox, max_workers=4) as pool:
        start = time.monotonic()
        results = pool.map([({"main.py": code}, ["python", "main.py"], 5.0)] * 4)
        elapsed = time.monotonic() - start
    assert all(r.ok and r.wall_s >= 0.4 for r in results)
    # overlapped, not one after another (one after another takes at least the sum of the runs'
    # own wall times; relative, so load on the machine slows both sides alike)
    assert elapsed < 0.75 * sum(r.wall_s for r in results)
    if os.geteuid() == 0:
        assert len({r.stdout for r in results}) == 4


@pytest.mark.parametrize(
    "kwargs",
    [dict(cpu_s=0), dict(address_space_bytes=1), dict(n_procs=0), dict(output_bytes=10)],
)
def test_limits_are_validated(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Limits(**kwargs)


@pytest.mark.parametrize(
    "files, argv, timeout_s, field",
    [
        ({"/etc/x": ""}, ["python"], 1.0, "files"),
        ({"../x": ""}, ["python"], 1.0, "files"),
        ({}, [], 1.0, "argv"),
        ({}, ["bash", "-c", "true"], 1.0, "argv"),
        ({}, ["python"], 0.0, "timeout_s"),
    ],
)
def test_run_arguments_are_validated(sandbox, files, argv, timeout_s, field):
    with pytest.raises(ValueError, match=field):
        sandbox.run(files, argv, timeout_s)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start a process as nobody")
def test_unprivileged_trainer_uses_a_user_namespace(tmp_path):
    """A trainer that is not root: the run uses a user namespace, still no network, no writes."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    setpriv = shutil.which("setpriv")
    probe = subprocess.run(
        [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "unshare", "--user",
         "--map-root-user", "--net", "true"],
        capture_output=True,
    )  # fmt: skip
    if python is None or setpriv is None or probe.returncode != 0:
        pytest.skip("no system python3, setpriv, or unprivileged user namespaces here")
    script = (
        "import sys\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "from agentrl_jax.envs import sandbox as sb\n"
        "box = sb.Sandbox(sb.Limits(cpu_s=2))\n"
        'code = (\'import os, socket\\nfor p in ("/var/tmp/x", "/etc/x"):\\n\'\n'
        "        '    try:\\n        open(p, \"w\")\\n    except OSError as e:\\n'\n"
        "        '        print(\"refused\", p)\\n'\n"
        "        'try:\\n    socket.create_connection((\"1.1.1.1\", 53), timeout=1)\\n'\n"
        "        'except OSError as e:\\n    print(\"net\", e.errno)\\n')\n"
        "r = box.run({'m.py': code}, ['python', 'm.py'], 10)\n"
        "print(r.returncode, r.stdout, r.stderr)\n"
    )
    out = subprocess.run(
        [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", script],
        capture_output=True,
        text=True,
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert "refused /var/tmp/x" in out.stdout and "refused /etc/x" in out.stdout
    assert "net 101" in out.stdout  # ENETUNREACH
    assert not os.path.exists("/var/tmp/x")


def test_refuses_without_isolation(monkeypatch):
    monkeypatch.setattr(sandbox_mod.shutil, "which", lambda *a, **k: None)
    with pytest.raises(sandbox_mod.SandboxUnavailable, match="unshare"):
        Sandbox()
    assert sys.executable  # the trainer itself is untouched


def test_child_cannot_import_the_trainer_package(sandbox, guard):
    res = _run(sandbox, "import agentrl_jax\n")
    assert res.returncode == 1 and "ModuleNotFoundError" in res.stderr


def test_pool_validates_workers(sandbox):
    with pytest.raises(ValueError, match="max_workers"):
        SandboxPool(sandbox, max_workers=0)
