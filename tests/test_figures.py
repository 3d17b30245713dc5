"""`make figures` (minivllm_support/figures.py): it knows every script a lesson ships, parses
figures out of what they print, and writes both files from a run."""
import json
from pathlib import Path

from minivllm_support import figures

ROOT = Path(__file__).resolve().parent.parent


def scripts_in(commands, full: bool) -> set[str]:
    return {c.argv(full)[0] for c in commands}


def test_every_run_and_bench_script_is_registered():
    shipped = {str(p.relative_to(ROOT)) for pattern in ("step[0-9][0-9]_*/run.py", "advanced/adv[0-9][0-9]_*/run.py",
                                                          "step[0-9][0-9]_*/bench*.py", "advanced/adv[0-9][0-9]_*/bench*.py")
               for p in ROOT.glob(pattern) if "__main__" in p.read_text()}   # helpers a bench imports run under it
    for full in (False, True):
        missing = shipped - scripts_in(figures.COMMANDS, full)
        assert not missing, f"scripts make figures does not run ({'full' if full else 'short'} mode): {sorted(missing)}"
    for c in figures.COMMANDS:
        assert (ROOT / c.args[0]).is_file(), c.args[0]


def test_figure_lines_parse_numbers_and_units():
    out = ("machine: Some CPU [x86-64 AVX2], 2 cores, 2 torch threads, torch 2.13.0, 2026-12-05\n"
           "lesson 15:  266.5 s,   39.4 output tok/s\n"
           "speed-up: 1.08x (median of 2, spread 1.06-1.10x)\n"
           "no figure here: step 12, layer 3\n"
           "bandwidth 24.9 GB/s, 45% of peak\n")
    found = figures.figure_lines(out)
    assert [f["line"].split(":")[0] for f in found] == ["lesson 15", "speed-up", "bandwidth 24.9 GB/s, 45% of peak"]
    assert found[0]["values"] == [(266.5, "s"), (39.4, "tok/s")]
    assert (1.08, "x") in found[1]["values"] and (1.10, "x") in found[1]["values"]
    assert found[2]["values"] == [(24.9, "GB/s"), (45.0, "%")]


def test_a_run_writes_markdown_and_json_with_the_machine_line(tmp_path, monkeypatch):
    """Two tiny commands (a passing one and a failing one) through the real driver."""
    (tmp_path / "ok.py").write_text("print('machine: Test CPU, 2 cores, 2026-12-05')\nprint('done in 1.50 s, 2.0x faster')\n")
    (tmp_path / "bad.py").write_text("raise SystemExit('broken: 3 s')\n")
    monkeypatch.setattr(figures, "ROOT", tmp_path)
    monkeypatch.setattr(figures, "busy_warning", lambda: None)
    monkeypatch.setattr(figures, "COMMANDS", [figures.Command("ok", ("ok.py",), "a passing command"),
                                              figures.Command("bad", ("bad.py",), "a failing command")])
    rc = figures.main(["--out", str(tmp_path / "out")])
    assert rc == 1                                       # one command failed -> make figures fails
    md = (tmp_path / "out" / "FIGURES.md").read_text()
    data = json.loads((tmp_path / "out" / "figures.json").read_text())
    assert "machine: " in md and "`python ok.py`" in md and "FAILED (1)" in md and "done in 1.50 s" in md
    ok, bad = data["commands"]
    assert ok["returncode"] == 0 and ok["machine"] == "Test CPU, 2 cores, 2026-12-05"
    assert ok["figures"][0]["values"] == [[1.5, "s"], [2.0, "x"]]
    assert bad["returncode"] == 1 and "broken" in bad["output"]
    assert data["mode"] == "short" and data["machine"]


def test_smoke_mode_runs_the_same_scripts_and_refuses_full_beside_it(capsys):
    """SMOKE=1 (CI) shrinks workloads only: the same scripts as short mode, the same skips."""
    assert scripts_in(figures.COMMANDS, False) == {c.argv(False, smoke=True)[0] for c in figures.COMMANDS}
    shrunk = [c for c in figures.COMMANDS if c.smoke_args is not None]
    assert shrunk and all(c.smoke_args[0] == c.args[0] and c.smoke_args != c.args for c in shrunk)
    assert all(c.argv(True, smoke=False) == (c.full_args or c.args) for c in shrunk)
    try:
        figures.main(["--smoke", "--full", "--list"])
    except SystemExit as e:
        assert e.code == 2 and "two different modes" in capsys.readouterr().err
    else:
        raise AssertionError("--smoke --full was accepted")
