"""The metric names a PromQL expression reads, and the names a live /metrics page offers.

Small on purpose (no PromQL parser): strings, label matchers, range selectors, grouping clauses
and Grafana variables are cut out, then every identifier left that is not a function call, an
aggregation keyword or an operator is a metric name.
"""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan"}
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?")


def metric_names(expr: str) -> set[str]:
    e = _STRINGS.sub('""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)  # range and subquery selectors
    e = _GROUPING.sub(" ", e)
    e = re.sub(r"\$\{?\w+\}?", " ", e)  # Grafana variables ($__rate_interval, ${datasource})
    names = set()
    for m in _IDENT.finditer(e):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in _KEYWORDS:
            continue  # a function or aggregation (rate(, sum(, histogram_quantile() or a keyword
        names.add(name)
    return names


_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
             "summary": ("_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",), "stateset": ("",)}


def exposed_names(text: str) -> set[str]:
    """Every series name a query may use for the families on a /metrics page, sampled yet or not."""
    out: set[str] = set()
    for fam in text_string_to_metric_families(text):
        # A counter's or histogram's family name alone is no series: only its suffixed ones are.
        out.update(fam.name + s for s in _SUFFIXES.get(fam.type, ("",)))
        out.update(s.name for s in fam.samples)
    return out
