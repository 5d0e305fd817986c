"""specgate.models.native's build: real C sources shipped as package data, compiled with warnings on, a failed build
visible (a warning with the compiler's own output, or an error under SPECGATE_NATIVE_STRICT=1), and the ctypes
mirrors of the C structs checked against the compiled library's own sizeof / offsetof (with a negative control:
a wrong mirror must be refused)."""

from __future__ import annotations

import ctypes
import shutil
import tomllib
from pathlib import Path

import pytest

from specgate.models import native
from specgate.models.dtypes import cpu_flags

CAN_BUILD = (shutil.which("cc") or shutil.which("gcc")) is not None and {"avx2", "fma", "f16c"} <= cpu_flags()
needs_kernel = pytest.mark.skipif(not CAN_BUILD, reason="no C compiler or no AVX2/FMA/F16C on this CPU")
ROOT = Path(__file__).resolve().parents[1]


def test_sources_are_real_files_shipped_as_package_data():
    for name in (*native.SOURCES, *native.HEADERS):
        assert (native.CSRC / name).is_file(), name
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["specgate"]
    assert "models/csrc/*.c" in package_data and "models/csrc/*.h" in package_data
    assert {"-Wall", "-Wextra"} <= set(native.compile_flags(Path("/lib")))


@pytest.fixture
def broken_sources(tmp_path, monkeypatch):
    """A csrc/ whose kernels.c does not compile, and an empty build cache."""
    csrc = tmp_path / "csrc"
    shutil.copytree(native.CSRC, csrc)
    (csrc / "kernels.c").write_text((csrc / "kernels.c").read_text() + "\nint broken_on_purpose( { return 0; }\n")
    monkeypatch.setattr(native, "CSRC", csrc)
    monkeypatch.setenv("SPECGATE_CACHE", str(tmp_path / "cache"))
    return csrc


@needs_kernel
def test_a_failed_build_warns_with_the_compilers_output(broken_sources, monkeypatch):
    monkeypatch.delenv(native.STRICT_ENV, raising=False)
    with pytest.warns(RuntimeWarning, match=r"(?s)compiling specgate's C kernels failed.*broken_on_purpose.*SPECGATE_NATIVE_STRICT=1"):
        assert native._build() is None


@needs_kernel
def test_a_failed_build_raises_under_strict(broken_sources, monkeypatch):
    monkeypatch.setenv(native.STRICT_ENV, "1")
    with pytest.raises(native.NativeBuildError, match="broken_on_purpose"):
        native._build()


@needs_kernel
def test_the_sources_compile_without_warnings(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGATE_CACHE", str(tmp_path / "cache"))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a compiler warning would be raised here
        assert native._build() is not None


@needs_kernel
def test_ctypes_mirrors_match_the_c_structs():
    library = native._library()
    for mirror in (native._Weight, native._Layer, native._Config):
        native.check_layout(library, mirror)  # raises on a mismatch
        assert native.struct_layout(library, mirror.__name__.lstrip("_"))[0] == ctypes.sizeof(mirror)


@needs_kernel
def test_a_wrong_mirror_is_refused():
    """Negative control: the check must see a field of the wrong width and a missing field."""

    class _Config(ctypes.Structure):  # 'wide' missing
        _fields_ = [(name, ctypes.c_int64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate")] + [
            ("eps", ctypes.c_float), ("gemma", ctypes.c_int32), ("act", ctypes.c_int32)]

    class _Weight(ctypes.Structure):  # kind as int64 instead of int32
        _fields_ = [("data", ctypes.c_void_p * 4), ("rows", ctypes.c_int64 * 4), ("kind", ctypes.c_int64 * 4),
                    ("parts", ctypes.c_int32)]

    library = native._library()
    for wrong in (_Config, _Weight):
        with pytest.raises(native.NativeBuildError, match="does not match the C struct"):
            native.check_layout(library, wrong)
    with pytest.raises(native.NativeBuildError, match="does not describe a struct named"):
        native.struct_layout(library, "NoSuchStruct")
