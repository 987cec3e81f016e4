"""Master-driven execution of conv-layer model parallelism: only the master runs the
network; the other ranks serve their kernel shards on its commands."""
import numpy as np
import torch

from training import cputime
from training.collectives import wait

from .comm import Timings, _Clock, _mpi


class ShardProtocol:
    """The master runs the network; the other ranks serve their shards on command.

    Why only the master runs the layers between distributed convs (ReLU, pooling, the
    classifier), as in the paper: those layers then have one set of parameters, on one
    rank, updated once; the other ranks do no redundant work (on a slow rank, redundant
    work would stretch every step, which is what the speed-proportional split avoids);
    and the next conv's input, broadcast after pooling, is smaller than the pre-pooling
    feature map an all-gather would move. Exactness is kept because every rank's
    conv share runs on the very X the master computed.

    Protocol: before each distributed conv call the master broadcasts a command
    [FORWARD, layer, call, grad_mode]; the servers run that layer (`layer(None)`), which
    enters the same Bcast/Gatherv. In backward, right before a call's Scatterv, the master
    broadcasts [BACKWARD, layer, call] (a hook on the gathered output: it fires once that
    output's gradient is complete, immediately before the gather's backward) and the servers run
    backward on that call's stand-in output, entering the same Scatterv and, where X
    needs a gradient, the same Reduce. The master ends a step with [END, payload] (e.g.
    loss and correct count), which returns from `serve()` on every server. Commands
    carry the call index, so any order of layer calls (reuse, branches, eval without
    backward) stays matched. A layer linked to the next (DistributedConv2d.link_to) hands
    its output to that layer on every rank: its backward runs inside the next layer's,
    so the master announces none for it.
    """
    FORWARD, BACKWARD, END = 1.0, 2.0, 3.0
    _HEADER = 8

    def __init__(self, layers, comm, root=0):
        self.layers = list(layers)
        self.comm, self.root = comm, root
        self.timings = Timings()
        self._calls = 0
        self._current = {}       # layer index -> the call now running through it (master)
        self._handles = []
        if self.is_master:
            for index, layer in enumerate(self.layers):
                self._handles.append(layer.register_forward_pre_hook(self._before(index)))
                self._handles.append(layer.register_forward_hook(self._after(index)))

    @property
    def is_master(self):
        return self.comm.Get_rank() == self.root

    def detach(self):
        """Remove the master's hooks (the layers become plain SPMD layers again)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _send(self, header):
        with cputime.counting("protocol"), _Clock(self.timings, "comm_s"):
            wait(self.comm.Ibcast([header, _mpi().DOUBLE], root=self.root))

    def _before(self, index):
        def hook(module, args):
            call = self._current[index] = self._calls
            self._calls += 1
            self._send(np.array([self.FORWARD, index, call, float(torch.is_grad_enabled()), 0, 0, 0, 0]))
        return hook

    def _after(self, index):
        def hook(module, args, output):
            if output.requires_grad and module.feeds is None:   # a link's backward comes with the next layer's
                call = self._current[index]
                # The gradient of this output is ready: the layer's backward comes next, so the
                # servers are told which. (A hook on the tensor, not an identity Function: a
                # model's ReLU(inplace=True) on the output was refused, "Output 0 of
                # _AnnounceBackward is a view and is being modified inplace"; a hook fires for
                # the value it was registered on, whatever is done to it in place after.)
                output.register_hook(lambda grad: self._announce(index, call))
            return output
        return hook

    def _announce(self, index, call):
        with cputime.counting("protocol"):
            self._send(np.array([self.BACKWARD, index, call, 1, 0, 0, 0, 0]))

    def finish(self, payload=()):
        """Master: end the step; the servers' `serve()` returns `payload` (≤ 7 floats)."""
        with cputime.counting("protocol"):
            return self._finish(payload)

    def _finish(self, payload):
        if len(payload) > self._HEADER - 1:
            raise ValueError(f"ShardProtocol.finish: at most {self._HEADER - 1} payload values")
        header = np.zeros(self._HEADER)
        header[0] = self.END
        header[1:1 + len(payload)] = payload
        self._send(header)
        self._calls = 0
        return np.array(payload, dtype=np.float64)

    def serve(self):
        """Servers: run this rank's shares until the master's END; returns its payload."""
        MPI = _mpi()
        calls = {}
        header = np.zeros(self._HEADER)
        while True:
            with _Clock(self.timings, "comm_s"):
                wait(self.comm.Ibcast([header, MPI.DOUBLE], root=self.root))
            op, index, call = header[0], int(header[1]), int(header[2])
            if op == self.FORWARD:
                with torch.set_grad_enabled(bool(header[3])):
                    out = self.layers[index](None)
                if out.requires_grad and self.layers[index].feeds is None:
                    calls[call] = out
            elif op == self.BACKWARD:
                out = calls.pop(call)
                torch.autograd.backward(out, torch.zeros_like(out))
            elif op == self.END:
                return header[1:].copy()
            else:
                raise RuntimeError(f"ShardProtocol: unknown command {header.tolist()} from the master")
