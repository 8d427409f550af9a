"""The process that sets up one sandboxed run; executed as a script, never imported.

``Sandbox`` runs this file's source with ``python -I -S -c`` inside fresh network, pid and mount
namespaces (``unshare --net --pid --fork --mount --mount-proc``), so it is process 1 of the new
pid namespace and everything the program starts dies with it. It uses the standard library
only. Steps:

  1. read the run's spec (``marshal``: files, argv, env, limits, uid/gid, status fd) from stdin;
  2. remount every mount read-only (keeping the flags the kernel locks), then mount a fresh,
     size-limited tmpfs on ``/tmp`` and write the files into ``/tmp/work`` (owned by the run's
     uid): nothing outside that tmpfs is writable, and the tmpfs vanishes with the namespace;
  3. fork the program: setsid(), stdin ``/dev/null``, rlimits, supplementary groups cleared,
     uid/gid dropped (when started as root), ``no_new_privs``, ``execve``;
  4. reap every process until the program exits, write its wait status and CPU time to
     the status fd, exit (which kills whatever the program left running).

The status is one line of text: ``ok STATUS CPU_S`` or ``error MESSAGE``. A setup failure
writes the latter to the status fd and exits 2; the program never runs
without its isolation.
"""

import ctypes
import marshal
import os
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_RELATIME = 1 << 21
PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 4, 38
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


def mount(source, target, fstype, flags, data):
    args = [None if a is None else a.encode() for a in (source, target, fstype)]
    opts = None if data is None else data.encode()
    if libc.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), opts) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def mount_points():
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4]
            # mountinfo escapes space, tab, newline and backslash as octal
            points.append(point.encode().decode("unicode_escape").encode("latin-1").decode())
    return points


def make_read_only():
    for point in mount_points():
        try:
            flags = os.statvfs(point).f_flag
        except OSError:
            continue  # a mount point hidden under another mount
        keep = sum(ms for st, ms in KEEP_FLAGS if flags & st)
        mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep, None)


def write_files(files, uid, gid):
    os.mkdir(WORKDIR, 0o700)
    os.chown(WORKDIR, uid, gid)
    for rel, text in files.items():
        path = os.path.join(WORKDIR, rel)
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            os.makedirs(parent, 0o700)
            d = parent
            while d != WORKDIR:
                os.chown(d, uid, gid)
                d = os.path.dirname(d)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chown(path, uid, gid)


def exec_program(spec):
    os.setsid()
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(WORKDIR)
    limits = spec["limits"]
    for key, res in LIMITS:
        soft = int(limits[key])
        hard = soft + 1 if key == "cpu_s" else soft  # SIGXCPU first, SIGKILL a second later
        resource.setrlimit(res, (soft, hard))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if spec["drop_to"] is not None:
        uid, gid = spec["drop_to"]
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    os.execve(spec["argv"][0], spec["argv"], spec["env"])


def report(fd, text):
    os.write(fd, text.encode())
    os.close(fd)


def main():
    spec = marshal.loads(sys.stdin.buffer.read())
    status_fd = int(spec["status_fd"])
    # not dumpable: a program running as the same uid (user-namespace mode) cannot ptrace this
    # process or open its file descriptors (the status fd) through /proc
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    uid, gid = spec["drop_to"] if spec["drop_to"] is not None else (os.getuid(), os.getgid())
    try:
        make_read_only()
        disk = int(spec["limits"]["disk_bytes"])
        mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk},mode=1777")
        write_files(spec["files"], uid, gid)
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
