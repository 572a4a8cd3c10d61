"""HF-compatible checkpoints (`save_pretrained` + tokenizer), written atomically.

The model is written to `<dir>.tmp` and renamed into place only when complete, so an interrupted save
never leaves a half-written checkpoint. Under ZeRO-3 the shards are gathered first (every rank takes
part); only the main process writes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from shared.distributed import DistInfo, full_named_parameters, unwrap


def save_hf(model, tokenizer, path: str | Path, info: DistInfo, extra_config: dict | None = None) -> Path:
    """Save `model` (plain module or DeepSpeed engine) so `from_pretrained` and vLLM can load it."""
    path = Path(path)
    params = dict(full_named_parameters(model, info))  # collective under ZeRO-3: all ranks call this
    if info.is_main:
        module = unwrap(model)
        state = {k: v.detach().cpu().contiguous() for k, v in params.items()}
        for name, buf in module.named_buffers():  # persistent buffers (rare in LMs) travel too
            if name in module.state_dict():
                state.setdefault(name, buf.detach().cpu())
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        if extra_config:
            for k, v in extra_config.items():
                setattr(module.config, k, v)
        module.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    info.barrier()
    return path
