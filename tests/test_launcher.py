"""Why the scripts take rank and world size from torch.distributed (docs/running.md, "Launching"): on CPU, under
`accelerate launch --num_processes 2`, the pinned accelerate's `Accelerator` reports one process on every rank while
torch.distributed runs two. If a new accelerate fixes that, this test fails and the page's reason is to be revised."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import torch.distributed as dist
from accelerate import Accelerator
a = Accelerator()
print(f"probe rank={dist.get_rank() if dist.is_initialized() else None} index={a.process_index} n={a.num_processes}",
      flush=True)
"""


def test_accelerator_reports_one_process_per_rank_on_cpu(tmp_path):
    import accelerate

    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    launcher = Path(sys.executable).with_name("accelerate")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(launcher), "launch", "--multi_gpu", "--num_processes", "2", str(probe)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("probe "))
    assert lines == ["probe rank=0 index=0 n=1", "probe rank=1 index=0 n=1"], (accelerate.__version__, lines)
