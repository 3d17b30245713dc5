"""Every lesson's run.py (and the benchmark scripts) at least imports and parses its flags."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = (sorted(ROOT.glob("step[0-9][0-9]_*/run.py")) + sorted(ROOT.glob("advanced/adv[0-9][0-9]_*/run.py"))
           + [ROOT / "step14_batched_forward" / n for n in ("bench.py", "profile_decode.py", "microbench.py")]
           + [ROOT / "step15_flash_attention" / "bench.py"]
           + [ROOT / "step16_cuda_graph" / n for n in ("bench.py", "vllm_bench.py")]
           + [ROOT / "step18_tensor_parallel" / "bench.py"])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_script_help(script):
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage" in done.stdout
