"""`specgate serve` restarts itself once with glibc's huge-page tunable (specgate.cli.hugepages): decided before any
import of the model, never for an in-process caller, never twice, and off with SPECGATE_HUGEPAGES=0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import read_json_object

from specgate.cli import hugepages


def test_the_restart_sets_the_tunable_once_and_can_be_turned_off(monkeypatch):
    calls = []
    monkeypatch.setattr(hugepages.os, "execve", lambda exe, argv, env: calls.append((exe, argv, env)))
    monkeypatch.setattr(hugepages, "available", lambda: True)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    hugepages.reexec_with_huge_pages(["serve", "--port", "0"])
    (exe, argv, env), = calls
    assert exe == sys.executable and argv == [sys.executable, "-m", "specgate", "serve", "--port", "0"]
    assert env["GLIBC_TUNABLES"] == hugepages.TUNABLE
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")  # other tunables are kept beside it
    hugepages.reexec_with_huge_pages(["serve"])
    assert calls[-1][2]["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{hugepages.TUNABLE}"
    monkeypatch.setenv("GLIBC_TUNABLES", hugepages.TUNABLE)  # already restarted: not again
    hugepages.reexec_with_huge_pages(["serve"])
    assert len(calls) == 2


def test_specgate_hugepages_0_turns_it_off(monkeypatch):
    calls = []
    monkeypatch.setattr(hugepages.os, "execve", lambda *a: calls.append(a))
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setenv("SPECGATE_HUGEPAGES", "0")
    assert hugepages.available() is False
    hugepages.reexec_with_huge_pages(["serve"])
    assert calls == []


@pytest.mark.skipif(not hugepages.available(), reason="no transparent huge pages on request here (Linux, glibc >= 2.35, THP madvise)")
def test_a_served_model_sits_in_huge_pages(tiny_model_dir):
    target = tiny_model_dir("llama")
    argv = [sys.executable, "-m", "specgate", "serve", "--target", str(target), "--port", "0", "--draft", "none", "--policy", "off", "--json"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "url" in read_json_object(process)  # printed once the model is loaded
        environ = Path(f"/proc/{process.pid}/environ").read_bytes().split(b"\0")
        assert f"GLIBC_TUNABLES={hugepages.TUNABLE}".encode() in environ  # the same pid, restarted with the tunable
        rollup = Path(f"/proc/{process.pid}/smaps_rollup").read_text()
        huge_kib = int(next(line for line in rollup.splitlines() if line.startswith("AnonHugePages:")).split()[1])
        assert huge_kib >= 2048  # at least one 2 MiB page backs the process's anonymous memory
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
