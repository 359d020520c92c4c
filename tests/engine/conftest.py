from __future__ import annotations

import pytest


@pytest.fixture(params=["llama", "gemma3"])
def tiny_dir(request, tiny_llama_dir, tiny_gemma3_dir):
    return tiny_llama_dir if request.param == "llama" else tiny_gemma3_dir
