"""A fake `pynvml` module for GPU-less tests: devices with settable figures, unsupported
queries, lost GPUs, XID events and an init that fails like a machine without a driver."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's names
    pass


class NVMLError_GpuIsLost(NVMLError):  # noqa: N801
    pass


class NVMLError_Timeout(NVMLError):  # noqa: N801
    pass


class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801
    def __str__(self) -> str:
        return "NVML Shared Library Not Found"


@dataclass
class FakeDevice:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    temperature_c: int = 45
    slowdown_c: int = 90
    memory_used: int = 10 << 30
    memory_total: int = 80 << 30
    utilization: int = 35
    power_mw: int = 300_000
    limit_mw: int = 700_000
    throttle_mask: int = 0
    ecc: dict = field(default_factory=lambda: {0: 0, 1: 0})  # corrected, uncorrected
    unsupported: set = field(default_factory=set)  # names of queries that raise NotSupported
    is_lost: bool = False


class FakeNvml:
    """Duck-types the pynvml functions justapi/health/nvml.py calls; handles are FakeDevice objects."""

    NVMLError = NVMLError
    NVMLError_GpuIsLost = NVMLError_GpuIsLost

    def __init__(self, devices: list[FakeDevice], init_error: Exception | None = None) -> None:
        self.devices = devices
        self.init_error = init_error
        self.events: list[SimpleNamespace] = []
        self.registered: list[FakeDevice] = []
        self.is_shut_down = False

    def push_xid(self, device: FakeDevice, xid: int) -> None:
        self.events.append(SimpleNamespace(device=device, eventData=xid, eventType=0x8))

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.is_shut_down = True

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        if index >= len(self.devices):
            raise NVMLError(f"invalid device index {index}")
        return self.devices[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeDevice:
        for device in self.devices:
            if device.uuid == uuid:
                return device
        raise NVMLError(f"no device {uuid}")

    def _query(self, device: FakeDevice, name: str, value: object) -> object:
        if device.is_lost:
            raise NVMLError_GpuIsLost("GPU is lost")
        if name in device.unsupported:
            raise NVMLError_NotSupported("Not Supported")
        return value

    def nvmlDeviceGetUUID(self, d: FakeDevice) -> str:
        return d.uuid

    def nvmlDeviceGetName(self, d: FakeDevice) -> bytes:
        return self._query(d, "name", d.name.encode())  # old pynvml returns bytes

    def nvmlDeviceGetTemperature(self, d: FakeDevice, sensor: int) -> int:
        return self._query(d, "temperature", d.temperature_c)

    def nvmlDeviceGetTemperatureThreshold(self, d: FakeDevice, kind: int) -> int:
        return self._query(d, "threshold", d.slowdown_c)

    def nvmlDeviceGetMemoryInfo(self, d: FakeDevice) -> SimpleNamespace:
        return self._query(d, "memory", SimpleNamespace(used=d.memory_used, total=d.memory_total))

    def nvmlDeviceGetUtilizationRates(self, d: FakeDevice) -> SimpleNamespace:
        return self._query(d, "utilization", SimpleNamespace(gpu=d.utilization, memory=10))

    def nvmlDeviceGetPowerUsage(self, d: FakeDevice) -> int:
        return self._query(d, "power", d.power_mw)

    def nvmlDeviceGetPowerManagementLimit(self, d: FakeDevice) -> int:
        return self._query(d, "power_limit", d.limit_mw)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, d: FakeDevice) -> int:
        return self._query(d, "throttle", d.throttle_mask)

    def nvmlDeviceGetTotalEccErrors(self, d: FakeDevice, error_type: int, counter: int) -> int:
        return self._query(d, "ecc", d.ecc[error_type])

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, d: FakeDevice, types: int, event_set: str) -> None:
        self.registered.append(d)

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> SimpleNamespace:
        if not self.events:
            raise NVMLError_Timeout("Timeout")
        return self.events.pop(0)

    def nvmlEventSetFree(self, event_set: str) -> None:
        pass
