"""Communication every strategy uses, over mpi4py communicators whose buffers are torch tensors.

    waits    wait (polite on a throttled rank: set_polite; woken by the others where all are on
             one host: doorbells), as_buffer, mpi_datatype
    ring     allreduce_ and PreparedAllreduce: MPI_Allreduce for small tensors, a
             bandwidth-optimal ring for large ones, bit-identical from run to run
    shm      Arena and SharedAllreduce: ranks all on one host sum tensors placed in
             shared segments with loads and stores, the ring's order and bits
    buckets  GradientReducer: a model's gradients summed in buckets while backward runs
"""
from .buckets import OVERLAP_MODES, GradientReducer
from .ring import (ALGORITHMS, RING_CHUNK_BYTES, RING_THRESHOLD_BYTES, PreparedAllreduce,
                   allreduce_, choose_algorithm)
from .waits import (MAX_PAUSE_S, SPIN_S, as_buffer, close_doorbells, doorbells, in_mpi, is_polite, mpi_datatype,
                    ring, set_polite, wait, wait_until)

__all__ = ["OVERLAP_MODES", "GradientReducer", "ALGORITHMS", "RING_CHUNK_BYTES", "RING_THRESHOLD_BYTES",
           "PreparedAllreduce", "allreduce_", "choose_algorithm", "MAX_PAUSE_S", "SPIN_S", "as_buffer",
           "close_doorbells", "doorbells", "in_mpi", "is_polite", "mpi_datatype", "ring", "set_polite", "wait", "wait_until"]
