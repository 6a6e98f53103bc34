"""The caching allocator behind large CPU outputs of the collectives."""

from __future__ import annotations

import subprocess
import sys

import torch

import dpcore
from dpcore import comm
from conftest import TESTS_DIR, subprocess_env

MiB = 1024 * 1024


def test_large_outputs_reuse_freed_buffers() -> None:
    x = torch.randn(4 * MiB // 4)
    dpcore._C.host_cache_clear()
    first = dpcore._C.host_cache_stats()
    out = comm.broadcast(x, ["cpu"] * 3)
    assert all(torch.equal(o, x) for o in out)
    del out  # two 4 MiB copies go back to the cache
    assert dpcore._C.host_cache_stats()["cached_bytes"] >= 2 * 4 * MiB
    before = dpcore._C.host_cache_stats()
    out = comm.broadcast(x, ["cpu"] * 3)
    after = dpcore._C.host_cache_stats()
    assert after["hits"] - before["hits"] == 2
    assert after["misses"] == before["misses"]
    assert first["misses"] <= after["misses"]
    # Reused memory is fully overwritten: values equal the source, not stale data.
    x.add_(1)
    del out
    out = comm.broadcast(x, ["cpu"] * 3)
    assert all(torch.equal(o, x) for o in out)


def test_cached_outputs_keep_layout_and_are_independent() -> None:
    x = torch.randn(8, 16, 64, 64).contiguous(memory_format=torch.channels_last)
    a, b = comm.broadcast(x, ["cpu"] * 3)[1:]
    assert a.is_contiguous(memory_format=torch.channels_last)
    assert a.data_ptr() != b.data_ptr()
    a.zero_()
    assert torch.equal(b, x)
    g = comm.gather([x, x], dim=0, destination="cpu")
    assert g.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(g[:8], x) and torch.equal(g[8:], x)


def test_small_outputs_bypass_the_cache() -> None:
    dpcore._C.host_cache_clear()
    before = dpcore._C.host_cache_stats()
    comm.broadcast(torch.randn(100), ["cpu"] * 4)
    after = dpcore._C.host_cache_stats()
    assert after["hits"] == before["hits"] and after["misses"] == before["misses"]


def test_clear_releases_everything() -> None:
    out = comm.broadcast(torch.randn(2 * MiB), ["cpu"] * 2)
    del out
    assert dpcore._C.host_cache_stats()["cached_bytes"] > 0
    dpcore._C.host_cache_clear()
    assert dpcore._C.host_cache_stats()["cached_bytes"] == 0


def _run_with_cache_setting(value: str) -> subprocess.CompletedProcess[str]:
    """A child that sets DPCORE_HOST_CACHE_MB, broadcasts 4 MiB on the CPU
    three times over and prints the cache's counters."""
    code = (
        "import torch, dpcore\n"
        "x = torch.ones(1024 * 1024)\n"
        "for _ in range(2):\n"
        "    out = dpcore.comm.broadcast(x, ['cpu'] * 3)\n"
        "    assert all(torch.equal(o, x) for o in out)\n"
        "    del out\n"
        "print(dpcore._C.host_cache_stats())\n"
    )
    env = subprocess_env()
    env["DPCORE_HOST_CACHE_MB"] = value
    return subprocess.run(
        [sys.executable, "-c", code], cwd=TESTS_DIR, env=env, capture_output=True, text=True, timeout=120
    )


def test_cache_cap_zero_keeps_nothing() -> None:
    completed = _run_with_cache_setting("0")
    assert completed.returncode == 0, completed.stderr
    stats = eval(completed.stdout.strip().splitlines()[-1])  # a dict of ints
    assert stats["cached_bytes"] == 0 and stats["hits"] == 0 and stats["misses"] >= 4


def test_cache_cap_must_be_a_whole_number() -> None:
    completed = _run_with_cache_setting("lots")
    assert completed.returncode != 0
    assert (
        "expected the environment variable DPCORE_HOST_CACHE_MB to be an integer of at least 0, "
        "but it is 'lots'" in completed.stderr
    )
