"""The harness's own judgement, without a cluster: how a response is classified and judged, slopes."""

from __future__ import annotations

import json

import httpx
import pytest

from crossfill.reliability.client import Outcome, send
from crossfill.reliability.procs import child_name
from crossfill.reliability.reference import Expected
from crossfill.reliability.sampler import ProcSample
from crossfill.reliability.trend import trends
from crossfill.reliability.verdict import judge, tally
from crossfill.reliability.workload import Prompt, RequestSpec

PROMPT = Prompt("long-0", text="Document 0: hello")
SPEC = RequestSpec("r-1", PROMPT, 6, "remote_preferred", True, "r-1")
REFS = {("long-0", 6): Expected((10, 11, 12, 13, 14, 15), "abcdef")}
ERROR = {"error": {"message": "every decode instance is full", "type": "rate_limit_error", "param": None,
                   "code": "decode_full"}}


def _sse(*chunks: object) -> bytes:
    return b"".join(b"data: " + (c if isinstance(c, bytes) else json.dumps(c).encode()) + b"\n\n" for c in chunks)


def _delta(ids: list[int], finish: str | None = None) -> dict:
    return {"choices": [{"text": "x", "finish_reason": finish}], "token_ids": ids}


async def _send(handler, spec: RequestSpec = SPEC) -> Outcome:
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        return await send(http, "http://gw", "m", spec, deadline_s=10, connect_budget_s=10)


@pytest.mark.parametrize(("status", "body", "ctype", "verdict"), [
    (429, json.dumps(ERROR).encode(), "application/json", "failed"),
    (500, b"Internal Server Error", "text/plain", "lost"),  # not the error schema: a bug, counted as lost
    (502, b'{"detail": "bad gateway"}', "application/json", "lost"),
])
async def test_an_answer_is_an_explicit_error_only_in_the_openai_schema(status, body, ctype, verdict) -> None:
    out = await _send(lambda req: httpx.Response(status, content=body, headers={"content-type": ctype}))
    assert out.verdict == verdict, out.detail


async def test_a_stream_is_completed_failed_or_lost_by_how_it_ends() -> None:
    def stream(*chunks: object):
        return lambda req: httpx.Response(200, content=_sse(*chunks), headers={"content-type": "text/event-stream"})

    done = await _send(stream(_delta([10, 11, 12]), _delta([13, 14, 15], "length"), b"[DONE]"))
    assert done.verdict == "completed" and done.token_ids == [10, 11, 12, 13, 14, 15]
    assert judge(done, REFS) is None
    failed = await _send(stream(_delta([10, 11]), ERROR, b"[DONE]"))
    assert failed.verdict == "failed" and failed.error_code == "decode_full"
    assert judge(failed, REFS) is None  # what streamed before the error is the right start
    lost = await _send(stream(_delta([10, 11])))
    assert lost.verdict == "lost" and "without a result" in lost.detail
    twice = await _send(stream(_delta([10, 11, 12, 13, 14, 15], "length"), _delta([], "length"), b"[DONE]"))
    assert judge(twice, REFS) == "duplicated"


async def test_only_a_connection_that_never_opened_is_sent_again() -> None:
    calls = []

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) < 3:
            raise httpx.ConnectError("refused", request=req)
        return httpx.Response(200, json={"choices": [{"text": "abcdef", "finish_reason": "length"}],
                                         "token_ids": [10, 11, 12, 13, 14, 15], "crossfill": {"route": "remote"}})

    out = await _send(handler, RequestSpec("r-2", PROMPT, 6, "remote_preferred", False, "r-2"))
    assert out.verdict == "completed" and out.connect_retries == 2

    def broken(req: httpx.Request) -> httpx.Response:
        raise httpx.ReadError("reset", request=req)

    out = await _send(broken)
    assert out.verdict == "lost" and out.connect_retries == 0


def test_replayed_and_wrong_tokens_are_told_apart() -> None:
    def completed(ids: list[int], rid: str = "r-1") -> Outcome:
        spec = RequestSpec(rid, PROMPT, 6, "remote_preferred", True, rid)
        return Outcome(spec, "completed", status=200, token_ids=ids, finals=1, finish_reason="length")

    assert judge(completed([10, 11, 12, 13, 14, 15]), REFS) is None
    assert judge(completed([10, 11, 12, 10, 11, 12]), REFS) == "duplicated"  # started over mid-way
    assert judge(completed([10, 11, 12, 13, 14, 99]), REFS) == "wrong"
    row = tally("x", [completed([10, 11, 12, 13, 14, 15], "a"), completed([10, 11, 99, 13, 14, 15], "b"),
                      Outcome(SPEC, "lost", detail="no answer")], REFS, leaked=0)
    assert (row.sent, row.completed, row.lost, row.wrong, row.duplicated) == (3, 2, 1, 1, 0)
    assert not row.ok and len(row.examples or []) == 2  # the wrong one and the lost one
    again = tally("x", [completed([10, 11, 12, 13, 14, 15], "a")] * 2, REFS, leaked=0)
    assert again.duplicated == 2  # one request id answered twice


def test_trends_judge_each_process_lifetime_after_its_warm_up() -> None:
    samples = []
    for i in range(40):  # 40 minutes, one sample a minute
        t = i * 60.0
        samples.append(ProcSample(t, "decode", 1, int((400 + 2 * i) * 2**20), 50, 8))  # +120 MB/h: a leak
        pid = 2 if i < 30 else 3  # restarted at minute 30: its new life is too short to judge
        samples.append(ProcSample(t, "prefill", pid, 300 * 2**20, 40 + (i % 2), 6))
    verdicts = {(t.process, t.pid, t.metric): t for t in trends(samples, warmup_s=120, min_span_s=600)}
    assert verdicts[("decode", 1, "rss_mb")].verdict == "fail"
    assert verdicts[("decode", 1, "rss_mb")].slope_per_h == pytest.approx(120, rel=0.01)
    assert verdicts[("prefill", 2, "fds")].verdict == "pass"
    assert verdicts[("prefill", 3, "rss_mb")].verdict == "n/a"


def test_a_level_step_at_a_fault_is_not_a_leak_but_growth_between_faults_is() -> None:
    fault = (1200.0, 1300.0)  # a fault from minute 20 until it settled
    samples = []
    for i in range(60):
        t = i * 60.0
        if fault[0] <= t <= fault[1]:
            continue
        step = 200 if t > fault[1] else 0  # the fault left the allocator 200 MB bigger, then flat
        samples.append(ProcSample(t, "prefill", 1, (900 + step + (i % 3)) * 2**20, 30, 6))
        samples.append(ProcSample(t, "decode", 2, int((900 + step + 2 * i) * 2**20), 30, 6))  # +120 MB/h
    got = {t.process: t for t in trends(samples, warmup_s=120, min_span_s=600, disturbed=[fault])
           if t.metric == "rss_mb"}
    assert got["prefill"].verdict == "pass" and abs(got["prefill"].slope_per_h or 0) < 5
    assert got["decode"].verdict == "fail"
    noisy = [ProcSample(i * 10.0, "gw", 3, (300 + 40 * (i % 2)) * 2**20, 30, 6) for i in range(20)]
    assert trends(noisy, warmup_s=0, min_span_s=60)[0].verdict == "inconclusive"  # 3 minutes of noise


def test_children_of_up_are_named_from_their_command_lines() -> None:
    assert child_name(["python", "-m", "crossfill.cli", "serve", "prefill", "--config", "c.yaml",
                       "--instance", "far-prefill-0"]) == "far-prefill-0"
    assert child_name(["python", "-m", "crossfill.cli", "serve", "gateway", "--config", "c.yaml"]) == "gateway"
    assert child_name(["python", "-m", "crossfill.serving.links", "c.yaml"]) == "links"
    assert child_name(["/opt/bin/mooncake_master", "--rpc_port=1"]) == "mooncake_master"
    assert child_name(["python", "-c", "pass"]) is None
