"""Prometheus text from many replicas merged into one exposition with a ``replica`` label.

Each replica renders its own `ServeMetrics` text; the ingress parses it into families
(``# HELP`` / ``# TYPE`` headers and their samples), adds ``replica="<id>"`` to every
sample and emits each family once, so ``sum by (...)`` / ``max by (replica)`` work across
the fleet in Prometheus as they would for one server.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)\s*$")


@dataclass(slots=True)
class Family:
    """One metric family: header lines and labelled samples."""

    name: str
    help: str = ""
    type: str = "untyped"
    samples: list[str] = field(default_factory=list)


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"')


def add_label(sample_line: str, key: str, value: str) -> str:
    """``name{a="1"} 3`` → ``name{a="1",key="value"} 3`` (a line that is not a sample is returned as is)."""
    m = _SAMPLE.match(sample_line)
    if m is None:
        return sample_line
    name, labels, val = m.group(1), m.group(2), m.group(3)
    extra = f'{key}="{_escape(value)}"'
    inner = f"{labels[1:-1]},{extra}" if labels and labels != "{}" else extra
    return f"{name}{{{inner}}} {val}"


def _family_of(sample_name: str, fams: dict[str, Family]) -> str:
    if sample_name in fams:
        return sample_name
    for suffix in ("_sum", "_count", "_bucket", "_total"):
        if sample_name.endswith(suffix) and sample_name[: -len(suffix)] in fams:
            return sample_name[: -len(suffix)]
    return sample_name


def merge(texts: Iterable[tuple[str, str]], label: str = "replica") -> str:
    """Merge ``(replica_id, prometheus_text)`` pairs into one exposition (see the module docstring)."""
    fams: dict[str, Family] = {}
    for rid, text in texts:
        current: str | None = None
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                parts = line.split(" ", 3)
                name = parts[2]
                fam = fams.setdefault(name, Family(name))
                if parts[1] == "HELP":
                    fam.help = parts[3] if len(parts) > 3 else ""
                else:
                    fam.type = parts[3] if len(parts) > 3 else "untyped"
                current = name
                continue
            if line.startswith("#"):
                continue
            m = _SAMPLE.match(line)
            if m is None:
                continue
            sname = m.group(1)
            fname = current if current is not None and sname.startswith(current) else _family_of(sname, fams)
            fams.setdefault(fname, Family(fname)).samples.append(add_label(line, label, rid))
    out: list[str] = []
    for fam in fams.values():
        out.append(f"# HELP {fam.name} {fam.help or fam.name.replace('_', ' ')}")
        out.append(f"# TYPE {fam.name} {fam.type}")
        out.extend(fam.samples)
    return "\n".join(out) + "\n"


def parse_samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """``{(name, labels): value}`` of every sample line (for tests and the bench)."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out
