"""A process busy DUTY (argv[1], 0..1) of every millisecond and asleep the rest, until killed:
a rank beyond this machine's cores, as busy as its vcores (training.planner.link)."""
import sys
import time


def main():
    duty = float(sys.argv[1])
    while True:
        t = time.perf_counter()
        while time.perf_counter() - t < duty * 1e-3:
            pass
        if duty < 1:
            time.sleep((1 - duty) * 1e-3)


if __name__ == "__main__":
    main()
