"""Mixed precision on GPU ranks (`training.precision`): fp32 (the default), bf16 or fp16.

bf16 and fp16 run the forward pass (and the loss) under torch.autocast on a GPU rank;
fp16 also scales the loss (torch.amp.GradScaler) so small gradients survive, unscales
before the optimizer and skips a step whose gradients overflowed. Parameters, gradients,
the gradient exchange and the optimizer stay fp32. Every rank skips or takes a step alike:
the gradients it checks are the all-reduced ones, equal everywhere. A CPU rank computes in
fp32 whatever the setting (it says so once); in an fp16 world with GPU ranks it scales
its loss too (`scaled`), since the all-reduce sums every rank's gradient: all must carry
the same scale (a power of two, exact in fp32), and all unscale, skip and grow alike.
"""
import contextlib
import logging

import torch

log = logging.getLogger(__name__)

MODES = ("fp32", "bf16", "fp16")


class Precision:
    def __init__(self, mode, device, scaled=False):
        mode = mode or "fp32"
        if mode not in MODES:
            raise ValueError(f"training.precision: expected one of {', '.join(MODES)}, got {mode!r}")
        self.device = torch.device(device)
        scaler = None
        if mode == "fp16" and (self.device.type == "cuda" or scaled):
            scaler = torch.amp.GradScaler(self.device.type)
        if mode != "fp32" and self.device.type != "cuda":
            log.info("training.precision %s applies to GPU ranks: this rank computes in fp32 on the CPU%s", mode,
                     " (its loss scaled as theirs are)" if scaler else "")
            mode = "fp32"
        self.mode = mode
        self.scaler = scaler

    def autocast(self):
        """The context the forward pass (and the loss) runs in."""
        if self.mode == "fp32":
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=torch.bfloat16 if self.mode == "bf16" else torch.float16)

    def backward(self, loss):
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, optimizer):
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self):
        return {"grad_scaler": self.scaler.state_dict()} if self.scaler else {}

    def load_state_dict(self, state):
        if self.scaler is not None and state.get("grad_scaler"):
            self.scaler.load_state_dict(state["grad_scaler"])
