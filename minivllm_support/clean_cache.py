"""`make clean-cache`: remove the compiled code we cache (our C++ kernels, inductor's
generated code), not the converted checkpoints, so the next run rebuilds from the sources."""
from __future__ import annotations

import shutil

from minivllm_support.models import cache_dir


def main() -> None:
    root = cache_dir()
    removed = [p for p in [root / "kernels", *sorted(root.glob("inductor-*"))] if p.is_dir()]
    for path in removed:
        shutil.rmtree(path)
    print(f"removed {', '.join(p.name for p in removed) or 'nothing'} under {root}")


if __name__ == "__main__":
    main()
