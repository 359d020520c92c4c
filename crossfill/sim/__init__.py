"""`crossfill simulate`: a discrete-event simulation (SimPy) that drives the live routing policy.

Every routing decision in the simulation is a call of `crossfill.policy.decide`, the same pure
function the scheduler runs, on a snapshot built from the simulated cluster. Modules, one job each:

- `simfile`, `sections`, `fields`: the simulation file (a planner cluster file plus workload, link,
  failures, SLOs), its section parsers and strict readers;
- `workload`, `trace`: the requests (synthetic or from a trace), as flat arrays;
- `costs`: prefill time, decode step time and KV bytes, as fast scalar functions;
- `cache`: per-instance LRU prefix caches and the index of who holds which prefix;
- `link`: the shared inter-DC link (processor sharing, fluctuation, outages);
- `instances`, `snapshot`: simulated instances and the small candidate snapshot `decide` sees;
- `cluster`: the SimPy model of one run; `strategies`: the compared routing strategies;
- `metrics`, `report`, `plots`, `run`, `commands`: results, output and the command line.
"""
