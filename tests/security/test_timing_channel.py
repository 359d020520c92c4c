"""The prefix-cache timing side channel: one tenant cannot learn what another tenant sent.

A prefix-cache hit answers faster, so a shared cache would let tenant B find out whether anyone sent
a given prompt (a document, an e-mail) by timing its own request for it. Caches are namespaced by
tenant, and with API keys on the tenant is the key's, so B cannot even claim A's namespace. Tenant A
sends a long prompt twice (the second is a hit), then B sends the same prompt: B's request must be a
miss everywhere. The assertions are on the cached-token counts each route report gives; the times
are printed next to each other for the reader, never asserted (a loaded machine makes them noise).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from serving.serving_cluster import Cluster, launch_cluster
from serving.serving_helpers import LONG

pytestmark = pytest.mark.timeout(600)

A_KEY = "tenant-a-key-0123456789abcdef"
B_KEY = "tenant-b-key-0123456789abcdef"


def _two_tenants(doc: dict) -> None:
    doc["security"]["auth"].update(enabled=True, dev_keys=[{"key": A_KEY, "tenant": "a"},
                                                           {"key": B_KEY, "tenant": "b"}])


@pytest.fixture(scope="module")
def keyed(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with launch_cluster(str(tiny_llama_dir), tmp_path_factory.mktemp("timing"), edit=_two_tenants) as c:
        yield c


def _send(c: Cluster, key: str, prompt: str, **extra: object) -> dict:
    client = openai.OpenAI(base_url=c.url + "/v1", api_key=key, max_retries=0, timeout=120)
    resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                     extra_body={"prefill_policy": "remote_required", **extra})
    return resp.model_extra["crossfill"]


def _cached(info: dict) -> int:
    return info["prefill_cached_tokens"] + info["decode_cached_tokens"]


@pytest.mark.parametrize("b_claims_a", [False, True], ids=["b-as-itself", "b-claims-a"])
def test_another_tenants_prompt_is_a_cache_miss(keyed: Cluster, b_claims_a: bool) -> None:
    prompt = f"Confidential memo {uuid.uuid4().hex}: " + LONG  # nobody has sent this before
    a_first = _send(keyed, A_KEY, prompt)
    a_second = _send(keyed, A_KEY, prompt)
    assert (a_first["tenant_id"], a_second["tenant_id"]) == ("a", "a")
    assert _cached(a_first) == 0
    assert _cached(a_second) > 0, a_second  # the cache works: this is what a timing attack would see
    if b_claims_a:
        # Claiming A's tenant in the body does not get B into A's namespace: it is refused outright.
        with pytest.raises(openai.PermissionDeniedError):
            _send(keyed, B_KEY, prompt, tenant_id="a")
    b = _send(keyed, B_KEY, prompt)
    assert b["tenant_id"] == "b"
    assert b["prefill_cached_tokens"] == 0 and b["decode_cached_tokens"] == 0, b
    ttft = {name: info["timings_ms"]["first_token"] for name, info in
            (("A first (miss)", a_first), ("A second (hit)", a_second), ("B (must miss)", b))}
    print("TTFT ms: " + ", ".join(f"{k} {v:.1f}" for k, v in ttft.items()))
