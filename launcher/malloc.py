"""glibc malloc settings for a rank's process: keep the memory a step frees for the next step.

torch allocates a CPU tensor's storage with malloc and frees it when the tensor dies, so a
training step allocates and frees the same large buffers (activations, their gradients)
every time. glibc's defaults adapt to that badly: its mmap threshold rises to the largest
block freed (up to 32 MiB) and its trim threshold to twice that, so a step that frees more
than that at the heap's top hands it back to the kernel, and the next step faults it in
again, page by page, zeroed. How often depends on the order of a step's allocations. The
seed network at `--quick` widths on one rank (`benchmarks/conv_mp.py`; 2-core Xeon VM):
6-10 thousand minor faults and 10-17 ms of system time a step under conv-MP, ~500 and
1-4 ms as the plain model, against almost none with these settings. A throttled rank pays
those faults out of its CPU quota.

So a rank's process gets (unless its environment sets either; glibc reads them at start):
    MALLOC_MMAP_THRESHOLD_  32 MiB: blocks below it come from the heap (the most glibc
                            allows; setting it also stops the adaptation)
    MALLOC_TRIM_THRESHOLD_  256 MiB of free heap top kept before any is handed back

What is kept is memory the process had already touched: its peak is unchanged, and a
container's memory limit is met or crossed at the peak. This is what PyTorch's own CPU
launcher gets by preloading jemalloc or tcmalloc (torch.backends.xeon.run_cpu), without a
library to install. Setting one of the two alone turns glibc's adaptation of the other off
(the trim threshold alone sends every block over 128 KiB to mmap), so a user's own value of
either leaves both to the user.
"""

MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 256 << 20
KEYS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def environment(env):
    """`env` (a dict, not changed) with the settings, unless it sets either of them."""
    if any(key in env for key in KEYS):
        return dict(env)
    return {**env, KEYS[0]: str(MMAP_THRESHOLD), KEYS[1]: str(TRIM_THRESHOLD)}
