"""The CPU kernels' shared records (workers/model/kernel_records.py): read-modify-write under a
lock keeps every writer's entries, the quiet-host probe counts other processes' CPU time over
its own window (not the lagging load average) and leaves out this process's, and `justapi
doctor` shows the records and resets them."""
from __future__ import annotations

import json
import multiprocessing

from click.testing import CliRunner

from justapi import cli
from workers.model import kernel_records


def _add_entries(path: str, prefix: str, count: int) -> None:
    for i in range(count):
        kernel_records.update_json(kernel_records.Path(path), lambda entries, i=i: entries.__setitem__(f"{prefix}{i}", i))


def test_concurrent_writers_keep_every_entry(tmp_path):
    """Two processes adding 30 entries each to one record: all 60 are there (without the lock,
    a read-modify-rename loses the entries the other wrote between its read and its rename)."""
    path = tmp_path / "record.json"
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_add_entries, args=(str(path), prefix, 30)) for prefix in "ab"]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
    assert [writer.exitcode for writer in writers] == [0, 0]
    assert len(json.loads(path.read_text())) == 60
    assert kernel_records.read_json(tmp_path / "missing.json") == {}
    path.write_text("[1, 2")  # torn: read as empty, written whole again
    assert kernel_records.update_json(path, lambda entries: entries.__setitem__("k", 1)) == {"k": 1}


def test_the_busy_probe_counts_others_over_its_window_not_the_load_average(monkeypatch):
    """Over 2 s on 2 CPUs the machine was busy 3 CPU-seconds, 1 of them this process's threads:
    others used 2 of 4 CPU-seconds (0.5), whatever the 1-minute load average says (0 here: it
    lags a burst that began a few seconds ago)."""
    clock, busy, own = [100.0], [50.0], [7.0]
    monkeypatch.setattr(kernel_records.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(kernel_records, "_busy_seconds", lambda: busy[0])
    monkeypatch.setattr(kernel_records, "_own_seconds", lambda: own[0])
    monkeypatch.setattr(kernel_records.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(kernel_records.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    probe = kernel_records.BusyProbe().start()
    clock[0], busy[0], own[0] = 102.0, 53.0, 8.0
    assert probe.share() == 0.5
    own[0] = 10.0  # the machine's busy time was all this process's: nobody else
    assert probe.share() == 0.0
    busy[0] = -1.0  # no /proc/stat: the load average is all there is
    monkeypatch.setattr(kernel_records.os, "getloadavg", lambda: (1.0, 0.0, 0.0))
    assert probe.share() == 0.5


def test_the_busy_probe_reads_this_host():
    share = kernel_records.BusyProbe().start()
    assert 0.0 <= share.share() <= 1.0
    assert kernel_records._busy_seconds() > 0 and kernel_records._own_seconds() > 0


def test_doctor_shows_the_records_and_resets_them(tmp_path, monkeypatch):
    """The plans of this install's kernel source on this CPU (the ones a start uses); another
    version's plan (another source digest, or none: kept before records named it) only counted,
    and listed with --all."""
    monkeypatch.setenv(kernel_records.CACHE_ENV, str(tmp_path))
    plan = {"plan": [[16, "int8"], [65536, "dense"]], "type": "Q4_K", "shape": [2048, 8192], "threads": 2,
            "cpu": kernel_records.cpu_name(), "measured_at": 1.7e9, "others_busy": 0.031,
            "source": kernel_records.plan_source_digest()}
    older = dict(plan, plan=[[4, "int8"], [65536, "int8_panels"]], source="0123456789ab")
    unnamed = {key: value for key, value in plan.items() if key != "source"} | {"plan": [[1, "dense"]]}
    (tmp_path / kernel_records.PLANS_FILE).write_text(json.dumps({"k1": plan, "k0": older, "k00": unnamed}))
    products = {"2": {"choice": "fp32", "fp32_ms": 1.25, "bf16_ms": 1.5, "threads": 2, "cpu": "AMD EPYC [e5b8de0e]",
                      "measured_at": 1.7e9, "others_busy": 0.0}}
    (tmp_path / "paged_attention-0123.products.json").write_text(json.dumps(products))
    shown = CliRunner().invoke(cli.main, ["doctor", "--probe-s", "0"])
    assert shown.exit_code == 0, shown.output
    assert "weight-path plans of this install's kernels on this CPU: 1 (2 more" in shown.output
    assert "int8 <= 16 rows < dense" in shown.output and "2048x8192" in shown.output and "3.1%" in shown.output
    assert "int8 <= 4 rows < int8_panels" not in shown.output and "dense always" not in shown.output
    every = CliRunner().invoke(cli.main, ["doctor", "--probe-s", "0", "--all"]).output
    assert "weight-path plans: 3" in every and "int8 <= 4 rows < int8_panels" in every and "dense always" in every
    assert "attention products over a bf16 KV cache: 1" in shown.output and "paged_attention-0123" in shown.output
    as_json = json.loads(CliRunner().invoke(cli.main, ["doctor", "--probe-s", "0", "--json"]).output)
    assert as_json["records"][kernel_records.PLANS_FILE] == {"k1": plan, "k0": older, "k00": unnamed}
    reset = CliRunner().invoke(cli.main, ["doctor", "--reset"])
    assert reset.exit_code == 0 and "removed 2 record file(s)" in reset.output
    assert not (tmp_path / kernel_records.PLANS_FILE).exists()
    assert not list(tmp_path.glob("*.products.json"))
    assert "weight-path plans of this install's kernels on this CPU: 0" in \
        CliRunner().invoke(cli.main, ["doctor", "--probe-s", "0"]).output
