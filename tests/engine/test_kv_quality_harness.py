"""bench/kv_quality.py end to end on tiny models: prefill-only -> real transfer -> import -> scoring.

The `none` row is the harness checking itself: teacher-forced scoring on an uncompressed import
must pick exactly the tokens the engine's own batched decode generated, with zero KL.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "kv_quality.py"


@pytest.mark.timeout(300)
def test_kv_quality_harness_runs_the_disaggregated_path(tiny_llama_dir, tiny_gemma3_dir, tmp_path):
    out = tmp_path / "quality.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--models", f"{tiny_llama_dir},{tiny_gemma3_dir}", "--limit", "4",
         "--tokens", "8", "--codecs", "none,int8+zstd,fp8", "--json", str(out)],
        capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    llama, gemma = results[str(tiny_llama_dir)], results[str(tiny_gemma3_dir)]
    for rows in (llama, gemma):
        assert set(rows) == {"none", "int8+zstd", "fp8"}
        assert rows["none"]["agree"] == 1.0
        assert rows["none"]["kl"] < 1e-6
        for row in rows.values():
            assert 0.0 <= row["agree"] <= 1.0 and row["kl"] >= -1e-6
    # Bytes come from the transfer itself: a full-attention model ships every token in fp32 ...
    assert llama["none"]["vs_fp32"] == pytest.approx(1.0, rel=0.01)
    assert llama["fp8"]["vs_fp32"] > 3.4
    # ... while Gemma 3's sliding layers ship only their window, so even `none` is smaller.
    assert gemma["none"]["vs_fp32"] > 1.2
    assert gemma["fp8"]["vs_fp32"] > gemma["none"]["vs_fp32"] * 3.4
