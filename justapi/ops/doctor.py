"""`justapi doctor`: what this machine's CPU kernels measured and keep for later starts (the
weight-path plans, the attention products' choice), where, at which thread count, on which
CPU and how busy the host was; `--reset` removes the records so the next start measures afresh.
The plans shown are those of this install's kernel source on this CPU - the ones a start uses
(at its thread count) - unless `--all`: the cache keeps other versions' plans beside them.

Reads the records as plain JSON (workers/model/kernel_records.py is torch-free, imported inside
the command): `import justapi` stays torch-free and the command loads no model.
Owns: this command line and its tables. Does not own: the records (kernel_records.py,
workers/weights/plan_cache.py, workers/model/cpu_kernels.py).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from justapi.ops.admin_cli import EXIT_FAILED, EXIT_OK, percent, table

PROG = "justapi doctor"


@click.command("doctor")
@click.option("--reset", is_flag=True, help="Remove the records: the next start measures again.")
@click.option("--probe-s", type=click.FloatRange(min=0.0), default=1.0, show_default=True,
              help="Seconds to watch how busy the host is now (0: skip).")
@click.option("--json", "as_json", is_flag=True, help="Print the records as JSON.")
@click.option("--all", "show_all", is_flag=True,
              help="Also the plans measured on other kernel sources (other versions) or CPUs.")
def doctor(reset: bool, probe_s: float, as_json: bool, show_all: bool) -> None:
    """Show (or --reset) the CPU kernels' measured records on this machine.

    The weight-path plan per weight type and shape that this install's kernels use on this
    CPU (--all: every record kept, other versions' too), the attention products' choice, each
    with the thread count, CPU, time and host load it was measured at.

    Exit status: 0, or 1 (one line on stderr) where there is no private kernel cache directory.
    """
    from workers.model import kernel_records as records  # torch-free

    try:
        directory = records.cache_dir()
    except records.KernelBuildError as exc:
        click.echo(f"{PROG}: error: {exc}", err=True)
        sys.exit(EXIT_FAILED)
    if reset:
        removed = records.reset_records(directory)
        click.echo(f"removed {len(removed)} record file(s) from {directory}" +
                   "".join(f"\n  {path.name}" for path in removed))
        sys.exit(EXIT_OK)
    files = {path.name: records.read_json(path) for path in records.record_files(directory) if path.exists()}
    busy = records.BusyProbe().start()
    time.sleep(probe_s)
    share = busy.share() if probe_s > 0 else None
    if as_json:
        click.echo(json.dumps({"directory": str(directory), "cpu": records.cpu_name(), "others_busy_now": share,
                               "quiet_share": records.QUIET_SHARE, "records": files}, indent=2, sort_keys=True))
        sys.exit(EXIT_OK)
    click.echo(_report(directory, records.cpu_name(), share, records.QUIET_SHARE, files,
                       None if show_all else records.plan_source_digest()))
    sys.exit(EXIT_OK)


def _report(directory: Path, cpu: str, share: float | None, quiet: float, files: dict[str, dict],
            source: str | None = None) -> str:
    """The tables; `source` (a plan_source_digest): only the plans measured on those kernels
    and this CPU, the rest counted (None: every plan)."""
    lines = [f"kernel cache: {directory}", f"this CPU: {cpu}"]
    if share is not None:
        verdict = "quiet: a measurement now is kept" if share <= quiet else "busy: a measurement now holds for its run only"
        lines.append(f"other processes now: {percent(share)} of the CPUs ({verdict}; at most {percent(quiet)})")
    plans = [entry for name, data in files.items() if name.endswith(".json") and "products" not in name
             for entry in data.values() if isinstance(entry, dict) and "plan" in entry]
    if source is None:
        lines += ["", f"weight-path plans: {len(plans)}"]
    else:
        others = len(plans)
        plans = [e for e in plans if e.get("source") == source and e.get("cpu") == cpu]
        others -= len(plans)
        lines += ["", f"weight-path plans of this install's kernels on this CPU: {len(plans)}" +
                  (f" ({others} more measured on other kernel sources or CPUs: --all lists them)" if others else "")]
    if plans:
        lines.append(table(["type", "shape", "plan", "threads", "cpu", "measured", "others busy"],
                           [[e.get("type"), "x".join(map(str, e.get("shape", []))), _describe(e.get("plan")),
                             e.get("threads"), e.get("cpu"), _when(e.get("measured_at")),
                             percent(e.get("others_busy"))] for e in sorted(plans, key=_plan_order)]))
    products = [(name, entry) for name, data in files.items() if "products" in name
                for entry in data.values() if isinstance(entry, dict)]
    lines += ["", f"attention products over a bf16 KV cache: {len(products)}"]
    if products:
        lines.append(table(["build", "threads", "choice", "fp32 ms", "bf16 ms", "cpu", "measured", "others busy"],
                           [[name.split(".")[0], e.get("threads"), e.get("choice"), e.get("fp32_ms"), e.get("bf16_ms"),
                             e.get("cpu"), _when(e.get("measured_at")), percent(e.get("others_busy"))]
                            for name, e in products]))
    return "\n".join(lines)


def _plan_order(entry: dict) -> tuple:
    return (str(entry.get("type")), tuple(entry.get("shape", [])), entry.get("threads") or 0)


def _describe(steps: object) -> str:
    """[[rows, path], ...] as 'int8 <= 16 rows < dense' (path_plan.PathPlan.describe)."""
    if not isinstance(steps, list) or not steps:
        return "?"
    parts = [f"{path} <= {rows}" for rows, path in steps[:-1]]
    return " rows < ".join(parts + [str(steps[-1][1])]) if parts else f"{steps[-1][1]} always"


def _when(stamp: object) -> str | None:
    if not isinstance(stamp, (int, float)) or stamp <= 0:
        return None
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(stamp))
