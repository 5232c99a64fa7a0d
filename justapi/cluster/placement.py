"""`justapi serve --launcher ray --address HOST:PORT --workers N`: the Launcher's placement
when the workers are Ray actors on the cluster's nodes (frontend and scheduler still run here
as the launcher's children).

open(): join the Ray cluster; bind the scheduler's worker endpoint on this node's cluster
address (tcp, CURVE, ZAP: justapi/wire/auth.py) and make its key pair. place_workers():
reserve one bundle per worker (a CPU share, or one GPU) in a placement group, so Ray chooses
the nodes (`placement`: spread by default); make one KV pool owner per CPU host (a
HostPoolActor pinned to that node, its shared-memory segment mapped by every worker there);
create the worker actors and admit each one's public key before it connects
(justapi/cluster/supervisor.py). Ray restarts a worker whose process dies (Ray's
max_restarts: `max-restarts` with `restart-workers`, else none).
Ray is an optional extra (`pip install -e '.[ray]'`), imported only here and in the actors.
Owns: Ray start-up and shutdown, placement, the pool owners, the CURVE key files.
Does not own: the local processes (Launcher), the workers' lifecycles (supervisor.py).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
from typing import Any

import zmq

from justapi.cluster.actors import HostPoolActor, WorkerActor
from justapi.cluster.supervisor import RayWorkerSupervisor, WorkerSlot, WorkerStartError
from justapi.config.serve import ServeConfig
from justapi.launch.child import ChildSpec, Endpoints
from justapi.launch.launcher import LaunchError
from justapi.model.info import ModelInfo
from justapi.wire.auth import (
    AUTHORIZED_KEYS_FILE,
    SERVER_KEY_FILE,
    write_authorized_keys,
    write_secret_key,
)
from justapi.wire.ids import worker_name
from justapi.wire.protocol import FenceWorker

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0
ACTOR_CONCURRENCY = 4  # start() may load for minutes while wait_stopped()/stop() are called


class RayPlacement:
    def __init__(self, config: ServeConfig, model: ModelInfo) -> None:
        try:
            import ray
        except ImportError:
            raise LaunchError("launcher ray needs Ray: pip install -e '.[ray]'") from None
        self._ray = ray
        self.config = config
        self.model = model
        self.endpoints: Endpoints | None = None
        self.placement: Any = None
        self.owners: dict[str, Any] = {}  # node id -> HostPoolActor handle
        self._keys: dict[str, bytes] = {}
        self.node_ip = ""
        self.workers = RayWorkerSupervisor(ray, self._authorize)

    # ---------------------------------------------------------------- start-up
    def open(self, endpoints: Endpoints) -> Endpoints:
        """Join the cluster; the workers' endpoint on this node's address; the key pair."""
        self.node_ip = self._join_cluster()
        port = self.config.cluster.worker_port or _free_port(self.node_ip)
        self.endpoints = dataclasses.replace(endpoints, workers=f"tcp://{self.node_ip}:{port}")
        self._make_keys(endpoints.runtime_dir)
        return self.endpoints

    def _join_cluster(self) -> str:
        cluster = self.config.cluster
        address = cluster.address or "auto"
        handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        try:  # our stop rules win over whatever the Ray driver installs
            self._ray.init(address=address, _node_ip_address=cluster.node_ip or None,
                           namespace=f"justapi-{os.getpid()}", log_to_driver=True,
                           logging_level=logging.WARNING)
        except Exception as exc:
            raise LaunchError(f"cannot join the Ray cluster at {address}: {exc}") from None
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
        return cluster.node_ip or self._ray.util.get_node_ip_address()

    def _make_keys(self, runtime_dir: str) -> None:
        """The scheduler's CURVE pair (its secret stays in this host's 0700 runtime dir)."""
        public, secret = zmq.curve_keypair()
        self.server_public_key = public.decode()
        self.server_key_path = os.path.join(runtime_dir, SERVER_KEY_FILE)
        self.keys_path = os.path.join(runtime_dir, AUTHORIZED_KEYS_FILE)
        write_secret_key(self.server_key_path, secret)
        write_authorized_keys(self.keys_path, {})

    def _authorize(self, index: int, public_key: str) -> None:
        """Let worker `index`'s (new) key in; its previous process's key goes out."""
        self._keys[worker_name(index)] = public_key.encode()
        write_authorized_keys(self.keys_path, self._keys)

    def scheduler_extra(self) -> dict[str, Any]:
        return {"host": self.node_ip, "worker_curve": {
            "secret_key_file": self.server_key_path, "authorized_keys_file": self.keys_path}}

    def local_workers(self) -> list[int]:
        return []  # the workers are Ray's

    def worker_pool(self, index: int) -> dict[str, Any]:
        return {}  # (no local workers)

    def place_workers(self) -> dict[str, Any]:
        """Place the workers, give each CPU host its pool, create and admit the workers."""
        nodes = self._place()
        pools = self._host_pools(nodes) if self.config.model.device == "cpu" else {}
        addresses = self._node_addresses()
        for index, node_id in enumerate(nodes):
            self.workers.add(self._worker_slot(index, node_id, addresses.get(node_id, "?"),
                                               pools.get(node_id, {})))
        return {"kind": "hosts", "hosts": _describe_hosts(nodes, addresses, pools)}

    def _place(self) -> list[str]:
        """One bundle per worker; Ray picks the nodes. Returns the node of each worker index."""
        from ray.util.placement_group import placement_group, placement_group_table

        num_workers = self.config.server.workers
        bundle = self._bundle()
        strategy = self.config.cluster.placement.upper()
        self.placement = placement_group([bundle] * num_workers, strategy=strategy)
        timeout_s = self.config.server.ready_timeout_s
        try:
            self._ray.get(self.placement.ready(), timeout=timeout_s)
        except self._ray.exceptions.GetTimeoutError:
            raise LaunchError(f"Ray could not place {num_workers} worker(s) of {bundle} "
                              f"({strategy}) in {timeout_s:.0f}s; the cluster has "
                              f"{self._ray.cluster_resources()}") from None
        table = placement_group_table(self.placement)["bundles_to_node_id"]
        return [table[i] for i in range(num_workers)]

    def _bundle(self) -> dict[str, float]:
        if self.config.model.device == "cuda":
            return {"GPU": 1.0}
        return {"CPU": float(self.config.cluster.cpus_per_worker)}

    def _node_addresses(self) -> dict[str, str]:
        return {n["NodeID"]: n["NodeManagerAddress"] for n in self._ray.nodes() if n["Alive"]}

    def _host_pools(self, nodes: list[str]) -> dict[str, dict[str, Any]]:
        """A pool owner on each node that got a worker; pool ids in order of first use."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        owner_class = self._ray.remote(HostPoolActor)
        config, model = self.config.to_dict(), dataclasses.asdict(self.model)
        for node_id in dict.fromkeys(nodes):
            strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
            self.owners[node_id] = owner_class.options(
                num_cpus=0, max_restarts=0, scheduling_strategy=strategy).remote(
                    config, model, len(self.owners))
        refs = {node_id: owner.describe.remote() for node_id, owner in self.owners.items()}
        try:
            return {node_id: self._ray.get(ref, timeout=self.config.server.ready_timeout_s)
                    for node_id, ref in refs.items()}
        except Exception as exc:
            raise LaunchError(f"a host's KV pool could not be created: {exc}") from None

    def _worker_slot(self, index: int, node_id: str, host: str, pool: dict[str, Any]) -> WorkerSlot:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        config, ops = self.config, self.config.ops
        assert self.endpoints is not None, "place_workers() before open()"
        spec = ChildSpec(role="worker", index=index, config=config, endpoints=self.endpoints,
                         model_path=self.model.path, extra={"num_workers": config.server.workers})
        is_gpu = config.model.device == "cuda"
        cpus = 0.0 if is_gpu else float(config.cluster.cpus_per_worker)
        actor = self._ray.remote(WorkerActor).options(
            num_cpus=cpus, num_gpus=1 if is_gpu else 0,
            max_restarts=ops.max_restarts if ops.restart_workers else 0, max_task_retries=0,
            max_concurrency=ACTOR_CONCURRENCY, name=f"justapi-worker-{index}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.placement, placement_group_bundle_index=index),
        ).remote(spec.to_json(), node_id, self.server_public_key, max(1, int(cpus)))
        return WorkerSlot(index, actor, node_id, host, pool)

    # ---------------------------------------------------------------- serving
    def check(self, *, starting: bool) -> None:
        """Advance the workers' lifecycles; while starting, one that failed is a LaunchError."""
        try:
            self.workers.check(starting=starting)
        except WorkerStartError as exc:
            raise LaunchError(str(exc)) from None

    def fence(self, order: FenceWorker) -> None:
        self.workers.fence(order, self.config.ops.restart_workers)

    # ---------------------------------------------------------------- shutdown
    def close(self) -> None:
        """After the local processes (the scheduler told the workers to stop): the actors,
        the pool owners (they unlink the segments), the placement group, the Ray driver."""
        if not self._ray.is_initialized():
            return
        self.workers.stop_all(STOP_TIMEOUT_S)
        self._close_owners()
        if self.placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement)
            self.placement = None
        self._ray.shutdown()

    def _close_owners(self) -> None:
        refs = [owner.close.remote() for owner in self.owners.values()]
        if refs:
            self._ray.wait(refs, num_returns=len(refs), timeout=STOP_TIMEOUT_S)
        for owner in self.owners.values():
            self._ray.kill(owner, no_restart=True)
        self.owners.clear()


def _describe_hosts(nodes: list[str], addresses: dict[str, str],
                    pools: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per host for the banner: address, workers, and its pool (CPU)."""
    rows: dict[str, dict[str, Any]] = {}
    for index, node_id in enumerate(nodes):
        row = rows.setdefault(node_id, {"host": addresses.get(node_id, "?"), "workers": [],
                                        "pool": pools.get(node_id, {})})
        row["workers"].append(index)
    return list(rows.values())


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
