"""A job script that reports progress and runs until killed (for kill/leftover tests)."""
import time

from training.context import current

ctx = current()
for step in range(10_000):
    ctx.report(step=step)
    time.sleep(0.2)
