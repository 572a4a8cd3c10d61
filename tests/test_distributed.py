"""shared/distributed.py::DistInfo collectives: a single process makes none (see the comment in DistInfo); and
end_process_group: run_cli ends torch.distributed (vLLM's groups first) after a finished or checkpoint-stopped run."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import assert_clean_exit
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
    from shared.launch import launch_zero_stage

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


# --- end_process_group: run_cli ends torch.distributed before interpreter exit ---------------------------------------
RUN_CLI_SCRIPT = textwrap.dedent("""
    import atexit, json, os, signal, sys, types
    sys.path.insert(0, {root!r})
    from dataclasses import dataclass
    import torch, torch.distributed as dist
    from torch.distributed.distributed_c10d import _world
    from shared.cli import run_cli
    from shared.distributed import end_process_group, init_distributed

    def left():  # what is left of torch's process groups
        return {{"initialized": dist.is_initialized(), "groups": len(_world.pg_map)}}

    # at interpreter exit, after run_cli has returned or raised SystemExit
    atexit.register(lambda: print("left at exit:", json.dumps(left()), flush=True))

    calls = []
    if {stand_in!r}:
        # a stand-in for vLLM 0.32's teardown (vllm/distributed/parallel_state.py): its groups are subgroups of torch's
        # default group; destroy_distributed_environment also destroys the default group, unless told not to
        state = types.SimpleNamespace(group=None)

        def destroy_model_parallel():
            calls.append(["destroy_model_parallel", dist.is_initialized()])
            if {stand_in!r} == "fails":
                raise ValueError("teardown failed")
            if state.group is not None:  # "Invalid process group specified" once the default group is gone
                dist.destroy_process_group(state.group)
            state.group = None

        def destroy_distributed_environment():
            calls.append(["destroy_distributed_environment", dist.is_initialized()])
            if {stand_in!r} == "destroys the default group" and dist.is_initialized():
                dist.destroy_process_group()

        ps = types.ModuleType("vllm.distributed.parallel_state")
        ps.destroy_model_parallel = destroy_model_parallel
        ps.destroy_distributed_environment = destroy_distributed_environment
        for name in ("vllm", "vllm.distributed"):
            sys.modules[name] = types.ModuleType(name)
        sys.modules[ps.__name__] = ps

    @dataclass
    class Args:
        output_dir: str = ""
        stop: bool = False
        resume: str = "auto"
        save_every: int = 0
        keep_checkpoints: int = 1
        stop_after_steps: int = 0
        num_steps: int = 10

    def main(args):
        info = init_distributed()
        info.all_reduce(torch.ones(4))  # with 2 ranks, gloo's worker threads have run a collective
        if {stand_in!r}:
            state.group = dist.new_group(list(range(info.world_size)))  # as vLLM's engine makes its groups
        if args.stop:  # a checkpoint stop after SIGTERM, through the real Checkpointer: SystemExit(143)
            from shared.checkpoint import Checkpointer
            from shared.tracking import Tracker

            ckpt = Checkpointer(args, info)
            ckpt.restore({{}})
            os.kill(os.getpid(), signal.SIGTERM)  # only sets a flag
            assert ckpt.step_end(1) and ckpt.stopping
            return ckpt.stop(Tracker(args, args.output_dir, "r", enabled=False, total=1))
        print("finished", flush=True)

    run_cli(main, Args)
    after_run = left()
    n = len(calls)
    end_process_group()  # a second call: nothing to do
    print("result:", json.dumps({{"calls": calls, "after_run": after_run, "second_call_added": len(calls) - n}}),
          flush=True)
""")


def _run_cli(tmp_path, world_size: int, argv=(), stand_in: str = "") -> list[subprocess.CompletedProcess]:
    """run_cli in `world_size` processes (a gloo group: the CPU backend), each with its output."""
    import os
    import socket

    script = tmp_path / "entry.py"
    script.write_text(RUN_CLI_SCRIPT.format(root=str(ROOT), stand_in=stand_in))
    with socket.socket() as s:  # world size 1 rendezvouses in memory (init_distributed); 2 over this port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(script), "--output_dir", str(tmp_path / "run"), *argv],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1",
                                   "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for rank in range(world_size)]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=180)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


def _left_at_exit(proc: subprocess.CompletedProcess) -> dict:
    import json

    line = [x for x in proc.stdout.splitlines() if x.startswith("left at exit:")]
    assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(line[-1].split(":", 1)[1])


def _result(proc: subprocess.CompletedProcess) -> dict:
    """What the script printed after run_cli returned (a finished run): its calls, what run_cli left, the 2nd call."""
    import json

    line = [x for x in proc.stdout.splitlines() if x.startswith("result:")]
    assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(line[-1].split(":", 1)[1])


def _clean_exit(proc: subprocess.CompletedProcess) -> None:
    assert_clean_exit(proc.stdout + proc.stderr, " ".join(proc.args))
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_finished_run_ends_the_process_group_before_exit(tmp_path, world_size):
    """Left to interpreter exit, gloo's worker threads can abort a finished run ("terminate called without an active
    exception", SIGABRT); run_cli destroys the group once main returns, so none is left at exit."""
    for proc in _run_cli(tmp_path, world_size):
        assert proc.returncode == 0 and "finished" in proc.stdout, proc.stderr[-3000:]
        assert _result(proc)["after_run"] == {"initialized": False, "groups": 0}  # before the script's 2nd call
        assert _left_at_exit(proc) == {"initialized": False, "groups": 0}
        _clean_exit(proc)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_checkpoint_stop_after_sigterm_ends_the_process_group_and_keeps_status_143(tmp_path, world_size):
    for proc in _run_cli(tmp_path, world_size, ["--stop"]):
        assert proc.returncode == 143, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert "finished" not in proc.stdout
        assert _left_at_exit(proc) == {"initialized": False, "groups": 0}
        _clean_exit(proc)


@pytest.mark.parametrize("stand_in", ["destroys the default group", "leaves the default group"])
def test_vllms_teardown_runs_first_then_nothing_of_torchs_group_is_left(tmp_path, stand_in):
    """With vLLM loaded, its teardown runs before torch's default group is destroyed (destroyed first, vLLM's own
    exit-time clean-up fails on its dead subgroups: "Invalid process group specified"), in vLLM's order; the default
    group is gone afterwards whether vLLM's teardown destroyed it (vLLM 0.32 does) or not; a second call does
    nothing."""
    (proc,) = _run_cli(tmp_path, 1, stand_in=stand_in)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _clean_exit(proc)
    result = _result(proc)
    assert result["calls"] == [["destroy_model_parallel", True], ["destroy_distributed_environment", True]]
    assert result["after_run"] == {"initialized": False, "groups": 0}
    assert result["second_call_added"] == 0
    assert _left_at_exit(proc) == {"initialized": False, "groups": 0}


def test_a_failing_teardown_is_a_traceback_not_a_one_line_configuration_error(tmp_path):
    """run_cli reports a ValueError of `main` as one line `error: ...` (status 2); one raised by the teardown after
    main returned is no configuration error: a traceback, status 1."""
    (proc,) = _run_cli(tmp_path, 1, stand_in="fails")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" in proc.stderr and "ValueError: teardown failed" in proc.stderr
    assert "error: teardown failed" not in proc.stderr
