"""Which GPU readings are fatal for the workers on that GPU.

Fatal: new uncorrected (double-bit) ECC errors since the first reading (volatile counts, so
errors from before the server started do not count); a thermal limit held for
`thermal_hold_s` (the temperature at or above the slowdown threshold, or a thermal clock
throttle reason, in every reading over that span); a critical XID from FATAL_XIDS; a GPU
NVML reports as lost. Other XIDs are remembered and shown, not acted on.
Owns: those rules and the state they need (ECC baselines, since when hot). Does not own:
reading NVML (nvml.py) or what happens to the workers (health_watch.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from justapi.health.nvml import GpuReading

# XIDs after which the GPU (or its memory) cannot be trusted: NVIDIA's XID catalogue.
FATAL_XIDS = {
    48: "double-bit ECC error", 62: "internal micro-controller halt",
    64: "ECC page retirement or row remapping failure", 74: "NVLink error",
    79: "GPU has fallen off the bus", 94: "contained ECC error", 95: "uncontained ECC error",
    119: "GSP RPC timeout", 120: "GSP error",
}
RECENT_XIDS = 8


@dataclass
class GpuFaultState:
    ecc_uncorrected_baseline: int | None = None
    hot_since_s: float | None = None
    recent_xids: list[int] = field(default_factory=list)


class GpuFaults:
    """Applies the rules to successive readings of each GPU (times passed in)."""

    def __init__(self, thermal_hold_s: float) -> None:
        self.thermal_hold_s = thermal_hold_s
        self._state: dict[int, GpuFaultState] = {}

    def check(self, reading: GpuReading, now_s: float) -> str | None:
        """The fatal condition this reading shows, in one line; None if the GPU is fine."""
        state = self._state.setdefault(reading.cuda_index, GpuFaultState())
        gpu = f"GPU cuda:{reading.cuda_index}"
        state.recent_xids = (state.recent_xids + list(reading.xids))[-RECENT_XIDS:]
        if reading.is_lost:
            return f"{gpu} is lost (NVML cannot reach it)"
        for xid in reading.xids:
            if xid in FATAL_XIDS:
                return f"{gpu} reported XID {xid} ({FATAL_XIDS[xid]})"
        return (self._check_ecc(state, reading, gpu)
                or self._check_thermal(state, reading, gpu, now_s))

    def recent_xids(self, cuda_index: int) -> list[int]:
        state = self._state.get(cuda_index)
        return list(state.recent_xids) if state is not None else []

    def _check_ecc(self, state: GpuFaultState, reading: GpuReading, gpu: str) -> str | None:
        count = reading.ecc_uncorrected
        if count is None:
            return None
        if state.ecc_uncorrected_baseline is None:
            state.ecc_uncorrected_baseline = count
            return None
        new = count - state.ecc_uncorrected_baseline
        if new > 0:
            return f"{gpu}: {new} new uncorrected (double-bit) ECC error(s)"
        return None

    def _check_thermal(self, state: GpuFaultState, reading: GpuReading, gpu: str,
                       now_s: float) -> str | None:
        temp, limit = reading.temperature_c, reading.slowdown_temperature_c
        is_hot = reading.is_thermal_throttled or (
            temp is not None and limit is not None and limit > 0 and temp >= limit)
        if not is_hot:
            state.hot_since_s = None
            return None
        if state.hot_since_s is None:
            state.hot_since_s = now_s
        held_s = now_s - state.hot_since_s
        if held_s < self.thermal_hold_s:
            return None
        figures = f"{temp:.0f} C" if temp is not None else "temperature unknown"
        if limit:
            figures += f", slowdown at {limit:.0f} C"
        if reading.is_thermal_throttled:
            figures += ", clocks thermally throttled"
        return f"{gpu} held its thermal limit for {held_s:.0f}s ({figures})"
