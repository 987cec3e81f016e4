"""A foreign process that knocks on a forming world: it reads the port name rank 0
published in the application's store and connects, then either says nothing
(`silent`) or asks to join as rank 1 with a wrong token (`wrong-token`).

    python foreign_joiner.py STORE_DIR silent|wrong-token
Prints what happened; exit 0 when it was refused (or, silent, after 60 s).
"""
import sys
import time

from launcher import keys
from launcher.store import FileStore

store, mode = FileStore(sys.argv[1]), sys.argv[2]
port = store.wait(keys.port(0), timeout=120).decode()
from mpi4py import MPI  # noqa: E402  (after the wait: MPI starts only when there is a port)

inter = MPI.COMM_SELF.Connect(port, MPI.INFO_NULL, root=0)
print("connected", flush=True)
if mode == "silent":
    time.sleep(60)
    sys.exit(0)
inter.send({"rank": 1, "token": "0" * 64}, dest=0, tag=11)
admitted = inter.recv(source=0, tag=12)
print("admitted" if admitted else "refused", flush=True)
sys.exit(1 if admitted else 0)
