"""Skips that CI must not hide: which skipped tests should have run on this machine, and a count of skips by reason.

A skip is right where the machine lacks what the test needs, and a silent loss of coverage where it does not: a
native-kernel test skipped on an x86-64 CPU with AVX2/FMA and a C compiler, or the HTML report test skipped on a
Debian machine with apt-get (`make test` installs Chromium there first). conftest.py's hooks call these pure
functions; under CI (env CI set, as .ci/run sets it) a hidden skip fails the session, and every session ends with
the skip summary. tests/test_ci_skips.py checks the decisions on examples, with negative controls.
"""

from __future__ import annotations

import os
import platform
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

NATIVE_TESTS = "tests/test_native_kernel.py"
CHROMIUM_TEST = "tests/test_gate_e2e.py::test_html_report_renders_verdict_and_plots_in_headless_chromium"
AVX512_PARAM = "avx512"  # the id of the AVX-512 variant in test_native_kernel's parametrisation
AVX512_FLAGS = frozenset({"avx512f", "avx512bw"})  # what the kernel's AVX-512 variant needs (native.wide_vectors)
KERNEL_FLAGS = frozenset({"avx2", "fma", "f16c"})  # what the kernel needs at all (native._library)


@dataclass(frozen=True)
class MachineFacts:
    """What decides whether a guarded test can run here."""

    x86_64: bool
    c_compiler: bool
    cpu_flags: frozenset[str]
    debian_with_apt: bool  # /etc/os-release ID=debian and apt-get on PATH: `make test` can install Chromium


@dataclass(frozen=True)
class Skip:
    nodeid: str  # as pytest names it, e.g. "tests/test_native_kernel.py::test_x[avx512-1]"
    reason: str


def machine_facts() -> MachineFacts:
    """This machine's facts (the C compiler found as native._build finds it: $CC, cc, then gcc)."""
    from specgate.models.dtypes import cpu_flags

    try:
        os_release = Path("/etc/os-release").read_text()
    except OSError:
        os_release = ""
    debian = any(line.strip() in ("ID=debian", 'ID="debian"') for line in os_release.splitlines())
    return MachineFacts(
        x86_64=platform.machine().lower() in ("x86_64", "amd64"),
        c_compiler=bool(shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")),
        cpu_flags=frozenset(cpu_flags()),
        debian_with_apt=debian and shutil.which("apt-get") is not None,
    )


def under_ci(environ=os.environ) -> bool:
    """True when env CI is set to anything but an empty or false-like value."""
    return environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def expected_to_run(facts: MachineFacts, nodeid: str) -> str | None:
    """Why the test `nodeid` must run on a machine with these facts, or None where a skip is legitimate."""
    if nodeid.split("::")[0] == NATIVE_TESTS:  # one of its tests, or the module skipped as a whole
        if not (facts.x86_64 and facts.c_compiler and KERNEL_FLAGS <= facts.cpu_flags):
            return None
        params = nodeid.partition("[")[2].rstrip("]").split("-")
        if AVX512_PARAM in params and not AVX512_FLAGS <= facts.cpu_flags:
            return None  # the AVX-512 variant on a CPU without AVX-512
        wide = " with AVX-512" if AVX512_PARAM in params else ""
        return f"the native kernel builds here (x86-64, AVX2/FMA/F16C{wide}, a C compiler)"
    if nodeid == CHROMIUM_TEST and facts.debian_with_apt:
        return "Debian with apt-get: `make test` installs chromium before the tests"
    return None


def hidden_skips(facts: MachineFacts, skips: list[Skip]) -> list[str]:
    """One line per skipped test that should have run here: its id, its skip reason and why it should have run."""
    lines = []
    for skip in skips:
        why = expected_to_run(facts, skip.nodeid)
        if why is not None:
            lines.append(f"{skip.nodeid}: skipped ({skip.reason}), but {why}")
    return lines


def skip_summary(skips: list[Skip]) -> list[str]:
    """'count  reason' lines, most frequent reason first (ties by reason)."""
    counts = Counter(skip.reason for skip in skips)
    return [f"{count:4d}  {reason}" for reason, count in sorted(counts.items(), key=lambda item: (-item[1], item[0]))]


def skip_reason(report) -> str:
    """A skip report's reason, without pytest's 'Skipped: ' prefix."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")
