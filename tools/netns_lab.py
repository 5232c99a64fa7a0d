"""A lab cluster on one machine: network namespaces as hosts, each a Ray node, reachable only
through veth pairs - so `justapi serve --launcher ray` traffic really crosses a network
boundary (tests/cluster/test_ray_cluster.py, tools/bench/cross_host.py). Needs root (`ip netns`).

    python -m tools.netns_lab --hosts 2      # prints the Ray address and node addresses,
                                             # tears everything down on Ctrl-C

Host i is namespace `jl<pid>n<i>` with a veth pair on the private /30 10.<o>.<i>.0/30: .1 on
the machine's side, .2 inside (its default route goes through .1). The Ray head runs on the
machine's side of host 0's pair with no CPUs (it places nothing); each namespace runs one
Ray node with `cpus` CPUs. Clean-up kills exactly the processes whose command line names the
lab's Ray temp dir (and their children), then deletes the namespaces (their veths go too).
Owns: the lab's namespaces, links and Ray processes. Does not own: what runs on it.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_DOCKER_CPU_WARNING": "1"}
OBJECT_STORE_BYTES = 80 * 2**20


class LabError(RuntimeError):
    """The lab cannot be built here (no root, no `ip netns`, Ray failed to start)."""


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise LabError(f"ip {' '.join(args)}: {result.stderr.strip() or result.returncode}")


def netns_available() -> str:
    """'' when this process may make network namespaces, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    name = f"jlprobe{os.getpid()}"
    try:
        _ip("netns", "add", name)
        _ip("netns", "del", name)
    except (LabError, FileNotFoundError) as exc:
        return f"cannot make a network namespace: {exc}"
    return ""


@dataclass
class Host:
    namespace: str
    outside: str  # veth end on the machine's side
    outside_ip: str  # x.x.x.1
    inside_ip: str  # x.x.x.2, the host's address


@dataclass
class NetnsLab:
    num_hosts: int = 2
    cpus: float = 1.0
    hosts: list[Host] = field(default_factory=list)
    temp_dir: str = ""
    address: str = ""  # Ray head HOST:PORT

    @property
    def head_ip(self) -> str:
        return self.hosts[0].outside_ip

    def up(self) -> NetnsLab:
        try:
            self._make_hosts()
            self._start_ray()
        except BaseException:
            self.down()
            raise
        return self

    def _make_hosts(self) -> None:
        octet = random.randrange(200, 250)
        tag = f"jl{os.getpid() % 100000}"
        for i in range(self.num_hosts):
            host = Host(f"{tag}n{i}", f"{tag}h{i}", f"10.{octet}.{i}.1", f"10.{octet}.{i}.2")
            self.hosts.append(host)
            inside = f"{tag}p{i}"
            _ip("netns", "add", host.namespace)
            _ip("link", "add", host.outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", host.namespace)
            _ip("addr", "add", f"{host.outside_ip}/30", "dev", host.outside)
            _ip("link", "set", host.outside, "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.inside_ip}/30", "dev", inside)
            _ip("-n", host.namespace, "link", "set", inside, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            _ip("-n", host.namespace, "route", "add", "default", "via", host.outside_ip)

    def _start_ray(self) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="justapi-raylab-")
        port = _free_port(self.head_ip)
        self.address = f"{self.head_ip}:{port}"
        self._ray_start(["--head", f"--node-ip-address={self.head_ip}", f"--port={port}",
                         "--num-cpus=0", "--num-gpus=0", "--include-dashboard=false",
                         f"--temp-dir={self.temp_dir}"])
        for host in self.hosts:
            self._ray_start([f"--address={self.address}", f"--node-ip-address={host.inside_ip}",
                             f"--num-cpus={self.cpus:g}", "--num-gpus=0"], host.namespace)

    def _ray_start(self, args: list[str], namespace: str = "") -> None:
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        command = [ray, "start", *args, f"--object-store-memory={OBJECT_STORE_BYTES}",
                   "--disable-usage-stats"]
        if namespace:
            command = ["ip", "netns", "exec", namespace, *command]
        result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=120,
                                env={**os.environ, **RAY_ENV})
        if result.returncode != 0:
            raise LabError(f"ray start failed ({namespace or 'head'}): "
                           f"{(result.stderr or result.stdout).strip()[-2000:]}")

    def set_link(self, host: Host, is_up: bool) -> None:
        """Cut a host off the network (or reconnect it): its veth pair goes down (up)."""
        _ip("link", "set", host.outside, "up" if is_up else "down")

    def veth_bytes(self) -> int:
        """Bytes sent plus received on the machine's side of every host's veth."""
        total = 0
        for host in self.hosts:
            for direction in ("rx_bytes", "tx_bytes"):
                with open(f"/sys/class/net/{host.outside}/statistics/{direction}") as handle:
                    total += int(handle.read())
        return total

    def down(self) -> None:
        if self.temp_dir:
            kill_tree(self.temp_dir)
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True, check=False)
            subprocess.run(["ip", "link", "del", host.outside], capture_output=True, check=False)
        self.hosts.clear()
        if self.temp_dir:
            subprocess.run(["rm", "-rf", self.temp_dir], check=False)
            self.temp_dir = ""


def kill_tree(marker: str, grace_s: float = 3.0) -> list[int]:
    """SIGTERM, then SIGKILL, every process whose command line holds `marker`, and their
    descendants (Ray's workers are the raylets' children). Returns the pids."""
    pids = process_tree(marker)
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while signum == signal.SIGTERM and time.monotonic() < deadline \
                and any(_alive(pid) for pid in pids):
            time.sleep(0.1)
    return sorted(pids)


def process_tree(marker: str) -> set[int]:
    """Processes whose command line holds `marker`, and all their descendants."""
    table = processes()
    pids = {pid for pid, (_, cmd) in table.items() if marker in cmd and pid != os.getpid()}
    while True:
        more = {pid for pid, (ppid, _) in table.items() if ppid in pids} - pids
        if not more:
            return pids
        pids |= more


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                cmd = handle.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        out[int(entry)] = (ppid, cmd)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(prog="python -m tools.netns_lab",
                                  description=__doc__.split("\n\n")[0])
    cli.add_argument("--hosts", type=int, default=2, help="namespaces (Ray nodes), default 2")
    cli.add_argument("--cpus", type=float, default=1.0, help="CPUs each node offers (1)")
    args = cli.parse_args(argv)
    why = netns_available()
    if why:
        print(f"python -m tools.netns_lab: {why}", file=sys.stderr)
        return 2
    lab = NetnsLab(args.hosts, args.cpus).up()
    print(f"Ray address {lab.address} (head {lab.head_ip}); hosts "
          f"{', '.join(h.inside_ip + ' in ' + h.namespace for h in lab.hosts)}")
    print(f"justapi serve --launcher ray --address {lab.address} --workers {args.hosts} "
          f"(with node-ip = \"{lab.head_ip}\" in the config); Ctrl-C tears the lab down")
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        lab.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
