"""Every lesson's run.py (and the benchmark scripts) at least imports and parses its flags."""
import json
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


# One child process runs every script's --help in turn (runpy, as `python script --help` would):
# a process each paid torch's import ~50 times, a minute and a half of every `make test`.
HELP_ALL = """
import contextlib, io, json, runpy, sys
results = {}
for path in sys.argv[1:]:
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [path, "--help"]
    code = "no SystemExit"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code or 0
    except BaseException as e:
        code = f"{type(e).__name__}: {e}"
    results[path] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()[-2000:]}
print("HELP-RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def help_results():
    done = subprocess.run([sys.executable, "-c", HELP_ALL, *map(str, SCRIPTS)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    line = next((x for x in done.stdout.splitlines() if x.startswith("HELP-RESULTS ")), None)
    assert line is not None, done.stderr[-3000:]
    return json.loads(line.removeprefix("HELP-RESULTS "))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_script_help(script, help_results):
    got = help_results[str(script)]
    assert got["code"] == 0, got["stderr"] or got["code"]
    assert "usage" in got["stdout"]
