"""Scale-out on Ray Serve: one WebSocket ingress, many engine replicas, sessions pinned.

Pieces: `load` (what a replica reports: the scheduler's load signal), `autoscale` (replica
count from queue depth and response P99 against target, within bounds), `replica` (one
engine replica: a device, its models, its sessions' state), `pool` (routing with session
affinity, least-loaded placement, failure handling), `prom` (Prometheus text merged across
replicas with a ``replica`` label) and `app` (the Ray Serve application and its builder).
Only `app` and `pool` import Ray; the rest is plain logic testable without it.
"""

from __future__ import annotations
