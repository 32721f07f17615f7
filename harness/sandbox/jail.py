"""The operating-system wall around untrusted code: namespaces, a minimal read-only root, a private
size-capped ``/tmp`` per process, a distinct uid per process, seccomp and rlimits.

Everything here is trusted code that runs inside the sandboxed process tree before untrusted code
does (``harness.sandbox.zygote``). The Python-level layers (static check, audit hook, restricted builtins)
are early, readable refusals; this module is what must hold when they have been bypassed.

Three modes (``Policy.mode``), chosen by the user and never downgraded silently:

- ``strict`` (default): new user (when not root), mount, pid, ipc and network namespaces for the
  zygote; a private mount namespace and tmpfs per episode; a distinct uid per episode process (root:
  from a reserved range; unprivileged: refused, because one unprivileged user namespace maps one
  uid); seccomp; rlimits.
- ``shared_uid``: as strict, but accepts that episode processes of one zygote share a uid when the
  executor runs unprivileged. Siblings are still kept apart by seccomp (no signals to other
  processes, no ptrace), by separate mount namespaces and by the absence of ``/proc``.
- ``landlock``: for kernels or containers that forbid namespaces: no namespaces; Landlock confines
  the file system (read: the standard library; write: the episode's private directory), seccomp
  denies sockets and everything else listed below, a distinct uid when root.

Every step reports what it did; a step the kernel refuses raises ``JailError`` naming the step, the
errno and the mode that would accept the weaker setup.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import platform
import resource
import struct
import sys
import sysconfig
from typing import Any

MODES = ("strict", "shared_uid", "landlock")

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2


class JailError(OSError):
    """A protection the policy requires could not be applied. The message names the step."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Policy:
    # The environment variable WHALE_SANDBOX sets the default mode (e.g. for the test suite on a
    # machine where the executor cannot run as root); an explicit mode always wins.
    mode: str = dataclasses.field(default_factory=lambda: os.environ.get("WHALE_SANDBOX", "strict"))
    tmp_bytes: int = 64 << 20  # the episode's private /tmp (and /dev/shm): a tmpfs of this size
    uid_base: int = 0x3F000000  # root mode: episode uids come from [uid_base, uid_base + 2**24)
    user_namespace: bool = False  # True: the unprivileged setup (user namespace) even as root

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"sandbox mode {self.mode!r}: expected one of {', '.join(MODES)}")
        if not 1 << 20 <= self.tmp_bytes <= 1 << 34:
            raise ValueError(f"sandbox tmp_bytes {self.tmp_bytes}: expected 1 MiB to 16 GiB")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---- libc and raw system calls --------------------------------------------------------------------

_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


_ARCH = platform.machine()
# (audit arch, {name: number}) per architecture; names absent on an arch are simply not listed.
# fmt: off
_SYSCALLS: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (0xC000003E, dict(
        execve=59, execveat=322, ptrace=101, process_vm_readv=310, process_vm_writev=311,
        kcmp=312, socket=41, socketpair=53, connect=42, bind=49, listen=50, accept=43,
        accept4=288, mount=165, umount2=166, pivot_root=155, chroot=161, unshare=272, setns=308,
        clone=56, clone3=435, fork=57, vfork=58, setsid=112, setpgid=109, keyctl=250, add_key=248,
        request_key=249, bpf=321, perf_event_open=298, userfaultfd=323, io_uring_setup=425,
        io_uring_enter=426, io_uring_register=427, init_module=175, finit_module=313,
        delete_module=176, kexec_load=246, kexec_file_load=320, reboot=169, swapon=167,
        swapoff=168, acct=163, quotactl=179, open_by_handle_at=304, name_to_handle_at=303,
        syslog=103, ioperm=173, iopl=172, memfd_create=319, memfd_secret=447, shmget=29,
        msgget=68, semget=64, rt_sigqueueinfo=129, rt_tgsigqueueinfo=297, pidfd_open=434,
        pidfd_send_signal=424, pidfd_getfd=438, mknod=133, mknodat=259, fsopen=430, fsmount=432,
        move_mount=429, open_tree=428, fsconfig=431, fspick=433, mount_setattr=442,
        personality=135, migrate_pages=256, move_pages=279, lookup_dcookie=212, seccomp=317,
        kill=62, tkill=200, tgkill=234, prlimit64=302, capset=126, fcntl=72, ioctl=16
    )),
    "aarch64": (0xC00000B7, dict(
        execve=221, execveat=281, ptrace=117, process_vm_readv=270, process_vm_writev=271,
        kcmp=272, socket=198, socketpair=199, connect=203, bind=200, listen=201, accept=202,
        accept4=242, mount=40, umount2=39, pivot_root=41, chroot=51, unshare=97, setns=268,
        clone=220, clone3=435, setsid=157, setpgid=154, keyctl=219, add_key=217, request_key=218,
        bpf=280, perf_event_open=241, userfaultfd=282, io_uring_setup=425, io_uring_enter=426,
        io_uring_register=427, init_module=105, finit_module=273, delete_module=106,
        kexec_load=104, kexec_file_load=294, reboot=142, swapon=224, swapoff=225, acct=89,
        quotactl=60, open_by_handle_at=265, name_to_handle_at=264, syslog=116, memfd_create=279,
        memfd_secret=447, shmget=194, msgget=186, semget=190, rt_sigqueueinfo=138,
        rt_tgsigqueueinfo=240, pidfd_open=434, pidfd_send_signal=424, pidfd_getfd=438, mknodat=33,
        fsopen=430, fsmount=432, move_mount=429, open_tree=428, fsconfig=431, fspick=433,
        mount_setattr=442, personality=92, migrate_pages=238, move_pages=239, lookup_dcookie=18,
        seccomp=277, kill=129, tkill=130, tgkill=131, prlimit64=261, capset=91, fcntl=25, ioctl=29
    )),
}
# fmt: on
# Denied outright (EPERM): new programs, other processes' memory, sockets (the inherited channel
# keeps working), namespaces and mounts, new processes and threads, kernel keyrings, BPF, perf,
# io_uring, modules, anonymous memory files, SysV IPC. kill/tkill/tgkill/prlimit64 are allowed
# only on the calling process itself (checked on the pid argument).
# fmt: off
DENIED = (
    "execve", "execveat", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "socket",
    "socketpair", "connect", "bind", "listen", "accept", "accept4", "mount", "umount2",
    "pivot_root", "chroot", "unshare", "setns", "clone", "clone3", "fork", "vfork", "setsid",
    "setpgid", "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "init_module", "finit_module",
    "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff", "acct",
    "quotactl", "open_by_handle_at", "name_to_handle_at", "syslog", "ioperm", "iopl",
    "memfd_create", "memfd_secret", "shmget", "msgget", "semget", "rt_sigqueueinfo",
    "rt_tgsigqueueinfo", "pidfd_open", "pidfd_send_signal", "pidfd_getfd", "mknod", "mknodat",
    "fsopen", "fsmount", "move_mount", "open_tree", "fsconfig", "fspick", "mount_setattr",
    "personality", "migrate_pages", "move_pages", "lookup_dcookie", "seccomp", "capset",
)
# fmt: on
_SELF_ONLY = ("kill", "tkill", "tgkill", "prlimit64")  # first argument must be our pid (or 0)
# Commands that would make the kernel signal another process on our behalf (SIGIO/SIGURG owner of
# a file or socket, the signal it sends) or push input into a terminal: refused by the second
# argument's value.
_ARG1_DENIED = {
    "fcntl": (8, 10, 15),  # F_SETOWN, F_SETSIG, F_SETOWN_EX
    "ioctl": (0x8901, 0x8902, 0x5412),  # FIOSETOWN, SIOCSPGRP, TIOCSTI
}


def _nr(name: str) -> int:
    return _SYSCALLS[_ARCH][1][name]


def _fail(step: str, err: int, hint: str = "") -> JailError:
    return JailError(err, f"sandbox: {step} failed: {os.strerror(err)}{hint}")


def _check(rc: int, step: str, hint: str = "") -> None:
    if rc != 0:
        raise _fail(step, ctypes.get_errno(), hint)


def _unshare(flags: int, step: str, hint: str = "") -> None:
    _check(_libc().unshare(flags), step, hint)


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    rc = _libc().mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))
    _check(rc, f"mount {fstype or 'bind'} on {target}")


_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_PDEATHSIG = 1
_PR_CAPBSET_DROP = 24
_PR_SET_SECUREBITS = 28
_PR_SET_DUMPABLE = 4


def prctl(option: int, arg: int = 0) -> int:
    return _libc().prctl(option, ctypes.c_ulong(arg), 0, 0, 0)


def no_new_privs() -> None:
    _check(prctl(_PR_SET_NO_NEW_PRIVS, 1), "no_new_privs")


def die_with_parent() -> None:
    prctl(_PR_SET_PDEATHSIG, 9)


# ---- the zygote's namespaces and root -------------------------------------------------------------

_USERNS_HINT = (
    "; the kernel refuses unprivileged user namespaces (Ubuntu 23.10+: sysctl "
    "kernel.apparmor_restrict_unprivileged_userns=0, or run the executor as root), or accept the "
    "weaker mode: sandbox mode 'landlock' (WHALE_SANDBOX=landlock or ExecutorConfig.sandbox)"
)


def enter_namespaces(policy: Policy) -> dict[str, str]:
    """Called by the zygote's launcher before it forks the zygote (which becomes pid 1 of the new
    pid namespace). Root: mount, pid, ipc and network namespaces. Unprivileged: a user namespace
    that maps the caller's uid to 0 first."""
    if policy.mode == "landlock":
        return {"namespaces": "none (landlock mode)"}
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNET
    if os.geteuid() == 0 and not policy.user_namespace:
        _unshare(
            flags,
            "unshare(mount, pid, ipc, net)",
            "; or accept the weaker mode: WHALE_SANDBOX=landlock",
        )
        return {"namespaces": "mount, pid, ipc, network (as root)"}
    uid, gid = os.geteuid(), os.getegid()
    _unshare(CLONE_NEWUSER | flags, "unshare(user, mount, pid, ipc, net)", _USERNS_HINT)
    try:
        for path, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"),
                           ("gid_map", f"0 {gid} 1")):  # fmt: skip
            with open(f"/proc/self/{path}", "w") as f:
                f.write(text)
    except OSError as e:
        raise _fail("user namespace id mapping", e.errno or errno.EPERM, _USERNS_HINT) from None
    return {"namespaces": f"user (uid {uid} as 0), mount, pid, ipc, network"}


def stdlib_paths() -> list[str]:
    """The interpreter's standard library (with lib-dynload), never a virtual environment's."""
    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix, "installed_base": sys.base_prefix,
            "installed_platbase": sys.base_exec_prefix}  # fmt: skip
    paths = sysconfig.get_paths(vars=base)
    return _dedupe([paths["stdlib"], paths["platstdlib"]])


def _dedupe(paths: list[str]) -> list[str]:
    seen: list[str] = []
    for p in paths:
        p = os.path.realpath(p)
        if os.path.isdir(p) and not any(p == s or p.startswith(s + os.sep) for s in seen):
            seen = [s for s in seen if not s.startswith(p + os.sep)] + [p]
    return seen


def _under(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r + os.sep) for r in roots)


def build_root(newroot: str, extra: list[str] = ()) -> dict[str, str]:  # type: ignore[assignment]
    """In the zygote (pid 1, own mount namespace): a read-only root that holds only the standard
    library (its site-packages/dist-packages covered by an empty tmpfs), the ``extra`` package
    directories, /dev/null, /dev/zero, /dev/urandom, and mount points for the episode's /tmp and
    /dev/shm. No /proc, no /sys, no home, no project, no run directory, no other package."""
    roots = stdlib_paths()
    hidden = [os.path.join(r, n) for r in roots for n in ("site-packages", "dist-packages")
              if os.path.isdir(os.path.join(r, n))]  # fmt: skip
    extra = [p for p in _dedupe(list(extra)) if _under(p, hidden) or not _under(p, roots)]
    ro = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    os.makedirs(newroot, exist_ok=True)
    _mount("tmpfs", newroot, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for p in roots:
        os.makedirs(newroot + p, exist_ok=True)
        _mount(p, newroot + p, None, MS_BIND | MS_REC, None)
        _mount(None, newroot + p, None, ro, None)
    for p in hidden:
        _mount("tmpfs", newroot + p, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
    for p in extra:
        os.makedirs(newroot + p, exist_ok=True)
        _mount(p, newroot + p, None, MS_BIND | MS_REC, None)
        _mount(None, newroot + p, None, ro, None)
    for p in hidden:
        _mount(None, newroot + p, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
    os.makedirs(newroot + "/dev/shm", exist_ok=True)
    os.makedirs(newroot + "/tmp", mode=0o755, exist_ok=True)
    for dev in ("null", "zero", "urandom"):
        target = f"{newroot}/dev/{dev}"
        open(target, "w").close()
        _mount(f"/dev/{dev}", target, None, MS_BIND, None)
    os.makedirs(newroot + "/.old", exist_ok=True)
    _check(_libc().syscall(_nr("pivot_root"), newroot.encode(), (newroot + "/.old").encode()),
           "pivot_root")  # fmt: skip
    os.chdir("/")
    _check(_libc().umount2(b"/.old", MNT_DETACH), "detach the old root")
    os.rmdir("/.old")
    _mount(None, "/", None, ro, None)
    visible = ", ".join(roots + extra)
    return {
        "filesystem": f"read-only: {visible}" + ("; hidden: " + ", ".join(hidden) if hidden else "")
    }


# ---- one episode process --------------------------------------------------------------------------


def _drop_capabilities() -> None:
    """Unprivileged mode: uid 0 of the user namespace gives up every capability for good."""
    for cap in range(64):
        if prctl(_PR_CAPBSET_DROP, cap) != 0 and ctypes.get_errno() == errno.EINVAL:
            break
    # SECBIT_NOROOT | NOROOT_LOCKED | NO_SETUID_FIXUP | _LOCKED | KEEP_CAPS_LOCKED
    prctl(_PR_SET_SECUREBITS, 0x1 | 0x2 | 0x4 | 0x8 | 0x20)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()
    _check(_libc().syscall(_nr("capset"), header, data), "drop capabilities")


def set_limits(limits: Any, reserved_bytes: int = 0) -> dict[str, str]:
    """rlimits of an episode or tool process (``harness.sandbox.python_layer.Limits``); never raises a limit.
    ``reserved_bytes`` (the private tmpfs, which is RAM) comes out of the address-space limit so
    that the two together stay within ``limits.memory_bytes``."""
    report = {}
    memory = max(limits.memory_bytes - reserved_bytes, 64 << 20)
    for name, which, value, headroom in (
        ("memory", resource.RLIMIT_AS, memory, 0),
        ("cpu", resource.RLIMIT_CPU, limits.cpu_s, 1),  # soft: SIGXCPU; hard a second later
        ("open_files", resource.RLIMIT_NOFILE, limits.open_files, 0),
        ("file_size", resource.RLIMIT_FSIZE, limits.file_bytes, 0),
        ("core", resource.RLIMIT_CORE, 0, 0),
        ("processes", resource.RLIMIT_NPROC, 0, 0),
    ):
        soft, hard = resource.getrlimit(which)
        new_soft, new_hard = value, value + headroom
        if hard != resource.RLIM_INFINITY:
            new_soft, new_hard = min(new_soft, hard), min(new_hard, hard)
        try:
            resource.setrlimit(which, (new_soft, new_hard))
        except (ValueError, OSError) as e:
            raise _fail(f"rlimit {name}", getattr(e, "errno", None) or errno.EINVAL) from None
        report[f"rlimit_{name}"] = str(new_soft)
    return report


def enter_episode(policy: Policy, uid: int | None, workdir: str | None) -> dict[str, str]:
    """In a freshly forked episode (or tool) process, before any untrusted code: a private tmpfs
    /tmp (and /dev/shm) in its own mount namespace, its own uid (root) or no capabilities
    (unprivileged), no new privileges, seccomp. ``workdir``: landlock mode's private directory.
    rlimits are set by the caller (``set_limits``) just before seccomp, which comes last."""
    report: dict[str, str] = {}
    if policy.mode != "landlock":
        _unshare(CLONE_NEWNS, "unshare(mount) for the episode")
        opts = f"size={policy.tmp_bytes},mode=0700,uid={uid or 0},gid={uid or 0}"
        _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, opts)
        _mount("/tmp", "/dev/shm", None, MS_BIND, None)
        os.chdir("/tmp")
        report["tmp"] = (f"private tmpfs of {policy.tmp_bytes >> 20} MiB (/tmp, /dev/shm), "
                         "counted in the memory limit")  # fmt: skip
    else:
        assert workdir is not None
        os.chdir(workdir)
        report["tmp"] = "private directory (landlock): files capped by RLIMIT_FSIZE, not its total"
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        report["uid"] = f"distinct uid {uid}"
    elif os.geteuid() == 0:
        _drop_capabilities()
        report["uid"] = "shared (unprivileged: one uid mapped), every capability dropped"
    else:
        report["uid"] = f"shared uid {os.geteuid()}"
    prctl(_PR_SET_DUMPABLE, 0)
    no_new_privs()
    report["no_new_privs"] = "set"
    return report


# ---- Landlock -------------------------------------------------------------------------------------

_LL_READ = (1 << 0) | (1 << 2) | (1 << 3)  # execute, read_file, read_dir
_LL_ALL_V1 = (1 << 13) - 1
_LL_FILE = (1 << 0) | (1 << 1) | (1 << 2) | (1 << 14)  # rights that apply to a file


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is missing or disabled."""
    rc = _libc().syscall(444, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    return max(int(rc), 0)


def landlock(read: list[str], write: list[str]) -> str:
    """Confine the file system: read (and map) ``read``, read and write ``write``; nothing else."""
    libc = _libc()
    abi = landlock_abi()
    if abi < 1:
        raise _fail("landlock", ctypes.get_errno() or errno.ENOSYS, " (kernel 5.13+ with landlock)")
    handled = _LL_ALL_V1 | ((1 << 13) if abi >= 2 else 0) | ((1 << 14) if abi >= 3 else 0)
    attr = struct.pack("=Q", handled)
    fd = libc.syscall(444, attr, len(attr), 0)
    if fd < 0:
        raise _fail("landlock ruleset", ctypes.get_errno())
    try:
        for paths, access in ((read, _LL_READ), (write, handled)):
            for p in paths:
                pfd = os.open(p, os.O_PATH | os.O_CLOEXEC)
                try:
                    allowed = access if os.path.isdir(p) else access & _LL_FILE
                    rule = struct.pack("=Qi", allowed & handled, pfd)
                    _check(libc.syscall(445, fd, 1, rule, 0), f"landlock rule for {p}")
                finally:
                    os.close(pfd)
        _check(libc.syscall(446, fd, 0), "landlock restrict_self")
    finally:
        os.close(fd)
    return f"landlock ABI {abi}: read {', '.join(read)}; write {', '.join(write)}"


# ---- seccomp --------------------------------------------------------------------------------------

_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_JGE_K, _BPF_RET_K = 0x20, 0x15, 0x35, 0x06
_RET_KILL_PROCESS, _RET_ALLOW, _RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k & 0xFFFFFFFF)


def seccomp_program(pid: int) -> bytes:
    """The BPF filter: wrong architecture or x32 calls kill the process; DENIED returns EPERM;
    kill/tkill/tgkill/prlimit64 only on ``pid`` itself (or 0 for prlimit64); the rest allowed."""
    arch, table = _SYSCALLS[_ARCH]
    denied = sorted({table[n] for n in DENIED if n in table})
    prog = [_insn(_BPF_LD_W_ABS, 0, 0, 4), _insn(_BPF_JEQ_K, 1, 0, arch),
            _insn(_BPF_RET_K, 0, 0, _RET_KILL_PROCESS), _insn(_BPF_LD_W_ABS, 0, 0, 0)]  # fmt: skip
    if _ARCH == "x86_64":  # x32 ABI numbers
        prog += [_insn(_BPF_JGE_K, 0, 1, 0x40000000), _insn(_BPF_RET_K, 0, 0, _RET_KILL_PROCESS)]
    eperm = _RET_ERRNO | errno.EPERM
    for nr in denied:
        prog += [_insn(_BPF_JEQ_K, 0, 1, nr), _insn(_BPF_RET_K, 0, 0, eperm)]
    for name in _SELF_ONLY:
        # nr == name: load arg0's low and high words; allowed only for our pid (or 0: prlimit64)
        ok = [pid] + ([0] if name == "prlimit64" else [])
        body = [_insn(_BPF_LD_W_ABS, 0, 0, 20), _insn(_BPF_JEQ_K, 1, 0, 0),
                _insn(_BPF_RET_K, 0, 0, eperm), _insn(_BPF_LD_W_ABS, 0, 0, 16)]  # fmt: skip
        for i, v in enumerate(ok):
            body.append(_insn(_BPF_JEQ_K, len(ok) - i, 0, v))
        body += [_insn(_BPF_RET_K, 0, 0, eperm), _insn(_BPF_RET_K, 0, 0, _RET_ALLOW)]
        prog += [_insn(_BPF_JEQ_K, 0, len(body), table[name]), *body]
    for name, values in _ARG1_DENIED.items():
        body = [_insn(_BPF_LD_W_ABS, 0, 0, 24)]  # low word of the second argument
        body += [_insn(_BPF_JEQ_K, len(values) - i, 0, v) for i, v in enumerate(values)]
        body += [_insn(_BPF_RET_K, 0, 0, _RET_ALLOW), _insn(_BPF_RET_K, 0, 0, eperm)]
        prog += [_insn(_BPF_JEQ_K, 0, len(body), table[name]), *body]
    prog.append(_insn(_BPF_RET_K, 0, 0, _RET_ALLOW))
    return b"".join(prog)


def install_seccomp() -> str:
    """Load the filter for this process (no_new_privs must be set). Irreversible."""
    if _ARCH not in _SYSCALLS:
        raise JailError(errno.ENOSYS, f"sandbox: seccomp: no syscall table for {_ARCH}")
    prog = seccomp_program(os.getpid())
    n = len(prog) // 8
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = struct.pack("=HxxxxxxQ", n, ctypes.addressof(buf))
    pr_set_seccomp, seccomp_mode_filter = 22, 2
    rc = _libc().prctl(pr_set_seccomp, seccomp_mode_filter, ctypes.c_char_p(fprog), 0, 0)
    _check(rc, "seccomp")
    return (f"filter of {n} instructions: {len(DENIED)} calls denied, signals only to itself, "
            "no signal owners (F_SETOWN, SIOCSPGRP)")  # fmt: skip
