"""A process busy DUTY (argv[1], 0..1) of every millisecond and asleep the rest, until killed
or until the process that started it (pid argv[2]) is gone: a rank beyond this machine's
cores, as busy as its vcores (training.planner.link)."""
import os
import sys
import time


def main():
    duty = float(sys.argv[1])
    parent = int(sys.argv[2]) if len(sys.argv) > 2 else os.getppid()
    while os.getppid() == parent:       # else reparented: the planner is gone (maybe before we started)
        t = time.perf_counter()
        while time.perf_counter() - t < duty * 1e-3:
            pass
        if duty < 1:
            time.sleep((1 - duty) * 1e-3)


if __name__ == "__main__":
    main()
