"""Where a rank computes, and moving tensors between it and the host memory MPI reads.

One rule for every strategy and for training.dist: a rank whose container has GPUs
(its CUDA_VISIBLE_DEVICES holds exactly its own, set by the engine) computes on cuda:0
when CUDA is available; any other rank on the CPU. Collectives always run on host
memory (the ring, the parameter servers, the conv protocol), so a GPU rank stages what
it sends through host buffers (pinned, so that copies can overlap compute) and copies
the result back; on a CPU rank staging is a no-op. Sums stay in the fixed order of the
host collectives, in fp32, whatever the mix of devices.
"""
import logging
import os

import torch

log = logging.getLogger(__name__)
_warned = []


def rank_device(rank_info):
    """torch.device for a rank described by training.context.RankInfo (gpus, vcores...).
    A container given GPUs where CUDA finds none computes on the CPU, and says so once
    (a broken driver or a CPU build of torch: it trained many times slower without a word)."""
    gpus = getattr(rank_info, "gpus", 0)
    if gpus and torch.cuda.is_available():
        return torch.device("cuda", 0)
    if gpus and not _warned:
        _warned.append(True)
        log.warning("this container holds %d GPU(s) (CUDA_VISIBLE_DEVICES=%s) but torch finds no CUDA device (%s): it "
                    "computes on the CPU", gpus, os.environ.get("CUDA_VISIBLE_DEVICES"),
                    "a build of torch without CUDA" if torch.version.cuda is None else
                    f"CUDA {torch.version.cuda}: no driver, or no device it can use")
    return torch.device("cpu")


def is_cuda(device):
    return torch.device(device).type == "cuda"


def synchronize(device):
    """Wait for the device's queued work (timing a GPU needs it; a no-op on the CPU)."""
    if is_cuda(device):
        torch.cuda.synchronize(device)


def host_buffer(like):
    """A host tensor shaped like `like`: pinned when `like` lives on a GPU."""
    return torch.empty(like.shape, dtype=like.dtype, pin_memory=is_cuda(like.device))


def bcast_(comm, tensor, root=0):
    """Broadcast `tensor` from `root` in place, whatever its device (MPI reads host memory)."""
    from training.collectives import as_buffer
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        comm.Bcast(as_buffer(tensor), root=root)
        return tensor
    host = tensor.detach().contiguous().cpu()
    comm.Bcast(as_buffer(host), root=root)
    with torch.no_grad():
        tensor.copy_(host)
    return tensor


def to_device(batch, device):
    """x or y of a batch on `device` (None stays None); asynchronous from pinned memory."""
    if batch is None or batch.device == torch.device(device):
        return batch
    return batch.to(device, non_blocking=True)
