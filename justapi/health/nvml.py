"""GPU health figures from NVML (nvidia-ml-py's `pynvml`), read by the scheduler process.

`NvmlReader` turns one device into a `GpuReading`: temperature (and its slowdown
threshold), memory used/total, utilisation, power (and its limit), clock throttle reasons,
volatile ECC error counts and the critical XID events the driver reported since the last
read. A query the device does not support reads as None, never as an error. The NVML
module is injected (tests pass a fake one); `open_gpu_reader` falls back to None with one
log line where there is no driver, and the caller keeps the heartbeats' process figures.
Owns: the NVML calls and their translation. Does not own: what is fatal (gpu_faults.py).
"""
from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from typing import Any, Protocol

logger = logging.getLogger(__name__)

# NVML's clocks-throttle-reason bits (nvml.h: nvmlClocksEventReason*; a stable ABI).
THROTTLE_REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown", 0x100: "display_clocks",
}
THERMAL_THROTTLE_REASONS = frozenset({"sw_thermal_slowdown", "hw_thermal_slowdown"})
NVML_TEMPERATURE_GPU = 0
NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_EVENT_TYPE_XID_CRITICAL_ERROR = 0x8
NOT_NEEDED = "not needed (CPU workers)"


@dataclass(frozen=True)
class GpuReading:
    """One NVML reading of one GPU; None where the device does not report the figure."""

    cuda_index: int
    name: str = ""
    uuid: str = ""
    temperature_c: float | None = None
    slowdown_temperature_c: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    utilization_percent: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    throttle_reasons: tuple[str, ...] = ()
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None
    xids: tuple[int, ...] = ()
    """Critical XID events reported since the previous reading of this GPU."""
    is_lost: bool = False
    """NVML says the GPU has fallen off the bus or is otherwise lost."""

    @property
    def is_thermal_throttled(self) -> bool:
        return bool(THERMAL_THROTTLE_REASONS.intersection(self.throttle_reasons))

    def as_dict(self) -> dict[str, Any]:
        """Wire form (the health table prefixes each key with gpu_)."""
        out = asdict(self)
        out["is_thermal_throttled"] = self.is_thermal_throttled
        out["throttle_reasons"] = list(self.throttle_reasons)
        out["xids"] = list(self.xids)
        return out


class GpuReader(Protocol):
    """What the health watch needs: one reading per GPU, by CUDA index (and UUID if known)."""

    def read(self, cuda_index: int, uuid: str = "") -> GpuReading: ...

    def close(self) -> None: ...


def throttle_names(mask: int) -> tuple[str, ...]:
    return tuple(name for bit, name in THROTTLE_REASONS.items() if mask & bit)


class NvmlReader:
    """GpuReader over the NVML module `nvml` (pynvml, or a fake with the same functions)."""

    def __init__(self, nvml: Any, visible_devices: str | None = None) -> None:
        self.nvml = nvml
        nvml.nvmlInit()
        self._visible = _parse_visible(visible_devices)
        self._handles: dict[tuple[int, str], Any] = {}
        self._pending_xids: dict[str, list[int]] = {}
        self._is_lost = False  # set by _try when a query says the GPU is lost
        self._events: Any = self._try(nvml.nvmlEventSetCreate)

    def read(self, cuda_index: int, uuid: str = "") -> GpuReading:
        nvml = self.nvml
        try:
            handle = self._handle(cuda_index, uuid)
        except nvml.NVMLError as exc:
            return GpuReading(cuda_index, is_lost=_is_lost(nvml, exc),
                              name=f"unreadable: {exc}")
        self._drain_xid_events()
        self._is_lost = False
        figures = self._figures(handle)
        device_uuid = _text(self._try(nvml.nvmlDeviceGetUUID, handle)) or uuid
        return GpuReading(cuda_index=cuda_index, uuid=device_uuid,
                          name=_text(self._try(nvml.nvmlDeviceGetName, handle)),
                          xids=tuple(self._pending_xids.pop(device_uuid, [])),
                          is_lost=self._is_lost, **figures)

    def _figures(self, handle: Any) -> dict[str, Any]:
        nvml, q = self.nvml, self._try
        memory = q(nvml.nvmlDeviceGetMemoryInfo, handle)
        utilization = q(nvml.nvmlDeviceGetUtilizationRates, handle)
        power_mw = q(nvml.nvmlDeviceGetPowerUsage, handle)
        limit_mw = q(nvml.nvmlDeviceGetPowerManagementLimit, handle)
        throttle = q(nvml.nvmlDeviceGetCurrentClocksThrottleReasons, handle)
        return {
            "temperature_c": _float(q(nvml.nvmlDeviceGetTemperature, handle, NVML_TEMPERATURE_GPU)),
            "slowdown_temperature_c": _float(q(nvml.nvmlDeviceGetTemperatureThreshold, handle,
                                               NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)),
            "memory_used_bytes": _int(getattr(memory, "used", None)),
            "memory_total_bytes": _int(getattr(memory, "total", None)),
            "utilization_percent": _float(getattr(utilization, "gpu", None)),
            "power_watts": None if power_mw is None else power_mw / 1000.0,
            "power_limit_watts": None if limit_mw is None else limit_mw / 1000.0,
            "throttle_reasons": throttle_names(int(throttle)) if throttle is not None else (),
            "ecc_corrected": _int(q(nvml.nvmlDeviceGetTotalEccErrors, handle,
                                    NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_VOLATILE_ECC)),
            "ecc_uncorrected": _int(q(nvml.nvmlDeviceGetTotalEccErrors, handle,
                                      NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC)),
        }

    def _handle(self, cuda_index: int, uuid: str) -> Any:
        """NVML numbers GPUs by PCI order and ignores CUDA_VISIBLE_DEVICES: prefer the UUID the
        worker reported, else map the CUDA index through CUDA_VISIBLE_DEVICES."""
        key = (cuda_index, uuid)
        if key not in self._handles:
            nvml = self.nvml
            handle = self._try(nvml.nvmlDeviceGetHandleByUUID, uuid) if uuid else None
            if handle is None:
                target = (self._visible[cuda_index] if cuda_index < len(self._visible)
                          else str(cuda_index))
                handle = (nvml.nvmlDeviceGetHandleByIndex(int(target)) if target.isdigit()
                          else nvml.nvmlDeviceGetHandleByUUID(target))
            if self._events is not None:  # XIDs only where the driver reports them
                self._try(nvml.nvmlDeviceRegisterEvents, handle,
                          NVML_EVENT_TYPE_XID_CRITICAL_ERROR, self._events)
            self._handles[key] = handle
        return self._handles[key]

    def _drain_xid_events(self) -> None:
        nvml = self.nvml
        if self._events is None:
            return
        while True:
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError:  # NVML_ERROR_TIMEOUT: nothing pending
                return
            device_uuid = _text(self._try(nvml.nvmlDeviceGetUUID, data.device))
            self._pending_xids.setdefault(device_uuid, []).append(int(data.eventData))

    def _try(self, fn: Any, *args: Any) -> Any:
        """fn(*args), or None where NVML cannot answer (not supported, no permission...)."""
        try:
            return fn(*args)
        except self.nvml.NVMLError as exc:
            self._is_lost = self._is_lost or _is_lost(self.nvml, exc)
            return None

    def close(self) -> None:
        if self._events is not None:
            self._try(self.nvml.nvmlEventSetFree, self._events)
        self._try(self.nvml.nvmlShutdown)


def open_gpu_reader(cuda_indices: list[int], nvml: Any = None) -> tuple[GpuReader | None, str]:
    """(reader, status). No GPU workers: (None, NOT_NEEDED). No NVML: (None, why), logged
    once; health then rests on the heartbeats' process figures."""
    if not cuda_indices:
        logger.info("workers run on CPU: health uses heartbeat figures (RSS, CPU time, KV pool)")
        return None, NOT_NEEDED
    try:
        module = nvml if nvml is not None else _import_pynvml()
        reader = NvmlReader(module, os.environ.get("CUDA_VISIBLE_DEVICES"))
    except Exception as exc:  # ImportError, NVMLError_LibraryNotFound/DriverNotLoaded, ...
        why = f"unavailable: {exc or type(exc).__name__}"
        logger.warning("NVML %s; GPU health falls back to heartbeat figures", why)
        return None, why
    return reader, "ok"


def _import_pynvml() -> Any:
    import pynvml  # nvidia-ml-py

    return pynvml


def _parse_visible(value: str | None) -> list[str]:
    if not value:
        return []
    return [item.strip() for item in value.split(",") if item.strip()]


def _is_lost(nvml: Any, exc: Exception) -> bool:
    lost = getattr(nvml, "NVMLError_GpuIsLost", None)
    return lost is not None and isinstance(exc, lost)


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _float(value: Any) -> float | None:
    return None if value is None else float(value)
