"""lowband.runtime.memory: ``--malloc cached`` keeps a training step's pages (no page faults per step),
``system`` leaves glibc alone, and a bad mode is one clear error."""
import subprocess
import sys

import pytest

from lowband.runtime import memory
from lowband.app.config import TrainConfig

# ten 1 MiB blocks touched and freed per iteration, as a training step's activations: under
# glibc's defaults the freed top of the heap may go back to the kernel and be faulted in again
# (2,500 faults per iteration in some processes, none in others: it depends on what else sits
# on the heap); under ``cached`` the heap keeps them once it has grown
_ITERATION_FAULTS = r"""
import sys, torch
from lowband.runtime import memory
settings = memory.configure(sys.argv[1])
def minflt():
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])
faults = []
for i in range(30):
    f0 = minflt()
    blocks = [torch.ones(256 * 1024) for _ in range(10)]
    del blocks
    faults.append(minflt() - f0)
print(settings is not None, max(faults[10:]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc: Linux")
def test_cached_reuses_freed_pages():
    out = subprocess.run([sys.executable, "-c", _ITERATION_FAULTS, "cached"], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    assert out[0] == "True"
    assert int(out[1]) < 10, f"{out[1]} page faults in one iteration after the tenth under --malloc cached"


def test_configure_sets_both_thresholds_mmap_first(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "_mallopt", lambda: lambda param, value: calls.append((param, value)) or 1)
    assert memory.configure("cached") == {"mmap_threshold": 32 * 2**20, "trim_threshold": 2**30}
    assert calls == [(memory.M_MMAP_THRESHOLD, 32 * 2**20), (memory.M_TRIM_THRESHOLD, 2**30)]
    calls.clear()
    assert memory.configure("system") is None and calls == []
    # glibc refusing the mmap threshold: the trim threshold alone would be worse, so neither
    monkeypatch.setattr(memory, "_mallopt", lambda: lambda param, value: calls.append(param) or 0)
    assert memory.configure("cached") is None and calls == [memory.M_MMAP_THRESHOLD]
    monkeypatch.setattr(memory, "_mallopt", lambda: None)
    assert memory.configure("cached") is None


def test_bad_mode_is_one_clear_error():
    with pytest.raises(ValueError, match=r"--malloc must be one of: cached, system, got 'jemalloc'"):
        memory.configure("jemalloc")
    with pytest.raises(ValueError, match="--malloc"):
        TrainConfig(model="mlp", algorithm="ssgd", malloc="big").validate()


def test_default_is_cached():
    assert TrainConfig().malloc == "cached"
