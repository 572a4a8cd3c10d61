"""shared/distributed.py::DistInfo collectives: a single process makes none (see the comment in DistInfo)."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shared.distributed import DistInfo

ROOT = Path(__file__).resolve().parents[1]


def test_single_process_collectives_do_not_call_torch_distributed(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("torch.distributed was called in a single process")

    for name in ("all_reduce", "all_gather_object", "broadcast_object_list", "barrier"):
        monkeypatch.setattr(dist, name, boom)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), zero_stage=0, ds_base_config={})
    t = torch.tensor([1.0, 2.0])
    assert info.all_reduce(t) is t and t.tolist() == [1.0, 2.0]
    assert info.all_reduce(t, "max").tolist() == [1.0, 2.0]
    assert info.gather_objects({"a": 1}) == [{"a": 1}]
    assert info.broadcast_object("run") == "run"
    info.barrier()


def test_multi_process_collectives_still_call_torch_distributed(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None: calls.append(("all_reduce", op)) or t.mul_(2))
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    info = DistInfo(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"), zero_stage=0, ds_base_config={})
    assert info.all_reduce(torch.tensor([1.0]), "max").tolist() == [2.0]
    assert calls == [("all_reduce", dist.ReduceOp.MAX)]


SCRIPT = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, {root!r})
    from shared.distributed import init_distributed
    import time
    def gloo_threads():
        return sum(open(f"/proc/self/task/{{t}}/comm").read().strip() == "pt_gloo_runloop"
                   for t in os.listdir("/proc/self/task"))
    def settled():  # threads a library starts in the background may appear late on a loaded machine
        last, t0 = gloo_threads(), time.time()
        while time.time() - t0 < 10:
            time.sleep(0.25)
            now = gloo_threads()
            if now == last:
                return now
            last = now
        return last
    info = init_distributed()
    torch.set_num_threads(2)
    before = settled()
    info.gather_objects({{i: (float(i), float(i)) for i in range(4000)}})  # dpo.py's reference log-prob cache
    info.all_reduce(torch.zeros(10**6))
    info.broadcast_object(list(range(10**5)))
    print(before, settled())
""")


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_single_process_collectives_start_no_openmp_pool_in_gloo_threads():
    """The regression behind it: a large all_gather_object made a gloo thread run a parallel tensor copy, libgomp
    started a second pool there (its worker inherits the name pt_gloo_runloop) and throttled every worker."""
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(root=str(ROOT))], capture_output=True, text=True,
                         timeout=120, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = map(int, out.stdout.split()[-2:])
    assert after == before, f"gloo threads {before} -> {after}: a collective ran in a single process"


PORT_SCRIPT = textwrap.dedent("""
    import os, socket, sys
    sys.path.insert(0, {root!r})
    busy = socket.socket(); busy.bind(("127.0.0.1", 0)); busy.listen()
    os.environ["MASTER_PORT"] = str(busy.getsockname()[1])  # taken, as when another process grabs the free port
    from shared.distributed import init_distributed
    info = init_distributed()
    print(info.world_size, info.rank)
""")


def test_single_process_needs_no_free_port():
    """A single process rendezvouses in memory: a port taken by another process cannot fail the run
    (it did: EADDRINUSE in the test suite, between finding a free port and binding it)."""
    out = subprocess.run([sys.executable, "-c", PORT_SCRIPT.format(root=str(ROOT))], capture_output=True, text=True,
                         timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["1", "0"]


def test_max_over_ranks_in_one_process_calls_no_collective(monkeypatch):
    from shared.distributed import max_over_ranks

    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: (_ for _ in ()).throw(AssertionError("collective")))
    assert max_over_ranks(3) == 3
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # a one-process group, as every script makes
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 1)
    assert max_over_ranks(3) == 3


def _launch(monkeypatch, **env):
    from shared.distributed import launch_zero_stage

    for key in ("ACCELERATE_DEEPSPEED_CONFIG_FILE", "DEEPSPEED_CONFIG_FILE", "ACCELERATE_DEEPSPEED_ZERO_STAGE",
                "ACCELERATE_DEEPSPEED_ZERO3_INIT", "ACCELERATE_MIXED_PRECISION",
                "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return launch_zero_stage()


def test_accelerate_offload_options_become_deepspeed_settings(monkeypatch):
    """#22: an accelerate config's offload options were silently ignored; now they are DeepSpeed's ZeRO-Offload."""
    assert _launch(monkeypatch) == (0, {})
    assert _launch(monkeypatch, ACCELERATE_DEEPSPEED_ZERO_STAGE="3", ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE="none",
                   ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE="none", ACCELERATE_DEEPSPEED_ZERO3_INIT="false") == (3, {})
    stage, cfg = _launch(monkeypatch, ACCELERATE_DEEPSPEED_ZERO_STAGE="3",
                         ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE="cpu", ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE="cpu")
    assert stage == 3 and cfg == {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": True},
                                                        "offload_param": {"device": "cpu", "pin_memory": True}},
                                  "zero_force_ds_cpu_optimizer": False}


@pytest.mark.parametrize("env, message", [
    ({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "2", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu"}, "needs zero_stage 3"),
    ({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "0", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"}, "zero_stage 1, 2 or 3"),
    ({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "2", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "gpu"}, "not one of"),
    ({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true"}, "zero3_init_flag"),
    ({"ACCELERATE_MIXED_PRECISION": "fp16"}, "fp16"),
])
def test_accelerate_options_the_scripts_cannot_honour_are_one_line_errors(monkeypatch, env, message):
    with pytest.raises(ValueError, match=message):
        _launch(monkeypatch, **env)


def test_full_named_parameters_is_lazy_and_complete(tiny_model):
    """The weight sync streams: a generator of (name, tensor), every parameter once, in named_parameters order."""
    import types

    from shared.distributed import full_named_parameters

    model, _ = tiny_model
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), zero_stage=0, ds_base_config={})
    stream = full_named_parameters(model, info)
    assert isinstance(stream, types.GeneratorType)
    got = list(stream)
    assert [n for n, _ in got] == [n for n, _ in model.named_parameters()]
    assert all(torch.equal(t, p) for (_, t), (_, p) in zip(got, model.named_parameters()))


def test_one_process_without_zero_skips_deepspeeds_gradient_all_reduce_and_steps_like_plain_adamw(tiny_model,
                                                                                                  monkeypatch):
    """prepare() switches DeepSpeed's backward all-reduce off in one process at ZeRO-0 (it flattened, reduced over a
    group of one and copied back every gradient); the update is exactly plain AdamW's on the same gradients."""
    import copy

    from deepspeed.runtime.engine import DeepSpeedEngine

    from shared.distributed import init_distributed, prepare

    info = init_distributed()
    assert info.world_size == 1 and info.zero_stage == 0
    reduced = []
    monkeypatch.setattr(DeepSpeedEngine, "buffered_allreduce_fallback", lambda self, *a, **k: reduced.append(1))
    model, plain = copy.deepcopy(tiny_model[0]), copy.deepcopy(tiny_model[0])
    engine, *_ = prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), None, info, 1, 2, 0.0,
                         torch.float32)
    assert engine.enable_backward_allreduce is False
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    batches = [torch.tensor([[1, 10, 11, 12, 13]]), torch.tensor([[1, 12, 14, 10, 11]])]
    for _ in range(2):  # two optimizer steps of 2 micro-batches each
        for ids in batches:
            engine.backward(engine(input_ids=ids).logits.float().square().mean() / 2, scale_wrt_gas=False)
            engine.step()
            (plain(input_ids=ids).logits.float().square().mean() / 2).backward()
        opt.step()
        opt.zero_grad()
    assert not reduced
    assert all(torch.equal(a, b) for a, b in zip(engine.module.parameters(), plain.parameters()))
