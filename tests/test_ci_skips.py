"""tests/ci_skips.py: which skips CI must not accept, decided from (machine facts, skipped tests) on examples.

Each guarded case is checked on a machine that can run the test (the skip is hidden: reported) and, as negative
control, on one that cannot (the skip is legitimate: not reported); tests outside the guarded ones never count.
The conftest hooks are checked end to end in a pytest subprocess: under CI a hidden skip turns a passing session
into a failing one, and without CI it does not.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from ci_skips import CHROMIUM_TEST, MachineFacts, Skip, expected_to_run, hidden_skips, skip_summary, under_ci

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512bw"}
BUILDER = MachineFacts(x86_64=True, c_compiler=True, cpu_flags=AVX2, debian_with_apt=False)

PRODUCT = "tests/test_native_kernel.py::test_product_is_exact_up_to_float32_rounding"
NATIVE_SKIP = Skip(f"{PRODUCT}[avx2-1-dtype0]", "no C compiler or no AVX2/FMA on this CPU")
WIDE_SKIP = Skip(f"{PRODUCT}[avx512-1-dtype0]", "no AVX-512 on this CPU")
CHROMIUM_SKIP = Skip(CHROMIUM_TEST, "headless Chromium not installed")
OTHER_SKIP = Skip("tests/test_engines_llamacpp.py::test_server", "llama.cpp not installed")


def test_a_native_kernel_skip_is_hidden_only_where_the_kernel_builds():
    assert hidden_skips(BUILDER, [NATIVE_SKIP]) == [
        f"{NATIVE_SKIP.nodeid}: skipped (no C compiler or no AVX2/FMA on this CPU), but the native kernel builds here "
        "(x86-64, AVX2/FMA/F16C, a C compiler)"
    ]
    assert len(hidden_skips(BUILDER, [Skip("tests/test_native_kernel.py", "module skipped")])) == 1  # the whole module
    assert hidden_skips(BUILDER, [Skip("tests/test_native_kernel_extra.py::test_x", "other file")]) == []
    # negative controls: each missing fact makes the skip legitimate
    for facts in (MachineFacts(False, True, AVX2, False), MachineFacts(True, False, AVX2, False),
                  MachineFacts(True, True, frozenset({"avx", "sse4_2"}), False)):
        assert hidden_skips(facts, [NATIVE_SKIP]) == [], facts


def test_the_avx512_variant_may_skip_only_on_a_cpu_without_avx512():
    assert hidden_skips(BUILDER, [WIDE_SKIP]) == []  # AVX2 only: expected
    with_avx512 = MachineFacts(True, True, AVX512, False)
    assert len(hidden_skips(with_avx512, [WIDE_SKIP])) == 1 and "with AVX-512" in hidden_skips(with_avx512, [WIDE_SKIP])[0]
    assert expected_to_run(with_avx512, NATIVE_SKIP.nodeid) is not None  # the AVX2 variant too, of course
    # a test id that merely contains the letters elsewhere is not the variant
    assert expected_to_run(BUILDER, "tests/test_native_kernel.py::test_avx512_named[avx2]") is not None


def test_the_chromium_skip_is_hidden_only_on_debian_with_apt():
    debian = MachineFacts(x86_64=True, c_compiler=True, cpu_flags=AVX2, debian_with_apt=True)
    assert hidden_skips(debian, [CHROMIUM_SKIP]) == [
        f"{CHROMIUM_TEST}: skipped (headless Chromium not installed), but Debian with apt-get: `make test` installs "
        "chromium before the tests"
    ]
    assert hidden_skips(BUILDER, [CHROMIUM_SKIP]) == []  # negative control: no apt-get, nothing installs it
    arm_debian = MachineFacts(x86_64=False, c_compiler=True, cpu_flags=frozenset(), debian_with_apt=True)
    assert len(hidden_skips(arm_debian, [CHROMIUM_SKIP, NATIVE_SKIP])) == 1  # Chromium yes, the kernel no


def test_other_skips_never_count_and_the_summary_counts_reasons():
    everything = MachineFacts(True, True, AVX512, True)
    assert hidden_skips(everything, [OTHER_SKIP, Skip("tests/test_models.py::test_x", "no GPU")]) == []
    skips = [NATIVE_SKIP, WIDE_SKIP, WIDE_SKIP, OTHER_SKIP, WIDE_SKIP]
    assert skip_summary(skips) == [
        "   3  no AVX-512 on this CPU", "   1  llama.cpp not installed", "   1  no C compiler or no AVX2/FMA on this CPU",
    ]
    assert skip_summary([]) == []


def test_under_ci_reads_the_ci_variable():
    assert under_ci({"CI": "true"}) and under_ci({"CI": "1"}) and under_ci({"CI": "yes"})
    assert not under_ci({}) and not under_ci({"CI": ""}) and not under_ci({"CI": "false"}) and not under_ci({"CI": "0"})


def run_pytest(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    """A pytest session on a copy of this conftest whose only test is a skipped native-kernel test, on this host."""
    tests = tmp_path / "tests"
    tests.mkdir(exist_ok=True)
    here = Path(__file__).parent
    for name in ("conftest.py", "ci_skips.py"):
        (tests / name).write_text((here / name).read_text())
    (tests / "test_native_kernel.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.parametrize("wide", [pytest.param(False, id="avx2")])
        def test_product(wide):
            pytest.skip("pretend: no compiler")

        def test_passes():
            pass
    """))
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\ntestpaths = [\"tests\"]\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_hook_fails_a_ci_session_with_a_hidden_skip_and_only_then(tmp_path):
    from ci_skips import machine_facts

    can_build = expected_to_run(machine_facts(), "tests/test_native_kernel.py::test_product[avx2]") is not None
    local = run_pytest(tmp_path, None)
    assert local.returncode == 0, local.stdout + local.stderr  # no CI: the skip is listed, the session passes
    assert "skips by reason" in local.stdout and "   1  pretend: no compiler" in local.stdout
    ci = run_pytest(tmp_path, "true")
    if can_build:  # this host builds the kernel: the same skip fails a CI session
        assert ci.returncode == 1 and "skips CI cannot accept" in ci.stdout and "test_product[avx2]" in ci.stdout, ci.stdout
    else:  # negative control on a host that cannot build it: the skip is legitimate even under CI
        assert ci.returncode == 0 and "skips CI cannot accept" not in ci.stdout, ci.stdout
