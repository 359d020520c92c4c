"""Reliability harnesses: `crossfill chaos` (a matrix of faults under load) and `crossfill soak`.

Both start a real cluster with `crossfill up`, drive it through the gateway like a client would,
and judge every request against a greedy reference computed offline:

    workload.py   what to send: prompts (short local, long remote, multi-turn chats) and request specs
    reference.py  the expected greedy output of every prompt, from the offline engine
    client.py     one request over HTTP, classified as completed / failed (explicit error) / lost
    load.py       steady closed-loop load; counters the scenarios wait on
    verdict.py    per-request judgement (wrong, duplicated) and the table row of a run
    procs.py      the `crossfill up` process and its children (find, kill -9, SIGTERM, rejoin)
    cluster.py    the cluster's HTTP views: scheduler, workers' KV, link emulator controls
    scenarios.py  the chaos scenarios; mixes.py the workloads they run under; chaos.py runs them
    soak.py       the soak; sampler.py samples processes, trend.py judges slopes, plots.py draws them
"""
