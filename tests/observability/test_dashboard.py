"""The live dashboard at the gateway's /dashboard, on a real cluster, read by a real browser.

One cluster (the processes `crossfill up` starts) with API keys on: a tenant key sends the
traffic (short prompts prefilled locally, long ones remotely, one prompt past the context), an
admin key reads the dashboard. Debian's `chromium` (installed by `make setup` / `.ci/run`) loads
the page headless and dumps its DOM; the page writes how many points each chart holds into
`data-series-points`, and its tables carry the instances, the link and the requests as data
attributes. Virtual time (`--virtual-time-budget`) lets the page poll several times without the
test sleeping; the DOM is dumped again, a bounded number of times, until the data is there.

With CROSSFILL_UPDATE_SCREENSHOT=1 the screenshot taken while traffic flows replaces
docs/img/dashboard.png (the one in docs/OBSERVABILITY.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import uuid
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
from serving.serving_cluster import Cluster, launch_cluster
from serving.serving_helpers import SHORT, unique_long

pytestmark = pytest.mark.timeout(600)

USER = "dash-user-key-0123456789abcdef"
ADMIN = "dash-admin-key-0123456789abcdef"
MARK = f"Okapi-{uuid.uuid4().hex[:10]}"  # in every prompt: must never reach the dashboard's state
CHARTS = ("link_rtt", "link_bandwidth", "link_loss", "queue_depth", "kv_use", "ttft", "throughput", "kv_bytes")
WORKERS = ("here-prefill-0", "here-decode-0", "far-prefill-0")
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "img" / "dashboard.png"


def _keys(doc: dict) -> None:
    doc["security"]["auth"].update(enabled=True, dev_keys=[{"key": USER, "tenant": "dash"},
                                                           {"key": ADMIN, "tenant": "ops", "admin": True}])


@pytest.fixture(scope="module")
def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("Debian's chromium is not installed (`make setup` installs it when run as root: "
                    "apt-get install chromium)")
    return exe


@pytest.fixture(scope="module")
def keyed(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with launch_cluster(str(tiny_llama_dir), tmp_path_factory.mktemp("dashboard"), edit=_keys) as c:
        yield c


def _generate(c: Cluster, prompt: str, **extra: object) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
    return httpx.post(c.url + "/v1/generate", json=body, headers={"Authorization": f"Bearer {USER}"}, timeout=60)


def _state(c: Cluster, key: str | None) -> httpx.Response:
    return httpx.get(c.url + "/dashboard/api/state", headers={"Authorization": f"Bearer {key}"} if key else {},
                     timeout=30)


class _Elements(HTMLParser):
    """Every start tag of a page as (tag, attributes)."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.items: list[tuple[str, dict[str, str | None]]] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.items.append((tag, dict(attrs)))

    def having(self, attr: str) -> list[dict[str, str | None]]:
        return [a for _, a in self.items if attr in a]

    def body(self) -> dict[str, str | None]:
        return next(a for t, a in self.items if t == "body")


def _browse(exe: str, url: str, profile: Path, *extra: str, budget_ms: int = 12_000) -> str:
    """Load `url` headless for `budget_ms` of virtual time (about six polls); returns stdout (the dump)."""
    cmd = [exe, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars", "--no-first-run",
           f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}", *extra, url]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)  # a safety net against a hang
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _dump_until(exe: str, url: str, profile: Path, ready, attempts: int = 8) -> _Elements:
    """Dump the page's DOM until `ready(elements)` holds (a busy machine may need more than one load)."""
    page = _Elements("")
    for _ in range(attempts):
        page = _Elements(_browse(exe, url, profile, "--dump-dom"))
        if ready(page):
            return page
    return page  # the caller's assertions say what is missing


def test_state_takes_an_admin_key_and_holds_no_text(keyed: Cluster) -> None:
    c = keyed
    local = _generate(c, f"{MARK} {SHORT}")
    assert local.status_code == 200, local.text
    no_key, tenant_key, admin_key = _state(c, None), _state(c, USER), _state(c, ADMIN)
    assert (no_key.status_code, no_key.json()["error"]["code"]) == (401, "invalid_api_key")
    assert (tenant_key.status_code, tenant_key.json()["error"]["code"]) == (403, "permission_denied")
    assert admin_key.status_code == 200, admin_key.text
    state = admin_key.json()
    # The gateway passed the admin key on to the scheduler's admin API and got the cluster.
    assert state["cluster_error"] is None and set(WORKERS) <= set(state["cluster"]["instances"])
    assert "far" in state["cluster"]["links"]
    mine = [e for e in state["recent"] if e["request_id"] == local.json()["request_id"]]
    assert mine and mine[0]["route"] == "local" and mine[0]["completion_tokens"] > 0
    assert MARK not in admin_key.text  # route reports only: never the prompt (nor the output)
    # The page and its assets hold no data: no key needed, so the page can ask for one.
    page = httpx.get(c.url + "/dashboard", follow_redirects=True, timeout=30)
    assert page.status_code == 200 and "static/app.js" in page.text
    for asset in ("app.js", "style.css", "uPlot.iife.min.js", "uPlot.min.css"):
        assert httpx.get(c.url + f"/dashboard/static/{asset}", timeout=30).status_code == 200, asset


def test_page_without_a_key_asks_for_one(keyed: Cluster, chromium: str, tmp_path: Path) -> None:
    page = _Elements(_browse(chromium, keyed.url + "/dashboard", tmp_path / "profile", "--dump-dom", budget_ms=5000))
    assert page.body()["data-state"] == "auth"
    form = next(a for a in page.having("id") if a["id"] == "key-form")
    assert "hidden" not in form
    assert all(a["data-series-points"] == "0" for a in page.having("data-series-points"))


def test_page_charts_hold_the_cluster_and_its_requests(keyed: Cluster, chromium: str, tmp_path: Path) -> None:
    c = keyed
    local = _generate(c, f"{MARK} {SHORT}")
    remote = _generate(c, f"{MARK} {unique_long()}")
    too_long = _generate(c, f"{MARK} " + "word " * 5000)
    assert local.status_code == remote.status_code == 200, (local.text, remote.text)
    assert (local.json()["crossfill"]["route"], remote.json()["crossfill"]["route"]) == ("local", "remote")
    assert too_long.status_code == 400
    ids = {local.json()["request_id"]: "local", remote.json()["request_id"]: "remote"}

    def ready(p: _Elements) -> bool:
        points = {a["data-chart"]: int(a["data-series-points"] or 0) for a in p.having("data-series-points")}
        return p.body().get("data-state") == "ok" and all(points.get(name, 0) > 0 for name in CHARTS)

    url = c.url + f"/dashboard?key={ADMIN}"
    page = _dump_until(chromium, url, tmp_path / "profile", ready)
    assert page.body()["data-state"] == "ok", page.body()
    points = {a["data-chart"]: int(a["data-series-points"] or 0) for a in page.having("data-series-points")}
    assert set(points) == set(CHARTS) and all(points[name] > 0 for name in CHARTS), points
    ttft_series = next(a for a in page.having("data-chart") if a["data-chart"] == "ttft")["data-series"] or ""
    assert {"local", "remote"} <= set(ttft_series.split(","))
    instances = {a["data-instance"]: a for a in page.having("data-instance")}
    assert set(instances) == set(WORKERS) and all(a["data-ready"] == "true" for a in instances.values())
    assert [a["data-link"] for a in page.having("data-link")] == ["far"]
    routes = {a["data-request-id"]: a["data-route"] for a in page.having("data-request-id")}
    assert {rid: routes.get(rid) for rid in ids} == ids
    rules = {(a["data-route"], a["data-rule"]) for a in page.having("data-rule")}
    assert ("local", "short_prompt") in rules and ("remote", "long_prompt") in rules
    assert "context_length_exceeded" in {a["data-error"] for a in page.having("data-error")}

    # The picture for the docs, taken while requests flow so the throughput chart moves.
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            _generate(c, f"{MARK} {SHORT}", max_tokens=16)
            _generate(c, f"{MARK} {unique_long()}", max_tokens=16)

    sender = threading.Thread(target=traffic, daemon=True)
    sender.start()
    shot = tmp_path / "dashboard.png"
    try:
        _browse(chromium, url, tmp_path / "profile-shot", f"--screenshot={shot}", "--window-size=1400,1500",
                budget_ms=40_000)
    finally:
        stop.set()
        sender.join()
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    if os.environ.get("CROSSFILL_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(shot, SCREENSHOT)
