"""What this machine has for the runtime to work with: GPUs, their links, or just a CPU.

``device_info()`` returns a frozen ``DeviceInfo`` and never raises. It asks NVML (the
``nvidia-ml-py`` package, module ``pynvml``, imported lazily inside the call) for each GPU's name,
memory, compute capability, SM count, PCIe link, NVLinks, and for the link between each pair of
GPUs. Every NVML query stands alone: one that fails (``NVMLError_NotSupported``, a missing function
in an old driver, anything else) leaves its field ``None`` and the rest goes on. When there is no
GPU information at all -- ``pynvml`` is not importable, ``nvmlInit`` fails (no NVML library, no
driver), or NVML sees no GPU -- the result is the CPU branch: ``gpus == ()`` and ``reason`` says why.
The CPU fields (processor, logical cores, memory) are filled in both branches.

Concurrency: the call is synchronous and holds no state between calls. ``nvmlShutdown`` is called
exactly once after every successful ``nvmlInit`` (NVML reference-counts init/shutdown, so a caller
that holds its own NVML session is not disturbed).

Side effect to know about: when NVML cannot give a GPU's SM count, the fallback reads
``torch.cuda.get_device_properties``, which initialises CUDA in this process (a process that has
initialised CUDA cannot use CUDA in children it forks).

Fields, per GPU (``GpuInfo``):

=====================  ==========================  =============================================
field                  type                        from
=====================  ==========================  =============================================
index                  int                         NVML index
name                   str | None                  nvmlDeviceGetName
memory_bytes           int | None                  nvmlDeviceGetMemoryInfo(...).total
compute_capability     (int, int) | None           nvmlDeviceGetCudaComputeCapability
sm_count               int | None                  nvmlDeviceGetAttributes(...).multiprocessorCount,
                                                   else torch.cuda.get_device_properties
pci_bus_id             str | None                  nvmlDeviceGetPciInfo, as ``dddd:bb:dd.0``
pcie_gen / _width      int | None                  nvmlDeviceGetCurrPcieLinkGeneration / Width
pcie_gen_max / _width  int | None                  nvmlDeviceGetMaxPcieLinkGeneration / Width
nvlinks                tuple[NvLinkInfo, ...]      per link, see ``NvLinkInfo``
=====================  ==========================  =============================================
"""
from __future__ import annotations

import dataclasses
import os
import platform
from typing import Any, Callable, Optional

__all__ = [
    "DeviceInfo",
    "GpuInfo",
    "GpuPair",
    "NvLinkInfo",
    "NVLINK_GBPS_PER_LINK",
    "device_info",
]

GiB = 1 << 30

# [Note: NVLink bandwidth per link]
# GB/s (10^9 bytes/s) per link per direction, nominal line rate, by NVLink version. NVIDIA quotes
# per-GPU totals in both directions together; dividing by links and by 2 gives these numbers:
#   1.0 (P100):      20    -- 4 links, 160 GB/s bidirectional. hwloc hwloc/topology-nvml.c
#                            ("20GB/s for v1, and 25GB/s for v2+"), open-mpi/hwloc#574.
#   2.0 (V100):      25    -- 6 links, 300 GB/s bidirectional. open-mpi/hwloc#574.
#   2.2:             25    -- assumed like 2.0 (hwloc treats every v2+ link as 25 GB/s).
#   3.0 (A100):      25    -- 12 links, 600 GB/s bidirectional; "Each NVLink has a line rate of
#                            25GB/s (in each direction)" (NVIDIA, NVIDIA/nccl-tests#149);
#                            `nvidia-smi nvlink -s` on A100 shows 25 GB/s per link (nccl-tests#228).
#   3.1 (GA10x, sm_86: RTX 3090 / A6000 / A40): 14.0625 -- `nvidia-smi nvlink -s` on RTX A6000
#                            shows 14.062 GB/s per link (siboehm/bench gpu/nvlink/README.md).
#   4.0 (H100):      25    -- 18 links, 900 GB/s bidirectional; "v4 looks identical to v3"
#                            (open-mpi/hwloc#574). nvidia-smi shows 26.562 (raw signalling rate).
#   5.0 (B200/GB200): 50   -- 18 links, 1.8 TB/s bidirectional; nvidia-smi shows 53.125 GB/s per
#                            link on GB200 (NVIDIA/k8s-test-infra#371), twice H100's 26.562.
#   6.0: not tabled (bandwidth None) until checked.
# These are line rates: NCCL sees ~80% of them (NVIDIA/nccl#1054).
NVLINK_GBPS_PER_LINK: dict[str, float] = {
    "1.0": 20.0,
    "2.0": 25.0,
    "2.2": 25.0,
    "3.0": 25.0,
    "3.1": 14.0625,
    "4.0": 25.0,
    "5.0": 50.0,
}

# [Note: NVLink version from NVML]
# nvmlDeviceGetNvLinkVersion returns an ``nvmlNvlinkVersion_t`` enum, not the version number
# (open-mpi/hwloc#658; NVML docs fixed 2025): 1=1.0, 2=2.0, 3=2.2, 4=3.0, 5=3.1, 6=4.0, 7=5.0, 8=6.0.
# Drivers have been seen to report one step too high on datacenter parts: A100 returns 5
# (hwloc#658) and H100 returns NVML_NVLINK_VERSION_5_0 (a workaround in a public nccl benchmark
# script). Reading 7 as "5.0" would double H100's bandwidth, so where the compute capability pins
# the NVLink generation (the parts below), that generation wins; otherwise the enum is decoded.
_NVLINK_VERSION_BY_ENUM: dict[int, str] = {
    1: "1.0", 2: "2.0", 3: "2.2", 4: "3.0", 5: "3.1", 6: "4.0", 7: "5.0", 8: "6.0",
}
_NVLINK_VERSION_BY_COMPUTE_CAPABILITY: dict[tuple[int, int], str] = {
    (6, 0): "1.0",   # P100
    (7, 0): "2.0",   # V100
    (8, 0): "3.0",   # A100
    (8, 6): "3.1",   # GA10x: RTX 3090, A6000, A40
    (9, 0): "4.0",   # H100 / H200 / H800 / H20
    (10, 0): "5.0",  # B200 / GB200
}

# nvmlNvLinkDeviceType values (nvml.h).
_REMOTE_TYPE_NAMES: dict[int, str] = {0x00: "GPU", 0x01: "IBM NPU", 0x02: "NVSwitch", 0xFF: "unknown"}

# nvmlGpuTopologyLevel_t values (nvml.h), the closest common ancestor of two GPUs, nearest first
# (nvidia-smi topo -m spells them: -, PIX, PXB, PHB, NODE, SYS).
_TOPOLOGY_NAMES: dict[int, str] = {
    0: "same board",
    10: "single PCIe switch",
    20: "multiple PCIe switches",
    30: "PCIe host bridge",
    40: "same NUMA node",
    50: "across NUMA nodes (system)",
}
NVLINK = "NVLink"
NVLINK_SWITCH = "NVLink (NVSwitch)"


@dataclasses.dataclass(frozen=True)
class NvLinkInfo:
    """One NVLink of a GPU. ``gbps`` is GB/s per direction for this link (``NVLINK_GBPS_PER_LINK``, see
    [Note: NVLink bandwidth per link]);
    ``version`` is the NVLink generation (see [Note: NVLink version from NVML]). Inactive links
    carry only ``link`` and ``active``."""

    link: int
    active: bool
    remote_bus_id: Optional[str] = None
    remote_type: Optional[str] = None
    version: Optional[str] = None
    gbps: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML sees it; any field NVML could not give is ``None``."""

    index: int
    name: Optional[str] = None
    memory_bytes: Optional[int] = None
    compute_capability: Optional[tuple[int, int]] = None
    sm_count: Optional[int] = None
    pci_bus_id: Optional[str] = None
    pcie_gen: Optional[int] = None
    pcie_width: Optional[int] = None
    pcie_gen_max: Optional[int] = None
    pcie_width_max: Optional[int] = None
    nvlinks: tuple[NvLinkInfo, ...] = ()

    @property
    def active_nvlinks(self) -> tuple[NvLinkInfo, ...]:
        """The links that are up."""
        return tuple(link for link in self.nvlinks if link.active)


@dataclasses.dataclass(frozen=True)
class GpuPair:
    """How GPUs ``a < b`` reach each other.

    ``link_type``: ``"NVLink"`` (active links of one end go to the other's PCI bus id),
    ``"NVLink (NVSwitch)"`` (both have active links to the same NVSwitch), else the PCIe topology
    level's name (``"single PCIe switch"`` ...), or ``"unknown"``. ``nvlinks``: direct links
    between them (0 through a switch); ``nvlink_gbps``: GB/s per direction over NVLink, ``None``
    when not NVLink or a link's bandwidth is unknown. ``topology``: the PCIe level's name, whatever
    the link type.
    """

    a: int
    b: int
    link_type: str
    nvlinks: int = 0
    nvlink_gbps: Optional[float] = None
    topology: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """The machine: its CPU, and its GPUs with the links between each pair.

    ``gpus == ()`` is the CPU branch; ``reason`` then says why there is no GPU information
    (``None`` when there are GPUs).
    """

    processor: Optional[str]
    cpu_count: Optional[int]
    memory_bytes: Optional[int]
    gpus: tuple[GpuInfo, ...] = ()
    pairs: tuple[GpuPair, ...] = ()
    driver_version: Optional[str] = None
    reason: Optional[str] = None

    @property
    def interconnect(self) -> str:
        """``"CPU"`` without GPUs; ``"NVLink"`` when there are >= 2 GPUs and every pair has NVLink
        (direct or through NVSwitch); else ``"PCIe"`` (one GPU, or some pair without NVLink)."""
        if not self.gpus:
            return "CPU"
        if len(self.gpus) >= 2 and all(p.link_type in (NVLINK, NVLINK_SWITCH) for p in self.pairs):
            return "NVLink"
        return "PCIe"

    def describe(self) -> str:
        """A few human-readable lines: the CPU, each GPU, each pair, and the interconnect."""
        lines = [
            f"CPU: {self.processor or '?'}, {_fmt(self.cpu_count)} logical cores, "
            f"{_fmt_bytes(self.memory_bytes)} memory"
        ]
        if not self.gpus:
            lines.append(f"GPU: none ({self.reason or 'no reason given'})")
        else:
            if self.driver_version:
                lines.append(f"NVIDIA driver {self.driver_version}")
            lines.extend(_describe_gpu(gpu) for gpu in self.gpus)
            lines.extend(_describe_pair(pair) for pair in self.pairs)
        lines.append(f"interconnect: {self.interconnect}")
        return "\n".join(lines)


def device_info() -> DeviceInfo:
    """Describe this machine (see the module docstring). Never raises."""
    cpu = _cpu_fields()
    try:
        return _gpu_info(cpu)
    except Exception as err:  # the contract is "never raises": report instead
        return DeviceInfo(**cpu, reason=f"device_info failed: {type(err).__name__}: {err}")


# --------------------------------------------------------------------------------------- CPU


def _cpu_fields() -> dict[str, Any]:
    return {"processor": _processor_name(), "cpu_count": os.cpu_count(), "memory_bytes": _memory_bytes()}


def _processor_name() -> Optional[str]:
    """/proc/cpuinfo "model name" (x86; "Hardware"/"Processor"/"cpu model" elsewhere), else platform."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            fields: dict[str, str] = {}
            for line in f:
                key, sep, value = line.partition(":")
                if sep and value.strip():
                    fields.setdefault(key.strip().lower(), value.strip())
        for key in ("model name", "hardware", "processor", "cpu model"):
            # "processor" on x86 is the core number; only take it if it is not a number.
            value = fields.get(key)
            if value and not value.isdigit():
                return value
    except Exception:
        pass
    try:
        return platform.processor() or platform.machine() or None
    except Exception:
        return None


def _memory_bytes() -> Optional[int]:
    """MemTotal from /proc/meminfo, else physical pages * page size."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    value, unit = line.split()[1:3]
                    return int(value) * (1024 if unit.lower() == "kb" else 1)
    except Exception:
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except Exception:
        return None


# --------------------------------------------------------------------------------------- NVML


def _gpu_info(cpu: dict[str, Any]) -> DeviceInfo:
    try:
        import pynvml as nvml
    except Exception as err:  # ImportError, or a broken install
        return DeviceInfo(**cpu, reason=f"NVML not available: pynvml not importable: {err}")
    try:
        nvml.nvmlInit()
    except Exception as err:
        return DeviceInfo(**cpu, reason=f"NVML not available: {_err(err)}")
    try:
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as err:
            return DeviceInfo(**cpu, reason=f"NVML not available: nvmlDeviceGetCount failed: {_err(err)}")
        if count <= 0:
            return DeviceInfo(**cpu, reason="NVML found no GPUs")
        handles = [_call(nvml, "nvmlDeviceGetHandleByIndex", i) for i in range(count)]
        sm_fallback = _TorchSmCounts(count)
        gpus = tuple(_one_gpu(nvml, i, handle, sm_fallback) for i, handle in enumerate(handles))
        pairs = tuple(
            _pair(nvml, gpus[a], gpus[b], handles[a], handles[b])
            for a in range(count) for b in range(a + 1, count)
        )
        driver = _call(nvml, "nvmlSystemGetDriverVersion")
        return DeviceInfo(**cpu, gpus=gpus, pairs=pairs, driver_version=_text(driver))
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _call(nvml: Any, name: str, *args: Any) -> Any:
    """``nvml.<name>(*args)``, or ``None`` if the function is missing or raises (NVMLError_*:
    NotSupported, NoPermission, ...; ctypes errors from an old library). One field, one call."""
    fn: Optional[Callable[..., Any]] = getattr(nvml, name, None)
    if fn is None:
        return None
    try:
        return fn(*args)
    except Exception:
        return None


def _one_gpu(nvml: Any, index: int, handle: Any, sm_fallback: "_TorchSmCounts") -> GpuInfo:
    if handle is None:
        return GpuInfo(index=index)
    memory = _call(nvml, "nvmlDeviceGetMemoryInfo", handle)
    cc = _call(nvml, "nvmlDeviceGetCudaComputeCapability", handle)
    compute_capability = _int_pair(cc)
    bus_id = _bus_id(_call(nvml, "nvmlDeviceGetPciInfo", handle))
    attrs = _call(nvml, "nvmlDeviceGetAttributes", handle)
    sm_count = _int(getattr(attrs, "multiprocessorCount", None))
    if not sm_count:  # 0 or None: NVML could not say
        sm_count = sm_fallback.get(index, bus_id)
    return GpuInfo(
        index=index,
        name=_text(_call(nvml, "nvmlDeviceGetName", handle)),
        memory_bytes=_int(getattr(memory, "total", None)),
        compute_capability=compute_capability,
        sm_count=sm_count,
        pci_bus_id=bus_id,
        pcie_gen=_int(_call(nvml, "nvmlDeviceGetCurrPcieLinkGeneration", handle)),
        pcie_width=_int(_call(nvml, "nvmlDeviceGetCurrPcieLinkWidth", handle)),
        pcie_gen_max=_int(_call(nvml, "nvmlDeviceGetMaxPcieLinkGeneration", handle)),
        pcie_width_max=_int(_call(nvml, "nvmlDeviceGetMaxPcieLinkWidth", handle)),
        nvlinks=_nvlinks(nvml, handle, compute_capability),
    )


def _nvlinks(nvml: Any, handle: Any, compute_capability: Optional[tuple[int, int]]) -> tuple[NvLinkInfo, ...]:
    """Links 0, 1, ... up to the first whose state NVML cannot give (a GPU without NVLink fails on
    link 0; H100 on link 18 of NVML_NVLINK_MAX_LINKS), as hwloc's NVML backend does."""
    max_links = _int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", None)) or 18
    enabled = getattr(nvml, "NVML_FEATURE_ENABLED", 1)
    links = []
    for link in range(max_links):
        state = _call(nvml, "nvmlDeviceGetNvLinkState", handle, link)
        if state is None:
            break
        if state != enabled:
            links.append(NvLinkInfo(link=link, active=False))
            continue
        version = _nvlink_version(_call(nvml, "nvmlDeviceGetNvLinkVersion", handle, link), compute_capability)
        remote_type = _int(_call(nvml, "nvmlDeviceGetNvLinkRemoteDeviceType", handle, link))
        links.append(NvLinkInfo(
            link=link,
            active=True,
            remote_bus_id=_bus_id(_call(nvml, "nvmlDeviceGetNvLinkRemotePciInfo", handle, link)),
            remote_type=None if remote_type is None else _REMOTE_TYPE_NAMES.get(remote_type, "unknown"),
            version=version,
            gbps=NVLINK_GBPS_PER_LINK.get(version) if version else None,
        ))
    return tuple(links)


def _nvlink_version(reported: Any, compute_capability: Optional[tuple[int, int]]) -> Optional[str]:
    """See [Note: NVLink version from NVML]."""
    pinned = _NVLINK_VERSION_BY_COMPUTE_CAPABILITY.get(compute_capability) if compute_capability else None
    if pinned is not None and _int(reported):  # 0 is NVML_NVLINK_VERSION_INVALID
        return pinned
    return _NVLINK_VERSION_BY_ENUM.get(_int(reported))  # type: ignore[arg-type]


def _pair(nvml: Any, a: GpuInfo, b: GpuInfo, handle_a: Any, handle_b: Any) -> GpuPair:
    level = None
    if handle_a is not None and handle_b is not None:
        level = _int(_call(nvml, "nvmlDeviceGetTopologyCommonAncestor", handle_a, handle_b))
    topology = None if level is None else _TOPOLOGY_NAMES.get(level, f"topology level {level}")

    a_to_b = [link for link in a.active_nvlinks if b.pci_bus_id and link.remote_bus_id == b.pci_bus_id]
    b_to_a = [link for link in b.active_nvlinks if a.pci_bus_id and link.remote_bus_id == a.pci_bus_id]
    direct = a_to_b if len(a_to_b) >= len(b_to_a) else b_to_a  # the same wires, seen from either end
    if direct:
        return GpuPair(a.index, b.index, NVLINK, nvlinks=len(direct), nvlink_gbps=_sum_gbps(direct),
                       topology=topology)

    a_switch = _switch_links(a)
    b_switch = _switch_links(b)
    shared = {link.remote_bus_id for link in a_switch} & {link.remote_bus_id for link in b_switch}
    if shared:
        gbps_a, gbps_b = _sum_gbps(a_switch), _sum_gbps(b_switch)
        gbps = None if gbps_a is None or gbps_b is None else min(gbps_a, gbps_b)
        return GpuPair(a.index, b.index, NVLINK_SWITCH, nvlinks=0, nvlink_gbps=gbps, topology=topology)

    return GpuPair(a.index, b.index, topology or "unknown", topology=topology)


def _switch_links(gpu: GpuInfo) -> list[NvLinkInfo]:
    return [link for link in gpu.active_nvlinks if link.remote_type == "NVSwitch" and link.remote_bus_id]


def _sum_gbps(links: list[NvLinkInfo]) -> Optional[float]:
    if any(link.gbps is None for link in links):
        return None
    return float(sum(link.gbps for link in links))  # type: ignore[misc]


class _TorchSmCounts:
    """SM counts from ``torch.cuda.get_device_properties``, for GPUs whose NVML attributes fail.

    NVML and CUDA number GPUs differently (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER), so a CUDA
    device is matched by PCI bus id where torch exposes it; by index only when torch exposes no bus
    ids, sees as many GPUs as NVML, and CUDA_VISIBLE_DEVICES is unset. Read once, on first need.
    """

    def __init__(self, nvml_count: int) -> None:
        self._nvml_count = nvml_count
        self._by_bus: Optional[dict[str, int]] = None
        self._by_index: Optional[list[Optional[int]]] = None

    def get(self, index: int, bus_id: Optional[str]) -> Optional[int]:
        if self._by_bus is None:
            self._load()
        assert self._by_bus is not None
        if bus_id is not None and bus_id in self._by_bus:
            return self._by_bus[bus_id]
        if self._by_index is not None and index < len(self._by_index):
            return self._by_index[index]
        return None

    def _load(self) -> None:
        self._by_bus = {}
        try:
            import torch

            if not torch.cuda.is_available():
                return
            props = [torch.cuda.get_device_properties(d) for d in range(torch.cuda.device_count())]
        except Exception:
            return
        for p in props:
            bus = _bus_id_from_ints(getattr(p, "pci_domain_id", None), getattr(p, "pci_bus_id", None),
                                    getattr(p, "pci_device_id", None))
            count = _int(getattr(p, "multi_processor_count", None))
            if bus is not None and count:
                self._by_bus[bus] = count
        if not self._by_bus and len(props) == self._nvml_count and "CUDA_VISIBLE_DEVICES" not in os.environ:
            self._by_index = [_int(getattr(p, "multi_processor_count", None)) for p in props]


# --------------------------------------------------------------------------------------- helpers


def _bus_id(pci: Any) -> Optional[str]:
    """An ``nvmlPciInfo_t`` as ``dddd:bb:dd.0`` (NVML's busId has 8 or 4 domain digits; the
    integer fields are unambiguous, the string is the fallback)."""
    if pci is None:
        return None
    from_ints = _bus_id_from_ints(getattr(pci, "domain", None), getattr(pci, "bus", None),
                                  getattr(pci, "device", None))
    if from_ints is not None:
        return from_ints
    text = _text(getattr(pci, "busId", None))
    if not text:
        return None
    try:
        domain, bus, rest = text.strip().lower().split(":")
        device = rest.split(".")[0]
        return _bus_id_from_ints(int(domain, 16), int(bus, 16), int(device, 16))
    except Exception:
        return text.strip().lower()


def _bus_id_from_ints(domain: Any, bus: Any, device: Any) -> Optional[str]:
    domain, bus, device = _int(domain), _int(bus), _int(device)
    if domain is None or bus is None or device is None:
        return None
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def _int(value: Any) -> Optional[int]:
    try:
        return None if value is None else int(value)
    except Exception:
        return None


def _int_pair(value: Any) -> Optional[tuple[int, int]]:
    try:
        major, minor = value
        return int(major), int(minor)
    except Exception:
        return None


def _text(value: Any) -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _err(err: BaseException) -> str:
    try:
        text = str(err)
    except Exception:  # NVMLError.__str__ itself calls into NVML
        text = ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _fmt(value: Any) -> str:
    return "?" if value is None else str(value)


def _fmt_bytes(value: Optional[int]) -> str:
    return "?" if value is None else f"{value / GiB:.1f} GiB"


def _describe_gpu(gpu: GpuInfo) -> str:
    cc = f"sm_{gpu.compute_capability[0]}{gpu.compute_capability[1]}" if gpu.compute_capability else "sm_?"
    pcie = (f"PCIe gen{_fmt(gpu.pcie_gen)} x{_fmt(gpu.pcie_width)} "
            f"(max gen{_fmt(gpu.pcie_gen_max)} x{_fmt(gpu.pcie_width_max)})")
    text = (f"GPU {gpu.index}: {gpu.name or '?'}, {_fmt_bytes(gpu.memory_bytes)}, {cc}, "
            f"{_fmt(gpu.sm_count)} SMs, {gpu.pci_bus_id or '?'}, {pcie}")
    active = gpu.active_nvlinks
    if active:
        versions = sorted({link.version for link in active if link.version})
        gbps = _sum_gbps(list(active))
        text += (f", NVLink {'/'.join(versions) or '?'}: {len(active)}/{len(gpu.nvlinks)} links up"
                 f" ({'?' if gbps is None else f'{gbps:g}'} GB/s per direction)")
    return text


def _describe_pair(pair: GpuPair) -> str:
    text = f"GPU {pair.a} <-> GPU {pair.b}: {pair.link_type}"
    if pair.nvlinks:
        text += f" x{pair.nvlinks}"
    if pair.link_type in (NVLINK, NVLINK_SWITCH):
        text += f" ({'?' if pair.nvlink_gbps is None else f'{pair.nvlink_gbps:g}'} GB/s per direction)"
        if pair.topology:
            text += f"; PCIe: {pair.topology}"
    return text
