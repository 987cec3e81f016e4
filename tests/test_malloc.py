"""launcher.malloc: a rank's process keeps the memory its steps free, instead of faulting
it in again every step."""
import json
import os
import subprocess
import sys

from launcher import malloc

# A step's tensors as torch's CPU allocator makes them (c10's alloc_cpu: posix_memalign,
# 64-byte aligned): 12 blocks of 4 MiB, written, then all freed; the minor page faults of
# each step after the first two.
STEPS = """
import ctypes, json, resource
libc = ctypes.CDLL("libc.so.6")
libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def step():
    blocks = [ctypes.c_void_p() for _ in range(12)]
    for b in blocks:
        assert libc.posix_memalign(ctypes.byref(b), 64, 4 << 20) == 0
        libc.memset(b, 1, 4 << 20)
    for b in blocks:
        libc.free(b)
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults[2:]))
"""
PAGES = 12 * (4 << 20) // 4096


def _faults(env):
    out = subprocess.run([sys.executable, "-c", STEPS], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_rank_keeps_the_memory_its_last_step_freed_for_the_next():
    """glibc's defaults give a step's freed blocks back to the kernel, to be faulted in
    (zeroed) again in the next step: 10-17 ms of system time a step for the seed network
    on one rank (launcher.malloc). With the settings a rank gets, they are kept."""
    plain = {k: v for k, v in os.environ.items() if k not in malloc.KEYS}
    default = _faults(plain)
    ours = _faults(malloc.environment(plain))
    assert min(default) > PAGES // 2, default
    # Every step but one: the kernel may move a process's pages once in a while (compaction
    # migrates them; the next touch is a minor fault), as it did in one step of a suite run.
    assert sorted(ours)[-2] < PAGES // 50, ours


def test_a_users_own_setting_of_either_leaves_both_to_the_user():
    assert malloc.environment({"PATH": "/bin"}) == {"PATH": "/bin", "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
                                                    "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}
    mine = {"MALLOC_TRIM_THRESHOLD_": "0"}
    assert malloc.environment(mine) == mine and malloc.environment(mine) is not mine
