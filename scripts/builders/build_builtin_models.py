"""Rebuild the built-in tiny models from scratch and compare them with the committed ones (shared/builtin_models/).

    python scripts/builders/build_builtin_models.py                      # all eight, in runs/builtin_models
    python scripts/builders/build_builtin_models.py --models tiny tiny-sft
    python scripts/builders/build_builtin_models.py --write              # replace the committed weights and their hashes

Each model is built by its recipe (shared/tiny.py RECIPES: sft.py, rm.py or grpo.py, seed 1) in a child process on
CPU with one thread (BUILD_ENV), from the model its recipe starts from (tiny -> tiny-sft -> tiny-rm -> tiny-cf-rm;
tiny-sft -> tiny-lc-sft, tiny-grpo, tiny-unit-rm; tiny -> tiny-tools-sft): the one built in this invocation, else the committed one. On the machine that built the committed
weights a rebuild is bit-identical; on another CPU only `tiny` is (training sums in another order there), so the
others come out as slightly different models of the same quality. `--write` copies the rebuilt models into
shared/builtin_models/ and their hashes into shared/tiny.py's EXPECTED_SHA256: every stored result that starts from
a replaced model must then be measured again.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from shared import tiny  # noqa: E402

ORDER = ("tiny", "tiny-sft", "tiny-rm", "tiny-cf-rm", "tiny-lc-sft", "tiny-tools-sft", "tiny-grpo", "tiny-unit-rm")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=ORDER, default=list(ORDER), help="models to rebuild")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "builtin_models", help="where the rebuilt models go")
    p.add_argument("--write", action="store_true", help="replace the committed weights and hashes with the rebuilt")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    built: dict[str, Path] = {}
    for name in (n for n in ORDER if n in a.models):
        out = a.out / name
        shutil.rmtree(out, ignore_errors=True)
        base = None
        if name != "tiny":
            parent = tiny.RECIPES[name][1]
            base = built.get(parent) or tiny.builtin_model(parent)
        print(f"[build] builtin:{name} from {base or 'random init'} -> {out}", flush=True)
        built[name] = tiny.build_model(name, out, base)
        sha = tiny.weights_sha256(built[name])
        expected = tiny.EXPECTED_SHA256.get(name)  # a new recipe has no committed hash yet
        verdict = ("no committed hash yet" if expected is None else "the committed weights" if sha == expected
                   else f"differs from the committed {expected[:12]}")
        print(f"[build] builtin:{name} {sha[:12]}: {verdict}", flush=True)
    if a.write:
        source = (ROOT / "shared" / "tiny.py").read_text()
        for name, path in built.items():
            shutil.rmtree(tiny.COMMITTED / name, ignore_errors=True)
            shutil.copytree(path, tiny.COMMITTED / name)
            sha = tiny.weights_sha256(path)
            if name not in tiny.EXPECTED_SHA256:  # a new entry goes at the start of the dict
                source = source.replace("EXPECTED_SHA256 = {\n", f'EXPECTED_SHA256 = {{\n    "{name}": "{sha}",\n', 1)
            source = re.sub(rf'("{re.escape(name)}": ")[0-9a-f]{{64}}(")', rf"\g<1>{sha}\g<2>", source)
        (ROOT / "shared" / "tiny.py").write_text(source)
        print(f"[build] wrote {', '.join(built)} to {tiny.COMMITTED} and their hashes to shared/tiny.py", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
