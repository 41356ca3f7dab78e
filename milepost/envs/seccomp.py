"""The sandbox's seccomp filter: a classic-BPF program, in the form bubblewrap's `--seccomp FD`
reads (an array of `struct sock_filter`).

A deny-list: the system calls a terminal task never needs and that are the usual routes out of
a container or into the kernel (mounts, namespaces, ptrace, kernel modules and keyrings, bpf,
perf, io_uring, handles by inode, clocks, reboot) answer EPERM; everything else is allowed.
x86-64 only (syscall numbers are per architecture); the x32 ABI and any other architecture are
killed outright, so a call cannot slip past the list under another numbering.
"""

from __future__ import annotations

import errno
import platform
import struct

# x86-64 numbers, from the kernel's asm/unistd_64.h (checked against this machine's header).
DENIED_X86_64: dict[str, int] = {
    "ptrace": 101, "syslog": 103, "uselib": 134, "vhangup": 153, "pivot_root": 155,
    "adjtimex": 159, "chroot": 161, "acct": 163, "settimeofday": 164, "mount": 165,
    "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169, "sethostname": 170,
    "setdomainname": 171, "iopl": 172, "ioperm": 173, "init_module": 175,
    "delete_module": 176, "quotactl": 179, "lookup_dcookie": 212, "clock_settime": 227,
    "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272,
    "perf_event_open": 298, "name_to_handle_at": 303, "open_by_handle_at": 304,
    "clock_adjtime": 305, "setns": 308, "process_vm_readv": 310, "process_vm_writev": 311,
    "finit_module": 313, "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428,
    "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442,
}

_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_SYSCALL_BIT = 0x40000000
# Classic BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h).
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_RET_K = 0x06
_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_RET_ALLOW = 0x7FFF0000
_OFFSET_NR, _OFFSET_ARCH = 0, 4  # in struct seccomp_data


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def supported() -> bool:
    """Whether this machine's architecture has a filter here."""
    return platform.machine() in ("x86_64", "AMD64")


def deny_list_program(denied: dict[str, int] = DENIED_X86_64, err: int = errno.EPERM) -> bytes:
    """The filter program: wrong architecture or x32 -> kill; a denied call -> errno; else allow."""
    prog = [
        _insn(_LD_W_ABS, 0, 0, _OFFSET_ARCH),
        _insn(_JEQ_K, 1, 0, _AUDIT_ARCH_X86_64),
        _insn(_RET_K, 0, 0, _RET_KILL_PROCESS),
        _insn(_LD_W_ABS, 0, 0, _OFFSET_NR),
        _insn(_JGE_K, 0, 1, _X32_SYSCALL_BIT),
        _insn(_RET_K, 0, 0, _RET_KILL_PROCESS),
    ]
    for nr in sorted(set(denied.values())):
        prog += [_insn(_JEQ_K, 0, 1, nr), _insn(_RET_K, 0, 0, _RET_ERRNO | (err & 0xFFFF))]
    prog.append(_insn(_RET_K, 0, 0, _RET_ALLOW))
    return b"".join(prog)
