"""Lesson 18: serving metrics on synthetic timestamps, Poisson arrivals, the OpenAI streaming
client against a local fake server, and a short ladder + online run on the tiny model."""
from __future__ import annotations

import asyncio
import json
import math
import statistics
import sys
from pathlib import Path

import psutil
import pytest
import torch
from aiohttp import web

from step06_sampler.params import SamplingParams
from step18_benchmark.loadgen import arrival_times
from step18_benchmark.metrics import SLO, RequestRecord, percentile_stats, summarize
from step18_benchmark.openai_client import completions_request


# ---- metrics ----------------------------------------------------------------------------------
def _rec(start, times, end=None, prompt=10, success=True):
    return RequestRecord(prompt_len=prompt, start=start, token_times=list(times), output_len=len(times),
                         end=times[-1] if end is None else end, success=success)


def test_metrics_follow_vllm_bench_serve_definitions():
    a = _rec(0.0, [0.1, 0.3, 0.6])             # ttft 100 ms, gaps 200 / 300, e2el 600, tpot (600-100)/2 = 250
    b = _rec(1.0, [1.5, 1.6])                  # ttft 500, gap 100, e2el 600, tpot 100
    c = _rec(2.0, [2.2])                       # one token: no TPOT, no ITL
    failed = _rec(0.0, [5.0], success=False)
    r = summarize([a, b, c, failed], duration_s=4.0, slo=SLO(ttft_ms=300, tpot_ms=200))
    assert (r.completed, r.failed) == (3, 1)
    assert r.total_output_tokens == 6 and r.total_input_tokens == 30
    assert r.request_throughput == pytest.approx(0.75) and r.output_throughput == pytest.approx(1.5)
    assert r.ttft.mean == pytest.approx((100 + 500 + 200) / 3) and r.ttft.median == pytest.approx(200)
    assert r.tpot.mean == pytest.approx(175) and r.tpot.median == pytest.approx(175)
    assert r.itl.mean == pytest.approx(200) and r.itl.median == pytest.approx(200)
    assert r.e2el.median == pytest.approx(600)
    # a: ttft ok, tpot 250 > 200 (fails); b: ttft 500 > 300 (fails); c: meets both -> 1 of 4 s
    assert r.goodput == pytest.approx(0.25)
    assert summarize([a], 1.0).goodput is None                  # no SLO, no goodput


def test_percentiles_interpolate_linearly_and_empty_is_zero():
    s = percentile_stats([0.001 * v for v in (10, 20, 30, 40, 50)])
    assert (s.median, s.p90, s.p99) == pytest.approx((30, 46, 49.6))
    assert percentile_stats([]).mean == 0


def test_poisson_arrivals():
    assert arrival_times(3, math.inf, 0) == [0.0, 0.0, 0.0]
    t = arrival_times(4000, 8.0, seed=1)
    assert t == arrival_times(4000, 8.0, seed=1) and t[0] == 0 and t == sorted(t)
    assert t[-1] / (len(t) - 1) == pytest.approx(1 / 8, rel=0.1)     # mean gap 1/rate
    with pytest.raises(ValueError, match="rate"):
        arrival_times(2, 0, 0)


# ---- the OpenAI client against a fake server ---------------------------------------------------
def _serve(handler):
    async def run(fn):
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            return await fn(f"http://127.0.0.1:{port}")
        finally:
            await runner.cleanup()
    return run


async def _stream(request, n=5, done=True, usage=True):
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(n):
        await asyncio.sleep(0.01)
        await resp.write(f"data: {json.dumps({'choices': [{'text': f't{i}'}]})}\n\n".encode())
    if usage:
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': n}})}\n\n".encode())
    if done:
        await resp.write(b"data: [DONE]\n\n")
    return resp


def _request(base):
    import aiohttp

    async def go():
        async with aiohttp.ClientSession() as s:
            return await completions_request(s, base, "m", [1, 2, 3], 5, prompt_len=3)
    return go()


def test_client_times_a_normal_stream():
    async def normal(request):
        return await _stream(request)
    rec = asyncio.run(_serve(normal)(_request))
    assert rec.success and rec.output_len == 5 and len(rec.token_times) == 5
    assert rec.ttft > 0 and rec.token_times == sorted(rec.token_times) and rec.end >= rec.token_times[-1]


def test_client_reports_failures_without_raising():
    async def bad(request):
        return web.json_response({"error": {"message": "bad prompt"}}, status=400)
    rec = asyncio.run(_serve(bad)(_request))
    assert not rec.success and "400" in rec.error and "bad prompt" in rec.error
    async def no_done(request):
        return await _stream(request, done=False)
    rec = asyncio.run(_serve(no_done)(_request))
    assert not rec.success and "DONE" in rec.error


# ---- a short ladder and online run, end to end --------------------------------------------------
def _record_saved_figures(monkeypatch) -> dict:
    """file name -> the matplotlib Figure the benchmark code saved there (the figure is kept
    to be read after the code closed it; the file is still written)."""
    from matplotlib.figure import Figure
    saved, save = {}, Figure.savefig

    def recording(fig, fname, *args, **kwargs):
        saved[Path(fname).name] = fig
        return save(fig, fname, *args, **kwargs)
    monkeypatch.setattr(Figure, "savefig", recording)
    return saved


def _png(path: Path, size_inches: tuple[float, float], dpi: int):
    """The image at `path`, which must be a PNG of the given size that decodes."""
    from step18_benchmark import plots
    assert path.is_file(), f"the benchmark did not write {path.name}"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    image = plots.plt.imread(path)
    width, height = size_inches
    assert image.shape[:2] == (round(height * dpi), round(width * dpi)), f"{path.name}: {image.shape}"
    return image


def test_short_ladder_and_online_run_write_json_and_plots(tiny_qwen3_dir, tmp_path, monkeypatch):
    """run.py's own pieces (ladder, online, _finish) on the tiny model: the PNGs they write
    decode and draw the measured numbers under the series' names, and results.json holds the
    run's records, from which its summaries can be recomputed."""
    from step04_transformer.loader import load_model
    from step16_cuda_graph.cpu.engine import build_engine
    from step18_benchmark import plots
    from step18_benchmark.frontend import AsyncEngine
    from step18_benchmark.ladder import EngineSetup, Workload
    from step18_benchmark.loadgen import engine_sender
    from step18_benchmark.run import _finish, ladder, online, print_table

    saved = _record_saved_figures(monkeypatch)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]
    work = Workload("tiny", prompts, [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 4)
    setup = EngineSetup(max_num_seqs=4, max_num_batched_tokens=64, kv_cache_bytes=2**22, block_size=4)
    results = ladder(tiny_qwen3_dir, torch.float32, work, setup, ["hf", "07", "08", "09", "13", "14", "16+"],
                     {"07": 2}, [2, 4], tp=2)
    assert [r.output_tokens for r in results] == [24, 12, 24, 24, 24, 24, 24]
    assert results[-1].name == "16+ CPU fast path"                 # lesson 16 part 2 is its own rung
    assert results[1].requests == 2 and results[1].of == 4
    print_table(results, "tiny")
    rows = [r.to_dict() for r in results]

    # the ladder PNG: the bars saved are the measured figures, in order, prefix runs hatched
    png_path = plots.ladder_plot(rows, "tiny", tmp_path / "ladder.png")
    _png(png_path, plots.LADDER_SIZE, plots.DPI)
    ax = saved["ladder.png"].axes[0]
    assert [b.get_height() for b in ax.patches] == [r["output_tps"] for r in rows], "bars are not the run's tok/s"
    assert [label.get_text() for label in ax.get_xticklabels()] == [r["name"] for r in rows]
    assert [bool(b.get_hatch()) for b in ax.patches] == [r["requests"] < r["of"] for r in rows]

    front = AsyncEngine(build_engine(load_model(tiny_qwen3_dir, torch.float32), setup.paged(), use_graph=False),
                        threaded=False)              # as run.py: the engine loop in this thread
    try:
        sweep_out = online(engine_sender(front), work, [math.inf, 50.0], SLO(), "tiny online")
    finally:
        front.shutdown()
    report = {"ladder_chat": rows, "online_name": "tiny engine", "online": sweep_out}
    _finish(report, tmp_path)                        # run.py's writer: results.json and the online plots

    written = json.loads((tmp_path / "results.json").read_text())
    assert written["ladder_chat"] == json.loads(json.dumps(rows, default=str))
    assert [o["rate"] for o in written["online"]] == [math.inf, 50.0]
    for o in written["online"]:
        recs = o["records"]
        assert o["result"]["completed"] == 4 and o["result"]["total_output_tokens"] == 24
        assert sorted(r["prompt_len"] for r in recs) == [5, 9, 17, 30]       # the run's own requests
        assert all(r["success"] and r["output_len"] == 6 == len(r["token_times"]) for r in recs)
        ttft_ms = [(r["token_times"][0] - r["start"]) * 1e3 for r in recs]
        e2el_ms = [(r["end"] - r["start"]) * 1e3 for r in recs]
        assert o["result"]["ttft"]["median"] == pytest.approx(statistics.median(ttft_ms))
        assert o["result"]["e2el"]["median"] == pytest.approx(statistics.median(e2el_ms))

    # the latency PNG: per metric, a median and a p99 line named after the engine, over the
    # rates in ascending order, with the values results.json holds
    _png(tmp_path / "latency_vs_rate.png", (14, 3.8), 110)
    fig = saved["latency_vs_rate.png"]
    by_rate = sorted(written["online"], key=lambda o: o["rate"])
    x_labels = ["50", "all at once"]
    for ax, metric in zip(fig.axes, ["ttft", "tpot", "e2el"]):
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert set(lines) == {"tiny engine median", "tiny engine p99"}, f"{metric} plot: series {sorted(lines)}"
        for stat in ("median", "p99"):
            line = lines[f"tiny engine {stat}"]
            assert list(line.get_xdata()) == x_labels, f"{metric} {stat}: x {list(line.get_xdata())}"
            assert list(line.get_ydata()) == pytest.approx([o["result"][metric][stat] for o in by_rate]), \
                f"the {metric} {stat} line is not the run's {metric} {stat}"
        assert {t.get_text() for t in ax.get_legend().get_texts()} == set(lines)
    [throughput] = fig.axes[3].get_lines()
    assert throughput.get_label() == "tiny engine"
    assert list(throughput.get_ydata()) == pytest.approx([o["result"]["output_throughput"] for o in by_rate])

    # the TTFT / ITL histograms of the first rate: every request's first token, every gap
    _png(tmp_path / "ttft_itl.png", (10, 3.6), 110)
    hist = saved["ttft_itl.png"]
    assert [t.get_text() for t in hist.texts] == ["rate inf req/s"]           # the suptitle names the rate
    ttft_bars, itl_bars = (sum(p.get_height() for p in ax.patches) for ax in hist.axes[:2])
    assert (ttft_bars, itl_bars) == (4, 4 * 5), "the histograms do not count the run's 4 TTFTs and 20 ITLs"


def test_vs_vllm_kills_what_a_run_leaves_behind(tmp_path):
    """vs_vllm.run: the engine's process runs in a session of its own, and anything it started
    that is still running when it ends (vLLM's engine core, its worker) is killed with it."""
    from step18_benchmark import vs_vllm
    from tests.processes import still_running
    pid_file = tmp_path / "grandchild.pid"
    script = ("import json, subprocess, sys; "
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print(json.dumps({{'ok': 1}}))")
    assert vs_vllm.run([sys.executable, "-c", script], "a test run") == {"ok": 1}
    grandchild = psutil.Process(int(pid_file.read_text()))
    assert still_running([grandchild], timeout_s=10) == []


def test_vs_vllm_says_when_its_venv_is_missing(monkeypatch, tmp_path, capsys):
    from step18_benchmark import vs_vllm
    monkeypatch.setattr(vs_vllm, "VLLM_PYTHON", tmp_path / "missing" / "python")
    monkeypatch.setattr(sys, "argv", ["vs_vllm.py", "--rounds", "1"])
    with pytest.raises(SystemExit, match="make compare-vllm"):
        vs_vllm.main()


def test_arithmetic_floor_counts_the_workload():
    """The floor's FLOPs follow from the shape and the workload alone; its rate is measured."""
    from minivllm_support.workloads import QWEN3_06B_SHAPE, workload
    from step18_benchmark import vs_vllm
    secs, out_tokens, how = vs_vllm.arithmetic_floor(4, 1)
    prompts, outs = workload(4, 1, QWEN3_06B_SHAPE["vocab_size"])
    assert out_tokens == sum(outs)
    if secs == 0:
        assert "no floor printed" in how
        return
    assert secs > 0 and f"{sum(map(len, prompts)) + sum(outs)} tokens through the linears" in how


def test_vs_vllm_runs_both_dtypes_where_the_cpu_has_no_bf16_arithmetic(monkeypatch):
    """Where the CPU does not multiply bf16 (AVX2, AVX-512 without BF16) vLLM's best dtype is
    not known beforehand: the comparison runs both."""
    from minivllm_support import cpu
    from step18_benchmark import vs_vllm
    monkeypatch.setattr(cpu, "bf16_native", lambda: False)
    assert vs_vllm.default_vllm_dtypes() == ["bfloat16", "float32"]
    monkeypatch.setattr(cpu, "bf16_native", lambda: True)
    assert vs_vllm.default_vllm_dtypes() == ["bfloat16"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch1_engine_names_its_dtype_and_counts_the_checkpoint_bytes(dtype, monkeypatch):
    """llamacpp_bench's side: the floor counts the checkpoint's bf16 bytes whatever dtype ours
    runs in (float32 panels keep bf16 values as bf16), and the description names the dtype."""
    from minivllm_support import workloads
    from minivllm_support.models import embedded_smollm2
    from step18_benchmark.llamacpp_bench import Ours
    monkeypatch.setattr(workloads, "read_bandwidth", lambda: 1e10)      # not timed here: a sum over 2 GiB
    ours = Ours.fast_path(embedded_smollm2(), dtype=dtype)
    assert ours.floor[0] == 2 * 134_515_008            # SmolLM2-135M's parameters, 2 bytes each
    assert f"fast path in {str(dtype).removeprefix('torch.')}" in ours.what
    out = ours.run(list(range(100, 140)), 4)
    assert len(out["tokens"]) == 5 and out["tok_s"] > 0
