"""The process that sets up one sandboxed run; executed as a script, never imported.

``Sandbox`` runs this file's source with ``python -I -S -c`` inside fresh network, pid and mount
namespaces (``unshare --net --pid --fork --mount``, plus ``--user --map-root-user`` when the
trainer is not root), so it is process 1 of the new pid namespace and everything the program
starts dies with it. It uses the standard library only. Steps:

  1. read the run's spec (``marshal``: files, argv, env, limits, root layout, uid/gid, stdin
     bytes, status and channel fds) from stdin;
  2. build the minimal root (``sandbox_root``) on a tmpfs: the layout's host paths bind-mounted
     read-only at the same paths (symlinks on the way copied as symlinks), package directories
     covered, the device nodes bound, a size-limited tmpfs on ``/tmp`` with the files in
     ``/tmp/work`` (owned by the run's uid); then ``pivot_root`` into it (``MS_MOVE`` + ``chroot``
     where the host root cannot be pivoted), detach the old root and make ``/`` read-only;
  3. fork the program: setsid(), stdin the spec's bytes (a memory file) or ``/dev/null``, the
     channel fd as fd 3 when asked for, every other fd closed, rlimits, capabilities dropped
     (bounding set, and ``SECBIT_NOROOT`` with empty sets in a user namespace, where the program
     keeps uid 0 of the namespace), uid/gid dropped when started as root, ``no_new_privs``,
     ``execve``;
  4. reap every process until the program exits, write its wait status and CPU time to the
     status fd, exit (which kills whatever the program left running).

The status is one line of text: ``ok STATUS CPU_S`` or ``error MESSAGE``. A setup failure
writes the latter to the status fd and exits 2: the program never runs without its isolation.
"""

import ctypes
import errno
import marshal
import os
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_MOVE = 32, 1024, 2048, 4096, 8192
MS_RELATIME = 1 << 21
MNT_DETACH = 2
PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_SECUREBITS = 4, 24, 28
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
# SECBIT_NOROOT, NO_SETUID_FIXUP, KEEP_CAPS (locked), NO_CAP_AMBIENT_RAISE, each with its lock
SECUREBITS = 0b11101111
CAPABILITY_VERSION_3 = 0x20080522
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
STAGES = ("/mnt", "/media", "/srv", "/opt", "/tmp")  # where the new root is assembled
WORKDIR = "/tmp/work"
# statvfs flag -> mount flag that a bind remount must keep (the kernel refuses to clear locked
# flags inside a user namespace).
KEEP_FLAGS = (
    (os.ST_NOSUID, MS_NOSUID),
    (os.ST_NODEV, MS_NODEV),
    (os.ST_NOEXEC, MS_NOEXEC),
    (os.ST_NOATIME, MS_NOATIME),
    (os.ST_NODIRATIME, MS_NODIRATIME),
    (os.ST_RELATIME, MS_RELATIME),
)
LIMITS = (
    ("cpu_s", resource.RLIMIT_CPU),
    ("address_space_bytes", resource.RLIMIT_AS),
    ("file_size_bytes", resource.RLIMIT_FSIZE),
    ("n_procs", resource.RLIMIT_NPROC),
    ("n_open_files", resource.RLIMIT_NOFILE),
)

libc = ctypes.CDLL(None, use_errno=True)


def check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags, data):
    args = [None if a is None else os.fsencode(a) for a in (source, target, fstype)]
    opts = None if data is None else data.encode()
    check(libc.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), opts), f"mount {target}")


def bind_read_only(host, inside):
    if os.path.isdir(host):
        os.mkdir(inside, 0o755)
    else:
        os.close(os.open(inside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    mount(host, inside, None, MS_BIND, None)
    flags = os.statvfs(host).f_flag
    keep = sum(ms for st, ms in KEEP_FLAGS if flags & st)
    mount(None, inside, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | keep, None)


def replicate(stage, path, depth=0):
    """Makes ``path`` resolve under ``stage`` as it does on the host: directories on the way
    created, symlinks on the way copied (and followed), the final file or directory bound
    read-only. Paths already visible (under a bound directory) are left as they are."""
    if depth > 40:
        raise OSError(errno.ELOOP, f"too many symlinks resolving {path}")
    parts = [p for p in path.split("/") if p]
    host = "/"
    for i, part in enumerate(parts):
        host = os.path.join(host, part)  # free of symlinks: each one is followed below
        inside = stage + host
        if os.path.islink(host):
            if not os.path.lexists(inside):
                os.symlink(os.readlink(host), inside)
            target = os.path.join(os.path.dirname(host), os.readlink(host), *parts[i + 1 :])
            return replicate(stage, os.path.normpath(target), depth + 1)
        last = i == len(parts) - 1
        if os.path.lexists(inside):
            continue
        if last:
            bind_read_only(host, inside)
        else:
            os.mkdir(inside, 0o755)
    return None


def pick_stage(paths):
    for stage in STAGES:
        if os.path.isdir(stage) and not os.path.islink(stage):
            if not any(p == stage or p.startswith(stage + "/") for p in paths):
                return stage
    raise OSError(errno.ENOENT, f"no directory among {STAGES} to assemble the root on")


def build_root(spec, uid, gid):
    layout = spec["root"]
    stage = pick_stage(layout["paths"])
    mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
    for path in layout["paths"]:
        replicate(stage, path)
    for path in layout["hidden"]:
        if os.path.isdir(stage + path):
            mount("tmpfs", stage + path, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=4k")
    os.mkdir(stage + "/dev", 0o755)
    for dev in layout["devices"]:
        if os.path.exists(dev):
            os.close(os.open(stage + dev, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            mount(dev, stage + dev, None, MS_BIND, None)
    os.mkdir(stage + "/tmp", 0o755)
    disk = int(spec["limits"]["disk_bytes"])
    mount("tmpfs", stage + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk},mode=1777")
    write_files(stage + WORKDIR, spec["files"], uid, gid)
    enter_root(stage)
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None)


def enter_root(stage):
    """Makes ``stage`` the root and detaches the old one (``pivot_root``); on a root that cannot
    be pivoted (an initramfs), moves ``stage`` over it and ``chroot``s."""
    os.chdir(stage)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is not None and libc.syscall(number, b".", b".") == 0:
        check(libc.umount2(b".", MNT_DETACH), "umount the old root")
    else:
        mount(".", "/", None, MS_MOVE, None)
        os.chroot(".")
    os.chdir("/")


def write_files(workdir, files, uid, gid):
    os.mkdir(workdir, 0o700)
    os.chown(workdir, uid, gid)
    for rel, text in files.items():
        path = os.path.join(workdir, rel)
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            os.makedirs(parent, 0o700)
            d = parent
            while d != workdir:
                os.chown(d, uid, gid)
                d = os.path.dirname(d)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chown(path, uid, gid)


def drop_capabilities(drop_to):
    """Empties the bounding and ambient sets; then either drops to ``drop_to`` (the kernel
    clears the other sets for a non-zero uid) or, as uid 0 of a user namespace, locks
    ``SECBIT_NOROOT`` (``execve`` grants uid 0 nothing) and empties the sets."""
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # past the last capability the kernel knows
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    if drop_to is not None:
        uid, gid = drop_to
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        return
    check(libc.prctl(PR_SET_SECUREBITS, SECUREBITS, 0, 0, 0), "prctl(PR_SET_SECUREBITS)")
    header = (ctypes.c_uint32 * 2)(CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    check(libc.capset(header, data), "capset")


def arrange_fds(spec):
    """stdin: the spec's bytes in a memory file (or ``/dev/null``); fd 3: the channel when asked
    for; every other descriptor beyond stderr closed."""
    if spec["stdin"]:
        fd = os.memfd_create("stdin", 0)
        data = memoryview(spec["stdin"])
        while data:
            data = data[os.write(fd, data) :]
        os.lseek(fd, 0, os.SEEK_SET)
    else:
        fd = os.open("/dev/null", os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    keep = 3
    if spec["channel_fd"] is not None:
        os.dup2(int(spec["channel_fd"]), 3)
        keep = 4
    os.closerange(keep, resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def exec_program(spec):
    os.setsid()
    arrange_fds(spec)
    os.chdir(WORKDIR)
    limits = spec["limits"]
    for key, res in LIMITS:
        soft = int(limits[key])
        hard = soft + 1 if key == "cpu_s" else soft  # SIGXCPU first, SIGKILL a second later
        resource.setrlimit(res, (soft, hard))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    drop_capabilities(spec["drop_to"])
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    os.execve(spec["argv"][0], spec["argv"], spec["env"])


def report(fd, text):
    os.write(fd, text.encode())
    os.close(fd)


def main():
    spec = marshal.loads(sys.stdin.buffer.read())
    status_fd = int(spec["status_fd"])
    # not dumpable: a program running as the same uid (user-namespace mode) cannot ptrace this
    # process or open its file descriptors (the status fd)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    uid, gid = spec["drop_to"] if spec["drop_to"] is not None else (os.getuid(), os.getgid())
    try:
        build_root(spec, uid, gid)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which refuses to go on
        report(status_fd, f"error sandbox setup failed: {e}")
        sys.exit(2)
    pid = os.fork()
    if pid == 0:
        os.close(status_fd)
        try:
            exec_program(spec)
        except BaseException as e:  # noqa: BLE001 - the child must never return into main()
            os.write(2, f"sandbox: cannot start {spec['argv'][0]}: {e}\n".encode())
        os._exit(127)
    if spec["channel_fd"] is not None:
        os.close(int(spec["channel_fd"]))
    while True:
        try:
            done, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            report(status_fd, "error sandbox lost its child")
            sys.exit(2)
        if done == pid:
            cpu = usage.ru_utime + usage.ru_stime
            report(status_fd, f"ok {status} {cpu}")
            return


if __name__ == "__main__":
    main()
