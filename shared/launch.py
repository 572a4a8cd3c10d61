"""What the launcher set up: the ZeRO stage and DeepSpeed settings of an `accelerate launch` (its environment), read
once by shared/distributed.py when a script starts and by shared/lora.py when it checks the LoRA flags.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def launch_zero_stage() -> tuple[int, dict]:
    """(ZeRO stage, DeepSpeed JSON) as the launcher set them (accelerate's environment; 0 and {} without one).

    Every option of an accelerate config is either honoured or refused with a one-line error, never ignored:
    `offload_optimizer_device` / `offload_param_device` (cpu or nvme) become DeepSpeed's ZeRO-Offload settings (the
    optimizer state, and under ZeRO-3 the parameters, live in CPU memory; the scripts' torch AdamW then steps on the
    CPU); `zero3_init_flag: true` (build the model already partitioned) and `mixed_precision: fp16` are refused, since
    every rank loads the full model before ZeRO-3 partitions it, and the scripts train in bf16 on GPU (fp32 on CPU)."""
    base: dict = {}
    cfg_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or os.environ.get("DEEPSPEED_CONFIG_FILE")
    if cfg_file and cfg_file.lower() != "none":
        base = json.loads(Path(cfg_file).read_text())
    stage = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", base.get("zero_optimization", {}).get("stage", 0)))
    env = os.environ.get
    if env("ACCELERATE_DEEPSPEED_ZERO3_INIT", "false") == "true":
        raise ValueError("accelerate config: zero3_init_flag: true is not supported (each rank loads the full model, "
                         "then ZeRO-3 partitions it); set it to false")
    if env("ACCELERATE_MIXED_PRECISION", "no") == "fp16":
        raise ValueError("accelerate config: mixed_precision: fp16 is not supported (the scripts train in bf16 on GPU "
                         "and fp32 on CPU); use 'no' or 'bf16'")
    for key, field in (("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "offload_optimizer"),
                       ("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "offload_param")):
        device = env(key, "none")
        if device in ("", "none"):
            continue
        if device not in ("cpu", "nvme"):
            raise ValueError(f"accelerate config: {field}_device: {device!r} is not one of none, cpu, nvme")
        if field == "offload_param" and stage != 3:
            raise ValueError(f"accelerate config: offload_param_device: {device} needs zero_stage 3 (got {stage})")
        if stage == 0:
            raise ValueError(f"accelerate config: {field}_device: {device} needs zero_stage 1, 2 or 3 (got 0)")
        base.setdefault("zero_optimization", {}).setdefault(field, {"device": device, "pin_memory": True})
        base.setdefault("zero_force_ds_cpu_optimizer", False)  # the scripts' own torch AdamW steps on the CPU
    return stage, base
