"""Weight broadcast from the trainer to a generation engine in another process, on its own GPU(s): the plumbing that
`--async_steps` needs where it pays, with vLLM beside the trainer rather than inside it (docs/grpo.md#asynchronous-
generation; the open-instruct / "Asynchronous RLHF" layout: trainer GPUs + engine GPUs, NCCL between them).

    # trainer rank 0 (rank 0 of this group) and each engine process (ranks 1..n) join one process group, outside
    # their own default groups (DeepSpeed's, vLLM's): NCCL between GPUs, gloo on CPU (tests/test_async.py)
    group = weight_group(host, port, rank, world_size)
    send_weights(group, full_named_parameters(policy, info))     # trainer rank 0, after each update
    generator.sync_weights(receive_weights(group))               # each engine process, between two generations

One parameter at a time: a header (name, dtype, shape) then the tensor, so neither side holds a second copy of the
model; under ZeRO-3 `full_named_parameters` gathers one parameter at a time (every trainer rank iterates it, only rank
0 sends). The receiving side is a lazy iterator of (name, tensor), the form vLLM's `load_weights` / `reload_weights`
and `VLLMGenerator.sync_weights` take: with an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0, as the scripts
run it) each tensor goes into the engine's weights as it arrives. An engine whose workers are other processes must
receive inside the worker (a vLLM `worker_extension_cls` method calling `model.load_weights(receive_weights(...))`).

What is wired: this broadcast, tested with gloo between two processes (exact weights, and a vLLM engine that then
generates like the sender's model). What is not: launching the engine on its own GPUs and driving it from grpo.py /
ppo.py, whose `--async_steps` runs a background thread on the colocated engine.
"""

from __future__ import annotations

import pickle
from typing import Iterable, Iterator

import torch


def weight_group(host: str, port: int, rank: int, world_size: int, backend: str | None = None):
    """A process group of `world_size` processes (rank 0: the sender) that leaves the global torch.distributed state
    alone, so trainer rank 0 can be in DeepSpeed's group and an engine in vLLM's (vLLM's stateless group). Backend:
    `nccl` when CUDA is available, else `gloo`."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    return stateless_init_torch_distributed_process_group(host, port, rank, world_size, backend)


def _device(device) -> torch.device:
    """Where the tensors travel: the current GPU for NCCL (the default when CUDA is available), the CPU for gloo."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _broadcast(group, tensor: torch.Tensor, src: int) -> None:
    """Broadcast with the group's own ranks (the stateless group is not registered with torch.distributed, whose
    `broadcast` maps global ranks)."""
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank, opts.rootTensor = src, 0
    group.broadcast([tensor], opts).wait()


def _broadcast_header(group, header: tuple | None, src: int, rank: int, device: torch.device):
    """(name, dtype, shape) or None (end of stream), pickled: its length, then its bytes."""
    data = pickle.dumps(header) if rank == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    _broadcast(group, size, src)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if rank == src
           else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
    _broadcast(group, buf, src)
    return header if rank == src else pickle.loads(buf.cpu().numpy().tobytes())


def send_weights(group, named_params: Iterable[tuple[str, torch.Tensor]], src: int = 0, device=None) -> int:
    """Sender (trainer rank 0): broadcast every (name, tensor), one at a time, then the end marker. Returns the
    number of tensors sent."""
    device, n = _device(device), 0
    for name, tensor in named_params:
        tensor = tensor.detach().to(device).contiguous()
        _broadcast_header(group, (name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)), src, src,
                          device)
        _broadcast(group, tensor, src)
        n += 1
    _broadcast_header(group, None, src, src, device)
    return n


def receive_weights(group, src: int = 0, device=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Receiver (an engine process): yields each (name, tensor) as it arrives, until the sender's end marker. Must be
    consumed to the end (the sender waits on every broadcast)."""
    device, rank = _device(device), group.rank()
    while True:
        header = _broadcast_header(group, None, src, rank, device)
        if header is None:
            return
        name, dtype, shape = header
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        _broadcast(group, tensor, src)
        yield name, tensor
