"""`specgate serve` keeps its weights in transparent huge pages (2 MiB), by restarting itself once with glibc's
malloc told to ask for them (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`).

Why: with 4 KiB pages a process's weights land on whatever physical pages it gets, and one server process can run a
few percent slower than its twin for as long as it lives, which a gate comparing two servers reads as an effect of the
configuration (docs/BENCHMARKS.md, "Server processes"). In 2 MiB pages the layout is far less left to chance. It
applies where the kernel offers huge pages on request (transparent_hugepage `always` or `madvise`) and glibc reads the
tunable (2.35 and later); SPECGATE_HUGEPAGES=0 turns it off.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb=1"
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether huge pages can be asked for here: Linux, glibc >= 2.35, THP not `never`."""
    if sys.platform != "linux" or os.environ.get("SPECGATE_HUGEPAGES", "1") == "0":
        return False
    libc, version = platform.libc_ver()
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return libc == "glibc" and (major, minor) >= (2, 35) and "[never]" not in setting


def reexec_with_huge_pages(args: list[str]) -> None:
    """Replace this process by `python -m specgate ARGS` with the tunable set (once: a set tunable is left alone)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables or not available():
        return
    env = dict(os.environ, GLIBC_TUNABLES=f"{tunables}:{TUNABLE}" if tunables else TUNABLE)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "specgate", *args], env)
