"""NVML readings through a fake pynvml, the GPU fault rules (double-bit ECC, a thermal limit
held, fatal XIDs, a lost GPU) and the clean fallback where there is no driver."""
from __future__ import annotations

import ctypes
import logging
import os

import pytest

from justapi.health.gpu_faults import GpuFaults
from justapi.health.nvml import NOT_NEEDED, GpuReading, NvmlReader, open_gpu_reader
from tests.support.fake_nvml import FakeDevice, FakeNvml, NVMLError_LibraryNotFound


def two_gpus() -> FakeNvml:
    return FakeNvml([FakeDevice("GPU-aaaa"), FakeDevice("GPU-bbbb", temperature_c=60)])


def test_a_reading_has_every_figure():
    nvml = two_gpus()
    nvml.devices[1].throttle_mask = 0x4 | 0x40
    reading = NvmlReader(nvml).read(1)
    assert reading.cuda_index == 1 and reading.uuid == "GPU-bbbb"
    assert reading.name == "NVIDIA H100 80GB HBM3"
    assert reading.temperature_c == 60.0 and reading.slowdown_temperature_c == 90.0
    assert reading.memory_used_bytes == 10 << 30 and reading.memory_total_bytes == 80 << 30
    assert reading.utilization_percent == 35.0
    assert reading.power_watts == 300.0 and reading.power_limit_watts == 700.0
    assert reading.throttle_reasons == ("sw_power_cap", "hw_thermal_slowdown")
    assert reading.is_thermal_throttled
    assert (reading.ecc_corrected, reading.ecc_uncorrected) == (0, 0)
    assert reading.as_dict()["throttle_reasons"] == ["sw_power_cap", "hw_thermal_slowdown"]


def test_unsupported_queries_read_as_none():
    nvml = FakeNvml([FakeDevice("GPU-a", unsupported={"ecc", "power", "power_limit",
                                                      "throttle"})])
    reading = NvmlReader(nvml).read(0)
    assert reading.ecc_uncorrected is None and reading.power_watts is None
    assert reading.throttle_reasons == () and reading.temperature_c == 45.0
    assert not reading.is_lost


def test_cuda_visible_devices_and_uuids_map_to_nvml_devices():
    nvml = two_gpus()
    assert NvmlReader(nvml, visible_devices="1,0").read(0).uuid == "GPU-bbbb"
    assert NvmlReader(nvml, visible_devices="GPU-bbbb").read(0).uuid == "GPU-bbbb"
    assert NvmlReader(nvml).read(0, uuid="GPU-bbbb").uuid == "GPU-bbbb"  # the worker's UUID wins
    assert NvmlReader(nvml).read(1, uuid="GPU-unknown").uuid == "GPU-bbbb"  # fallback: index


def test_xid_events_go_to_the_reading_of_their_gpu_once():
    nvml = two_gpus()
    reader = NvmlReader(nvml)
    reader.read(0)
    reader.read(1)
    assert nvml.registered == nvml.devices  # registered once per GPU
    nvml.push_xid(nvml.devices[1], 79)
    nvml.push_xid(nvml.devices[1], 13)
    assert reader.read(0).xids == ()
    assert reader.read(1).xids == (79, 13)
    assert reader.read(1).xids == ()


def test_a_lost_gpu_is_flagged():
    nvml = two_gpus()
    reader = NvmlReader(nvml)
    nvml.devices[0].is_lost = True
    reading = reader.read(0)
    assert reading.is_lost and reading.temperature_c is None


def reading(**figures: object) -> GpuReading:
    base = dict(cuda_index=0, temperature_c=50.0, slowdown_temperature_c=90.0,
                ecc_uncorrected=0)
    base.update(figures)
    return GpuReading(**base)  # type: ignore[arg-type]


def test_new_double_bit_ecc_errors_are_fatal_old_ones_are_not():
    faults = GpuFaults(thermal_hold_s=30.0)
    assert faults.check(reading(ecc_uncorrected=2), 0.0) is None  # before we started: baseline
    assert faults.check(reading(ecc_uncorrected=2), 1.0) is None
    assert faults.check(reading(ecc_uncorrected=3), 2.0) == \
        "GPU cuda:0: 1 new uncorrected (double-bit) ECC error(s)"


def test_a_thermal_limit_is_fatal_only_when_held():
    faults = GpuFaults(thermal_hold_s=30.0)
    assert faults.check(reading(temperature_c=91.0), 0.0) is None
    assert faults.check(reading(temperature_c=92.0), 20.0) is None
    assert faults.check(reading(temperature_c=70.0), 25.0) is None  # cooled: the clock restarts
    assert faults.check(reading(temperature_c=91.0), 26.0) is None
    assert faults.check(reading(temperature_c=91.0), 50.0) is None
    message = faults.check(reading(temperature_c=93.0), 56.0)
    assert message == "GPU cuda:0 held its thermal limit for 30s (93 C, slowdown at 90 C)"


def test_thermal_throttling_counts_as_the_limit_without_a_threshold():
    faults = GpuFaults(thermal_hold_s=5.0)
    hot = reading(temperature_c=80.0, slowdown_temperature_c=None,
                  throttle_reasons=("sw_thermal_slowdown",))
    assert faults.check(hot, 0.0) is None
    assert "clocks thermally throttled" in faults.check(hot, 6.0)
    assert faults.check(reading(throttle_reasons=("sw_power_cap",)), 7.0) is None


def test_fatal_xids_and_lost_gpus():
    faults = GpuFaults(thermal_hold_s=30.0)
    assert faults.check(reading(xids=(13,)), 0.0) is None  # an application fault: shown only
    assert faults.check(reading(xids=(48,)), 1.0) == \
        "GPU cuda:0 reported XID 48 (double-bit ECC error)"
    assert faults.recent_xids(0) == [13, 48]
    assert faults.check(reading(is_lost=True), 2.0) == "GPU cuda:0 is lost (NVML cannot reach it)"


def test_no_driver_falls_back_with_one_log_line(caplog: pytest.LogCaptureFixture):
    nvml = FakeNvml([], init_error=NVMLError_LibraryNotFound())
    with caplog.at_level(logging.INFO, logger="justapi.health.nvml"):
        reader, status = open_gpu_reader([0, 1], nvml=nvml)
    assert reader is None
    assert status == "unavailable: NVML Shared Library Not Found"
    assert len(caplog.records) == 1
    assert "falls back to heartbeat figures" in caplog.records[0].getMessage()


def test_cpu_workers_do_not_need_nvml(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.INFO, logger="justapi.health.nvml"):
        reader, status = open_gpu_reader([], nvml=FakeNvml([]))
    assert reader is None and status == NOT_NEEDED
    assert len(caplog.records) == 1


def nvml_library_loads() -> bool:
    """Whether the dynamic loader finds NVML's library (the one pynvml opens): asked of the
    machine, not of the code under test."""
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def test_the_real_pynvml_reads_a_gpu_where_the_machine_has_one(
        caplog: pytest.LogCaptureFixture):
    """With NVIDIA's driver (its kernel module and NVML's library) the real reader works; with
    none it falls back cleanly with one log line naming why, and does not raise."""
    pytest.importorskip("pynvml")
    has_library = nvml_library_loads()
    has_driver = has_library and os.path.exists("/proc/driver/nvidia/version")
    with caplog.at_level(logging.INFO, logger="justapi.health.nvml"):
        reader, status = open_gpu_reader([0])
    if has_driver:
        assert reader is not None and status == "ok"
        reading = reader.read(0)
        reader.close()
        assert reading.uuid.startswith("GPU-") and (reading.memory_total_bytes or 0) > 0
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        return
    assert reader is None and len(caplog.records) == 1
    if not has_library:
        assert status == "unavailable: NVML Shared Library Not Found"
    else:
        assert status.startswith("unavailable: ")
