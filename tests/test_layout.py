"""The shape of the repository a learner walks: the main series is the twenty lessons of the design
under their names, and every import points down the series (a lesson uses what earlier lessons
taught; the support package uses no lesson)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TWENTY = ["step01_tokenizer", "step02_embedding", "step03_attention", "step04_transformer", "step05_naive",
          "step06_sampler", "step07_kv_cache", "step08_static_batching", "step09_continuous_batching",
          "step10_chunked_prefill", "step11_preemption", "step12_paged_attention", "step13_prefix_cache",
          "step14_batched_forward", "step15_flash_attention", "step16_cuda_graph", "step17_tensor_parallel",
          "step18_benchmark", "step19_real_model", "step20_http_serve"]


def test_the_main_series_is_the_twenty_lessons_of_the_design():
    folders = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and re.match(r"step\d", p.name))
    assert folders == TWENTY
    tests = {m.group(1) for p in (ROOT / "tests").glob("test_step*.py") if (m := re.match(r"test_step(\d\d)_", p.name))}
    assert tests <= {f"{n:02d}" for n in range(1, 21)}, sorted(tests)


def rank(module: str) -> tuple[int, int] | None:
    """Where a module sits in the series: (0, 0) the support package, (1, NN) lesson NN,
    (2, NN) advanced lesson NN; None for anything else (torch, tests, ...)."""
    if module == "minivllm_support" or module.startswith("minivllm_support."):
        return (0, 0)
    if m := re.match(r"step(\d\d)_", module):
        return (1, int(m.group(1)))
    if m := re.match(r"advanced\.adv(\d\d)_", module):
        return (2, int(m.group(1)))
    return None


def imports(path: Path) -> list[tuple[int, str]]:
    """Every absolute import in a file, at any depth (imports inside functions count too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_no_import_runs_up_the_series():
    owners = [ROOT / "minivllm_support", *sorted(ROOT.glob("step[0-9][0-9]_*")),
              *sorted((ROOT / "advanced").glob("adv[0-9][0-9]_*"))]
    upward, checked = [], 0
    for folder in owners:
        own = rank(folder.name if folder.parent == ROOT else f"advanced.{folder.name}")
        for path in sorted(folder.rglob("*.py")):
            checked += 1
            for line, module in imports(path):
                other = rank(module)
                if other is None:
                    continue
                if (own == (0, 0) and other != own) or other > own:
                    upward.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert checked > 200                   # the walk found the lessons
    assert not upward, "imports that run up the series:\n" + "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path):
    """The rule itself, on made-up files: a lesson importing a later one is caught, an earlier one is not."""
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from step18_benchmark.ladder import Workload\nimport step04_transformer.loader\n")
    found = {m for _, m in imports(f)}
    assert found == {"step18_benchmark.ladder", "step04_transformer.loader"}
    assert rank("step18_benchmark.ladder") > rank("step16_cuda_graph.cpu.ops") > rank("minivllm_support.cli")
    assert rank("advanced.adv01_quantization.engine") > rank("step20_http_serve.server")
