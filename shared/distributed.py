"""Process setup: ranks, seeding, model loading and the DeepSpeed engine (ZeRO 0/2/3).

Launch any script as `python algorithms/x.py` (one process), or with several processes through
`accelerate launch --config_file scripts/accelerate/zero2.yaml algorithms/x.py`, `deepspeed`, or `torchrun`.
Every launcher sets RANK / WORLD_SIZE / MASTER_ADDR; accelerate also exports the ZeRO stage of its config
(ACCELERATE_DEEPSPEED_ZERO_STAGE) and an optional DeepSpeed JSON (ACCELERATE_DEEPSPEED_CONFIG_FILE).

We read rank and world size from torch.distributed, not from `accelerate.Accelerator`: on CPU, under
`accelerate launch --num_processes 2`, Accelerator reports num_processes=1 on both ranks while
torch.distributed has ranks 0 and 1 (measured with accelerate 1.15 on a 2-core CPU machine). The
DeepSpeed config is built here from the script's batch sizes, so launch configs never hard-code them.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import random
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

from shared.launch import launch_zero_stage


def exact_div(a: int, b: int, what: str) -> int:
    """a / b, raising a one-line error naming the quantity when it does not divide exactly."""
    if b <= 0 or a % b != 0:
        raise ValueError(f"{what}: {a} is not divisible by {b}")
    return a // b


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    zero_stage: int
    ds_base_config: dict

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # One process: no collective at all. Besides saving the call, this keeps gloo's worker threads from running
    # tensor ops: the first time one does, OpenMP (libgomp) starts a second thread pool, counts more threads than
    # cores and, for the rest of the process, makes its workers sleep between parallel regions instead of spinning,
    # which made every CPU training step ~1.4x slower (measured: docs/changelog.md).
    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce of a tensor (sum / max / min); returns it. A CPU tensor also works when the
        backend is NCCL (it is reduced on this rank's GPU and copied back)."""
        if self.world_size == 1:
            return t
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        if t.device != self.device and dist.get_backend() == "nccl":
            on_device = t.to(self.device)
            dist.all_reduce(on_device, op=ops[op])
            t.copy_(on_device)
            return t
        dist.all_reduce(t, op=ops[op])
        return t

    def gather_objects(self, obj) -> list:
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def mean_over_ranks(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each metric averaged over the ranks (every rank logs the same keys)."""
        gathered = self.gather_objects(metrics)
        return {k: sum(g[k] for g in gathered) / len(gathered) for k in metrics}

    def broadcast_object(self, obj):
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> DistInfo:
    """Initialise torch.distributed (also for a single process, so one code path serves 1..N ranks)."""
    use_interpreters_tools()
    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        # DeepSpeed caches a clone of the default group; one left from a previous default group in this process (an
        # in-process vLLM engine tears its group down: tests) is no longer registered, and DeepSpeed would fail on it
        import sys

        if "deepspeed.utils.groups" in sys.modules:
            sys.modules["deepspeed.utils.groups"]._WORLD_GROUP = None
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        timeout = datetime.timedelta(minutes=30)
        if os.environ["WORLD_SIZE"] == "1":
            # one process: an in-process store, no TCP port (a free port found above can be taken by another
            # process before the store binds it: EADDRINUSE, seen in the test suite)
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.setdefault("LOCAL_RANK", str(rank))  # DeepSpeed reads it, also when another library made the group
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        # CPU ranks share the cores: OpenMP oversubscription (2 ranks x all cores) slows training many-fold
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        threads = int(os.environ.get("OMP_NUM_THREADS", 0)) or (os.cpu_count() or 1) // local_world
        torch.set_num_threads(max(1, threads))
    stage, base = launch_zero_stage()
    return DistInfo(rank, world, local_rank, device, stage, base)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPU, fp32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_causal_lm(path: str, dtype: torch.dtype, gradient_checkpointing: bool = False):
    """Load an HF causal LM from a hub name or local path with dropout disabled (RL needs deterministic
    log-probs; as `disable_dropout` in vwxyzjn/summarize_from_feedback_details and the VinePPO code)."""
    from transformers import AutoModelForCausalLM

    if not (Path(path).exists() or "/" in path):
        raise ValueError(f"model_name_or_path: {path!r} is neither a local directory nor a hub name (org/name)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    disable_dropout(model)
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model


def enable_gradient_checkpointing(model) -> None:
    """Recompute each layer's activations in the backward pass (`--gradient_checkpointing`). Without replaying torch's
    RNG state (there is no dropout to replay): restoring it in the backward pass would rewind the global generator
    that a vLLM engine generating in another thread samples from (grpo_async.py, ppo_async.py), changing its samples.
    The config is left alone: transformers turns the KV cache off itself in a checkpointed training forward, and a
    `use_cache: false` set here would be saved into every checkpoint (generation without a cache, for its users)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
                                                                       "preserve_rng_state": False})


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:  # e.g. Llama-3: pad with EOS; masks are built from lengths, never from pad ids
        tok.pad_token = tok.eos_token
    return tok


def disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(model.config, key) and isinstance(getattr(model.config, key), float):
            setattr(model.config, key, 0.0)


def deepspeed_config(info: DistInfo, micro_batch_size: int, grad_accum: int, max_grad_norm: float,
                     dtype: torch.dtype, train: bool = True) -> dict:
    """The DeepSpeed config for this run: the launch config's JSON (if any) with the batch fields filled in."""
    cfg = json.loads(json.dumps(info.ds_base_config))  # deep copy
    zero = cfg.setdefault("zero_optimization", {})
    zero["stage"] = info.zero_stage
    if info.zero_stage == 3:
        zero.setdefault("stage3_gather_16bit_weights_on_model_save", True)
    cfg["train_micro_batch_size_per_gpu"] = micro_batch_size
    cfg["gradient_accumulation_steps"] = grad_accum
    cfg["train_batch_size"] = micro_batch_size * grad_accum * info.world_size
    cfg["gradient_clipping"] = max_grad_norm if train else 0.0
    cfg["bf16"] = {"enabled": dtype == torch.bfloat16}
    cfg.pop("fp16", None)
    cfg.setdefault("steps_per_print", 10**9)
    cfg.setdefault("wall_clock_breakdown", False)
    return cfg


def use_interpreters_tools() -> None:
    """Put the running interpreter's bin/ (a virtual environment's: its `ninja`) first on PATH. DeepSpeed JIT-builds
    its CPU shared-memory op with the first `ninja` on PATH, and a build by another ninja (the system's, when the
    environment is not activated) rebuilds it: ~40 s at each switch between `.venv/bin/python script.py` and an
    activated environment (measured on 2 cores)."""
    import sys

    bin_dir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "").split(os.pathsep)
    if path[0] != bin_dir and os.path.exists(os.path.join(bin_dir, "ninja")):
        os.environ["PATH"] = os.pathsep.join([bin_dir] + [p for p in path if p != bin_dir])


def prepare(model: torch.nn.Module, optimizer, scheduler, info: DistInfo, micro_batch_size: int, grad_accum: int,
            max_grad_norm: float, dtype: torch.dtype):
    """Wrap a trainable model in a DeepSpeed engine (ZeRO stage from the launch config; 0 when none).

    Call `engine.backward(loss, scale_wrt_gas=False)` then `engine.step()` after every micro-batch:
    the algorithm files normalise their losses for the whole optimizer step themselves, and DeepSpeed
    steps the optimizer and scheduler only at the gradient-accumulation boundary.

    One process without ZeRO: DeepSpeed would still all-reduce the gradients after every optimizer step's last
    backward (flattening them into buckets, reducing over a group of one, dividing by 1, copying back: measured
    ~0.18 s of a 135M-parameter RM step on CPU, docs/performance.md). Nothing to reduce, so it is switched off; the
    gradients are those of the backward itself, exactly what the reduction would have left.
    """
    import deepspeed

    from shared.console import muted

    cfg = deepspeed_config(info, micro_batch_size, grad_accum, max_grad_norm, dtype)
    with muted():  # DeepSpeed prints its op builds (CPU: "deepspeed_shm_comm_op built successfully")
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=cfg, dist_init_required=False
        )
    if info.world_size == 1 and info.zero_stage == 0:
        engine.enable_backward_allreduce = False
    return engine, optimizer, scheduler


def prepare_frozen(model: torch.nn.Module, info: DistInfo, dtype: torch.dtype):
    """A frozen model (reference policy, reward model): partitioned under ZeRO-3, else replicated."""
    model.requires_grad_(False)
    model.eval()
    if info.zero_stage != 3:
        return model.to(info.device)
    import deepspeed

    from shared.console import muted

    cfg = deepspeed_config(info, 1, 1, 0.0, dtype, train=False)
    with muted():
        engine, *_ = deepspeed.initialize(model=model, config=cfg, dist_init_required=False)
    engine.eval()
    return engine


def load_reference(policy, model_path: str, dtype: torch.dtype, info: DistInfo, lora: bool):
    """The frozen reference policy of a KL term: with LoRA the policy with its adapters disabled (the frozen base,
    no second copy), else model_path loaded again and frozen."""
    if lora:
        from shared.lora import adapters_disabled

        return adapters_disabled(policy)
    return prepare_frozen(load_causal_lm(model_path, dtype), info, dtype)


def output_head(model):
    """The model's output layer as the scripts' lean log-probs call it, one chunk at a time inside activation
    checkpointing: the module itself, except for a frozen head whose weight ZeRO-3 partitions (LoRA under ZeRO-3):
    then a function that gathers the weight for each product (_GatheredLinear). Called as a module there, the head
    runs again when the backward pass recomputes a chunk, and DeepSpeed's hook releases its gathered weight after
    that forward, before the backward reads it (torch CheckpointError: a saved weight of shape [0]); a trainable head
    (full fine-tuning) does not hit this (tests/test_lean_logprobs.py covers both). Every rank must call the result
    equally often (each call gathers)."""
    head = model.get_output_embeddings()  # a LoRA reference policy gives a function (shared.lora.adapters_disabled)
    if isinstance(head, torch.nn.Linear) and all(hasattr(p, "ds_id") and not p.requires_grad
                                                  for p in head.parameters()):
        return lambda hidden: _GatheredLinear.apply(hidden, head.weight, head.bias)
    return head


class _GatheredLinear(torch.autograd.Function):
    """hidden @ W^T (+ b) for frozen, ZeRO-3-partitioned W and b: gathered for the product in forward and again for
    the input's gradient in backward, released in between; nothing of W is saved (no gradient of its own)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias):
        import deepspeed

        with deepspeed.zero.GatheredParameters([weight] if bias is None else [weight, bias], modifier_rank=None):
            out = torch.nn.functional.linear(hidden, weight, bias)
        ctx.weight = weight
        return out

    @staticmethod
    def backward(ctx, grad_out):
        import deepspeed

        with deepspeed.zero.GatheredParameters([ctx.weight], modifier_rank=None):
            grad_hidden = grad_out @ ctx.weight.to(grad_out.dtype)
        return grad_hidden, None, None


def max_over_ranks(n: int) -> int:
    """The largest of every rank's n: how many times every rank calls a module that ZeRO-3 partitions, since each
    call gathers the module's weights (a collective), as the chunked log-probs of the scripts do with the LM head.
    One process: n, with no collective (see DistInfo.barrier)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return n
    t = torch.tensor([n], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)


def full_named_parameters(model: torch.nn.Module, info: DistInfo) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, full tensor) for every parameter, one at a time; ZeRO-3 shards are gathered on every rank.

    Under ZeRO-3 each parameter is gathered, copied and released before the next, so a consumer that uses each tensor
    and drops it (the vLLM engine's weight sync, the rank check's hash, saving on rank 0) holds one extra parameter at
    a time, never a full copy of the model. Every rank must consume the whole iterator (each gather is a collective).
    A LoRA (peft) model gives its merged weights W + BA under the base model's names (shared/lora.py)."""
    from shared.lora import is_peft, merged_named_parameters

    module = unwrap(model)
    if is_peft(module):
        yield from merged_named_parameters(module, info.zero_stage == 3)
        return
    if info.zero_stage != 3:
        for name, p in module.named_parameters():
            yield name, p.detach()
        return
    import deepspeed

    for name, p in module.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
            full = p.detach().clone()
        yield name, full


def optimizer_step(engine) -> float | None:
    """`engine.step()` after a micro-batch; at an accumulation boundary returns the global grad norm (pre-clip).

    DeepSpeed records the norm for ZeRO-1/2/3; for stage 0 (gradients already all-reduced in backward)
    it is computed here. A step whose gradient is not finite is skipped (no weight, optimizer-state or LR
    change) and counted in `engine.skipped_steps`: DeepSpeed does this itself for ZeRO-1/2/3 and bf16; for
    stage 0 in fp32 (a plain torch optimizer) the optimizer's `step` is a no-op for that one step, and
    `optimizer.overflow` tells the engine not to step the LR scheduler (engine.py `_take_model_step`); the
    engine then clears the gradients as usual."""
    norm = None
    boundary = engine.is_gradient_accumulation_boundary()
    skip = False
    if boundary and engine.zero_optimization_stage() == 0:
        grads = [p.grad.detach().float().norm() for p in engine.module.parameters() if p.grad is not None]
        norm = torch.stack(grads).norm().item() if grads else 0.0
        if isinstance(engine.optimizer, torch.optim.Optimizer):  # not DeepSpeed's own bf16/fp16 wrappers
            skip = engine.optimizer.overflow = not math.isfinite(norm)
    if skip:
        optimizer = engine.optimizer
        saved = optimizer.__dict__.get("step")  # the LR scheduler's counting wrapper, if any
        optimizer.step = lambda *args, **kwargs: None
        try:
            engine.step()
        finally:
            if saved is None:
                del optimizer.step
            else:
                optimizer.step = saved
    else:
        engine.step()
    if boundary and norm is None:
        norm = engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else None
    return norm


class NonFiniteError(RuntimeError):
    pass


class NonFiniteGuard:
    """Skips optimizer steps with a non-finite loss or gradient, counts them, and aborts after a limit.

        guard.backward(engine, loss)   # a non-finite loss poisons the gradient, so its whole step is skipped
        norm = guard.step(engine)      # optimizer_step; a skipped step is counted (all ranks agree: the norm
                                       # is global), and more than `limit` of them abort the run
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.skipped = 0

    @staticmethod
    def backward(engine, loss: torch.Tensor) -> None:
        # x1 when finite (bit-identical gradients), xNaN otherwise: every gradient becomes NaN, so the global
        # norm is NaN on every rank and the step is skipped everywhere. No host sync.
        ok = torch.isfinite(loss.detach())
        engine.backward(loss * torch.where(ok, 1.0, float("nan")).to(loss.dtype), scale_wrt_gas=False)

    def step(self, engine) -> float | None:
        before = engine.skipped_steps
        norm = optimizer_step(engine)
        if engine.skipped_steps > before:
            self.skipped += 1
            if self.skipped > self.limit:
                raise NonFiniteError(
                    f"max_nonfinite_steps: {self.skipped} optimizer steps had a non-finite loss or gradient (limit "
                    f"{self.limit}); the run is diverging: lower the learning rate, check the rewards and data, or "
                    "resume from an earlier checkpoint (--resume output_dir/checkpoints/step_N)")
        return norm

    def state_dict(self) -> dict:
        return {"skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.skipped = state["skipped"]


def end_process_group() -> None:
    """End torch.distributed before interpreter exit (run_cli calls it when a run finishes or stops at a checkpoint;
    a second call does nothing). Left to interpreter exit, gloo's C++ worker threads can still be alive while the
    interpreter is torn down, and the process aborts after printing its results: "terminate called without an
    active exception", SIGABRT (pytorch/pytorch#190489)."""
    import sys

    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size() > 1:  # no rank closes its connections while another still waits on a collective
        nccl = dist.get_backend() == "nccl"  # NCCL's barrier runs on this rank's GPU (named: no warning)
        dist.barrier(device_ids=[torch.cuda.current_device()] if nccl else None)
    if "vllm" in sys.modules:
        # vLLM's groups (an in-process engine's) are subgroups of torch's default group: destroying the default
        # group alone leaves vLLM holding dead groups, and its own exit-time clean-up (EngineCore.shutdown ->
        # cleanup_dist_env_and_memory) then fails with "Invalid process group specified". Its teardown, in its own
        # order, destroys its groups, then torch's default group, and leaves that clean-up nothing to do.
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    if dist.is_initialized():
        dist.destroy_process_group()


def weights_fingerprint(model: torch.nn.Module, info: DistInfo) -> str:
    """SHA-256 of the full parameters (gathered under ZeRO-3); equal on every rank iff the replicas agree."""
    import hashlib

    h = hashlib.sha256()
    for name, p in full_named_parameters(model, info):
        h.update(name.encode())
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def check_ranks(model: torch.nn.Module, info: DistInfo, local_items: list[int]) -> dict:
    """End-of-run rank agreement check (cleanrl#476): identical weights on every rank, and disjoint data.

    `local_items` are the dataset indices this rank trained on in its last step. Raises on divergence."""
    fps = info.gather_objects(weights_fingerprint(model, info))
    items = info.gather_objects(sorted(local_items))
    if len(set(fps)) != 1:
        raise RuntimeError(f"ranks ended with different weights: {fps}")
    overlap = sum(len(set(a) & set(b)) for i, a in enumerate(items) for b in items[i + 1:])
    return {"check/ranks_identical_weights": 1.0, "check/ranks_shared_prompts": float(overlap),
            "check/world_size": float(info.world_size)}
