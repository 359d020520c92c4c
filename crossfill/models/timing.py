"""Measure model start times: `python -m crossfill.models.timing [--cold] NAME...`.

`--cold` pulls each model into the current `$CROSSFILL_HOME` (point it at an empty directory, and
set PIP_NO_CACHE_DIR=1 for a true first download). Without it, each model is started three times
in fresh processes from the cache, as an engine start would (resolve, config, weights,
tokenizer), and the median is printed next to the interpreter's import time.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

_START = r"""
import time; t0 = time.monotonic()
import torch; torch.set_num_threads(2)
from crossfill.models import eos_token_ids, load_config, load_state_dict, load_tokenizer, resolve_model
t1 = time.monotonic()
f = resolve_model({name!r}, pull=False)
load_config(f); load_state_dict(f); load_tokenizer(f); eos_token_ids(f)
print(t1 - t0, time.monotonic() - t1)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+")
    parser.add_argument("--cold", action="store_true", help="pull (download + dequantise) instead")
    args = parser.parse_args()
    for name in args.names:
        if args.cold:
            from crossfill.models import resolve_model

            start = time.monotonic()
            resolve_model(name, force=True)
            print(f"cold pull+dequantise {name}: {time.monotonic() - start:.1f}s", flush=True)
            continue
        imports, loads = [], []
        for _ in range(3):
            out = subprocess.run([sys.executable, "-c", _START.format(name=name)], capture_output=True,
                                 text=True, check=True).stdout.split()
            imports.append(float(out[0]))
            loads.append(float(out[1]))
        print(f"cached start {name}: {statistics.median(loads):.2f}s (median of 3; "
              f"+ {statistics.median(imports):.2f}s importing torch/transformers)", flush=True)


if __name__ == "__main__":
    main()
