"""`python -m tools.bench isa-peak`: the probe builds on any x86-64, runs exactly the probes this
CPU's flags allow, and the report reads rates per cycle against the VNNI reference."""
from __future__ import annotations

import platform
import shutil

import pytest

from tools.bench import isa_peak
from workers.model.kernel_records import cpu_id

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("cc") is None,
                                reason="an x86-64 probe built with cc")


def test_the_probes_run_are_those_the_cpu_has_and_their_rates_are_read_per_cycle():
    flags = set(cpu_id().split())  # the model name's words and the feature flags
    clock, best = isa_peak.measure(rounds=1, count=2_000_000)
    expected = {"maddubs_ymm": "avx2" in flags, "fma_ymm": {"avx2", "fma"} <= flags,
                "dpbusd_ymm": {"avx512_vnni", "avx512vl"} <= flags, "dpbusd_zmm": "avx512_vnni" in flags,
                "fma_zmm": "avx512f" in flags}
    assert set(best) == {name for name, present in expected.items() if present}
    assert clock > 1e8 and all(rate > 1e7 and macs in (8, 16, 32, 64) for rate, macs in best.values())
    assert best.get("dpbusd_zmm", (0, 64))[1] == 64 and best.get("maddubs_ymm", (0, 32))[1] == 32


def test_the_report_puts_each_probe_against_the_256_bit_vnni_rate():
    lines = isa_peak.report(2e9, {"dpbusd_ymm": (2e9, 32), "dpbusd_zmm": (1.5e9, 64), "fma_ymm": (4e9, 8)})
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["dpbusd_zmm"][1:] == ["1.50", "0.75", "96.0", "1.50x"]
    assert rows["fma_ymm"][2] == "2.00" and rows["fma_ymm"][-1] == "0.50x"
    no_vnni = isa_peak.report(2e9, {"maddubs_ymm": (4e9, 32)})
    assert no_vnni[1].split()[-1] == "-"
