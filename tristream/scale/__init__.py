"""Scale-out on Ray Serve: WebSocket ingress processes, one router, many engine replicas, sessions pinned.

Pieces: `load` (what a replica reports: the scheduler's load signal), `autoscale` (replica
count from queue depth and response P99 against target, within bounds), `replica` (one
engine replica: a device, its models, its sessions' state), `pool` (routing with session
affinity, least-loaded placement, failure handling), `router` (the Serve deployment that owns
the pool, shared by every ingress), `direct` (the default ingress: its own ``websockets``
listener, no Serve proxy), `relay` + `session_relay` (one session's frames between its socket
and its replica, batched per replica), `wire` (the relay's framed TCP data plane), `prom`
(Prometheus text merged across replicas with a ``replica`` label) and `app` (the Serve-proxy
ingress, the app builder and `run_ray_server`). `load`, `autoscale`, `prom` and `wire` are
plain logic testable without Ray.
"""

from __future__ import annotations
