"""Every lesson's run.py (and the benchmark scripts) at least imports and parses its flags."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = (sorted(ROOT.glob("step[0-9][0-9]_*/run.py")) + sorted(ROOT.glob("step[0-9][0-9]_*/*/run.py")) + sorted(ROOT.glob("advanced/adv[0-9][0-9]_*/run.py"))
           + sorted(ROOT.glob("step[0-9][0-9]_*/bench.py")) + sorted(ROOT.glob("step[0-9][0-9]_*/*/bench.py"))
           + [ROOT / "step18_benchmark" / n for n in ("microbench.py", "profile_decode.py", "vllm_bench.py")]
           + [ROOT / "step20_http_serve" / "soak.py", ROOT / "step19_real_model" / "demo.py"]
           + sorted(ROOT.glob("step[0-9][0-9]_*/node.py")) + sorted(ROOT.glob("advanced/adv[0-9][0-9]_*/node.py")))


def test_one_bench_script_per_lesson_and_no_run_imports_one():
    """Issue 26: a lesson has at most one bench script (lesson 18 holds the rest), and no
    run.py imports a bench. Not benches: a package's __main__.py, lesson 20's soak.py, lesson 17's
    node.py (the headless launcher of a multi-machine run)."""
    for folder in ROOT.glob("step[0-9][0-9]_*"):
        if folder.name.startswith("step18_"):
            continue
        scripts = [p.name for p in folder.glob("*.py") if "__main__" in p.read_text()
                   and p.name not in ("run.py", "__main__.py", "soak.py", "node.py")]
        assert len(scripts) <= 1, f"{folder.name}: {scripts}"
    for run in ROOT.glob("step[0-9][0-9]_*/run.py"):
        if run.parent.name.startswith("step18_"):      # the benchmark lesson: its run.py is a benchmark
            continue
        assert ".bench import" not in run.read_text(), run


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_script_help(script):
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage" in done.stdout
