"""``overlap.device_info``: the real call on this machine, and NVML mocked as a fake ``pynvml``.

The fake module is put in ``sys.modules["pynvml"]``; ``device_info`` imports ``pynvml`` inside the
call, so it picks the fake up. Every fake function counts its calls, so tests can check that
``nvmlShutdown`` runs exactly once after a successful ``nvmlInit``.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import sys
import types
from typing import Any, Optional

import pytest
import torch

from overlap.device_info import NVLINK_GBPS_PER_LINK, DeviceInfo, device_info

H100_MEMORY = 80 * (1 << 30)
BUS = {0: (0, 0x18, 0), 1: (0, 0x2A, 0)}  # (domain, bus, device) of GPU 0 and GPU 1
SWITCH_BUS = [(0, 0xC0 + s, 0) for s in range(4)]


class FakeNVMLError(Exception):
    """Stands in for ``pynvml.NVMLError``."""


class FakeNotSupported(FakeNVMLError):
    """Stands in for ``pynvml.NVMLError_NotSupported``."""

    def __str__(self) -> str:
        return "Not Supported"


def pci(domain: int, bus: int, device: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(domain=domain, bus=bus, device=device,
                                 busId=f"{domain:08X}:{bus:02X}:{device:02X}.0".encode())


def h100(**overrides: Any) -> dict[str, Any]:
    spec = dict(name="NVIDIA H100 80GB HBM3", memory=H100_MEMORY, cc=(9, 0), sms=132,
                pcie=(5, 16, 5, 16), links=[], version=6)
    spec.update(overrides)
    return spec


def make_nvml(gpus: list[dict[str, Any]], *, topology: int = 20, init_error: Optional[Exception] = None,
              not_supported: tuple[str, ...] = (), count_error: Optional[Exception] = None) -> types.ModuleType:
    """A fake ``pynvml`` for ``gpus``. Each GPU spec: name, memory, cc, sms, pcie (cur gen, cur width,
    max gen, max width), links (list of (remote (domain, bus, device), remote type)), version (the
    NVML enum every link reports). Functions named in ``not_supported`` raise NotSupported."""
    mod = types.ModuleType("pynvml")
    calls: collections.Counter = collections.Counter()
    mod.calls = calls  # type: ignore[attr-defined]
    mod.NVMLError = FakeNVMLError  # type: ignore[attr-defined]
    mod.NVMLError_NotSupported = FakeNotSupported  # type: ignore[attr-defined]
    mod.NVML_NVLINK_MAX_LINKS = 36  # type: ignore[attr-defined]
    mod.NVML_FEATURE_ENABLED = 1  # type: ignore[attr-defined]

    def fake(fn):
        def wrapper(*args):
            calls[fn.__name__] += 1
            if fn.__name__ in not_supported:
                raise FakeNotSupported()
            return fn(*args)
        wrapper.__name__ = fn.__name__
        setattr(mod, fn.__name__, wrapper)
        return wrapper

    def link_of(handle: int, link: int) -> tuple:
        links = gpus[handle]["links"]
        if link >= len(links):
            raise FakeNVMLError("Invalid Argument")
        return links[link]

    @fake
    def nvmlInit():
        if init_error is not None:
            raise init_error

    @fake
    def nvmlShutdown():
        pass

    @fake
    def nvmlDeviceGetCount():
        if count_error is not None:
            raise count_error
        return len(gpus)

    @fake
    def nvmlSystemGetDriverVersion():
        return "580.65.06"

    @fake
    def nvmlDeviceGetHandleByIndex(i):
        return i

    @fake
    def nvmlDeviceGetName(h):
        return gpus[h]["name"]

    @fake
    def nvmlDeviceGetMemoryInfo(h):
        return types.SimpleNamespace(total=gpus[h]["memory"], free=gpus[h]["memory"], used=0)

    @fake
    def nvmlDeviceGetCudaComputeCapability(h):
        return gpus[h]["cc"]

    @fake
    def nvmlDeviceGetAttributes(h):
        return types.SimpleNamespace(multiprocessorCount=gpus[h]["sms"])

    @fake
    def nvmlDeviceGetPciInfo(h):
        return pci(*BUS[h])

    @fake
    def nvmlDeviceGetCurrPcieLinkGeneration(h):
        return gpus[h]["pcie"][0]

    @fake
    def nvmlDeviceGetCurrPcieLinkWidth(h):
        return gpus[h]["pcie"][1]

    @fake
    def nvmlDeviceGetMaxPcieLinkGeneration(h):
        return gpus[h]["pcie"][2]

    @fake
    def nvmlDeviceGetMaxPcieLinkWidth(h):
        return gpus[h]["pcie"][3]

    @fake
    def nvmlDeviceGetNvLinkState(h, link):
        link_of(h, link)
        return 1

    @fake
    def nvmlDeviceGetNvLinkRemotePciInfo(h, link):
        return pci(*link_of(h, link)[0])

    @fake
    def nvmlDeviceGetNvLinkRemoteDeviceType(h, link):
        return link_of(h, link)[1]

    @fake
    def nvmlDeviceGetNvLinkVersion(h, link):
        link_of(h, link)
        return gpus[h]["version"]

    @fake
    def nvmlDeviceGetTopologyCommonAncestor(h1, h2):
        return topology

    return mod


@pytest.fixture
def use_nvml(monkeypatch):
    """``use_nvml(fake)``: make ``import pynvml`` return ``fake``; CUDA reads as absent, so the
    torch SM-count fallback is off unless a test turns it on."""

    def install(fake: types.ModuleType) -> types.ModuleType:
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        return fake

    return install


def two_h100_nvlink(version: int = 6) -> list[dict[str, Any]]:
    return [h100(links=[(BUS[1], 0)] * 18, version=version), h100(links=[(BUS[0], 0)] * 18, version=version)]


# ------------------------------------------------------------------------------------ real call


def test_real_call_returns_without_raising():
    info = device_info()
    assert isinstance(info, DeviceInfo)
    assert info.cpu_count == os.cpu_count()
    assert info.memory_bytes is not None and info.memory_bytes > 0
    assert "CPU" in info.describe()
    if not info.gpus:  # this machine: no NVML library
        assert info.reason is not None and "NVML" in info.reason
        assert info.pairs == ()
        assert info.interconnect == "CPU"
        assert "GPU: none" in info.describe()
    else:
        assert info.reason is None


def test_result_is_frozen():
    info = device_info()
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.gpus = ()  # type: ignore[misc]


# ------------------------------------------------------------------------------------ GPU branch


def test_two_h100_with_nvlink(use_nvml):
    fake = use_nvml(make_nvml(two_h100_nvlink()))
    info = device_info()

    assert info.reason is None and info.driver_version == "580.65.06"
    assert len(info.gpus) == 2
    for index, gpu in enumerate(info.gpus):
        assert gpu.index == index
        assert gpu.name == "NVIDIA H100 80GB HBM3"
        assert gpu.memory_bytes == H100_MEMORY
        assert gpu.compute_capability == (9, 0)
        assert gpu.sm_count == 132
        assert (gpu.pcie_gen, gpu.pcie_width, gpu.pcie_gen_max, gpu.pcie_width_max) == (5, 16, 5, 16)
        assert len(gpu.nvlinks) == 18 and len(gpu.active_nvlinks) == 18
        assert [link.link for link in gpu.nvlinks] == list(range(18))
        assert all(link.version == "4.0" and link.gbps == 25.0 and link.remote_type == "GPU"
                   for link in gpu.nvlinks)
    assert info.gpus[0].pci_bus_id == "0000:18:00.0"
    assert {link.remote_bus_id for link in info.gpus[0].nvlinks} == {"0000:2a:00.0"}
    assert {link.remote_bus_id for link in info.gpus[1].nvlinks} == {"0000:18:00.0"}

    (pair,) = info.pairs
    assert (pair.a, pair.b, pair.link_type, pair.nvlinks) == (0, 1, "NVLink", 18)
    assert pair.nvlink_gbps == 18 * 25.0
    assert pair.topology == "multiple PCIe switches"

    assert info.interconnect == "NVLink"
    text = info.describe()
    assert text.count("NVIDIA H100 80GB HBM3") == 2
    assert "GPU 0 <-> GPU 1: NVLink x18 (450 GB/s per direction)" in text
    assert fake.calls["nvmlInit"] == 1 and fake.calls["nvmlShutdown"] == 1


def test_nvlink_version_pinned_by_compute_capability(use_nvml):
    """H100 drivers have reported NVML_NVLINK_VERSION_5_0 (7): sm_90 still means NVLink 4, 25 GB/s."""
    use_nvml(make_nvml(two_h100_nvlink(version=7)))
    info = device_info()
    assert {link.version for gpu in info.gpus for link in gpu.nvlinks} == {"4.0"}
    assert info.pairs[0].nvlink_gbps == 450.0


def test_nvlink_version_decoded_from_enum_for_unpinned_parts(use_nvml):
    gpus = two_h100_nvlink(version=7)
    for gpu in gpus:
        gpu["cc"] = (12, 0)  # not in the pinned table: the enum decides, 7 = NVLink 5.0
    use_nvml(make_nvml(gpus))
    info = device_info()
    assert {link.version for link in info.gpus[0].nvlinks} == {"5.0"}
    assert info.pairs[0].nvlink_gbps == 18 * NVLINK_GBPS_PER_LINK["5.0"]


def test_pcie_only_pair(use_nvml):
    gpus = [h100(name="NVIDIA H100 PCIe", pcie=(4, 8, 5, 16)), h100(name="NVIDIA H100 PCIe")]
    fake = use_nvml(make_nvml(gpus, topology=30, not_supported=("nvmlDeviceGetNvLinkState",)))
    info = device_info()
    assert all(gpu.nvlinks == () for gpu in info.gpus)
    assert (info.gpus[0].pcie_gen, info.gpus[0].pcie_width) == (4, 8)
    assert (info.gpus[0].pcie_gen_max, info.gpus[0].pcie_width_max) == (5, 16)
    (pair,) = info.pairs
    assert pair.link_type == "PCIe host bridge" and pair.nvlinks == 0 and pair.nvlink_gbps is None
    assert info.interconnect == "PCIe"
    assert "GPU 0 <-> GPU 1: PCIe host bridge" in info.describe()
    assert fake.calls["nvmlShutdown"] == 1


@pytest.mark.parametrize("level, name", [(0, "same board"), (10, "single PCIe switch"),
                                         (20, "multiple PCIe switches"), (40, "same NUMA node"),
                                         (50, "across NUMA nodes (system)"), (99, "topology level 99")])
def test_topology_names(use_nvml, level, name):
    use_nvml(make_nvml([h100(), h100()], topology=level))
    assert device_info().pairs[0].link_type == name


def test_nvswitch_pair(use_nvml):
    links = [(SWITCH_BUS[i % 4], 2) for i in range(18)]  # HGX: every link goes to an NVSwitch
    use_nvml(make_nvml([h100(links=links), h100(links=links)]))
    info = device_info()
    (pair,) = info.pairs
    assert pair.link_type == "NVLink (NVSwitch)" and pair.nvlinks == 0 and pair.nvlink_gbps == 450.0
    assert info.gpus[0].nvlinks[0].remote_type == "NVSwitch"
    assert info.interconnect == "NVLink"


def test_single_gpu_is_pcie(use_nvml):
    use_nvml(make_nvml([h100()], not_supported=("nvmlDeviceGetNvLinkState",)))
    info = device_info()
    assert len(info.gpus) == 1 and info.pairs == ()
    assert info.interconnect == "PCIe"


def test_unsupported_calls_leave_fields_none(use_nvml):
    unsupported = ("nvmlDeviceGetAttributes", "nvmlDeviceGetCudaComputeCapability",
                   "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetCurrPcieLinkGeneration",
                   "nvmlDeviceGetMaxPcieLinkWidth", "nvmlDeviceGetNvLinkVersion",
                   "nvmlDeviceGetNvLinkRemoteDeviceType", "nvmlDeviceGetTopologyCommonAncestor",
                   "nvmlSystemGetDriverVersion")
    fake = use_nvml(make_nvml(two_h100_nvlink(), not_supported=unsupported))
    info = device_info()
    gpu = info.gpus[0]
    assert gpu.name == "NVIDIA H100 80GB HBM3"
    assert gpu.sm_count is None and gpu.compute_capability is None and gpu.memory_bytes is None
    assert gpu.pcie_gen is None and gpu.pcie_width == 16 and gpu.pcie_gen_max == 5 and gpu.pcie_width_max is None
    assert len(gpu.active_nvlinks) == 18
    assert all(link.version is None and link.gbps is None and link.remote_type is None for link in gpu.nvlinks)
    (pair,) = info.pairs
    assert pair.link_type == "NVLink" and pair.nvlinks == 18 and pair.nvlink_gbps is None
    assert pair.topology is None and info.driver_version is None
    text = info.describe()
    assert "NVIDIA H100 80GB HBM3" in text and "? SMs" in text
    assert fake.calls["nvmlShutdown"] == 1


def test_unsupported_pair_topology_without_nvlink_is_unknown(use_nvml):
    use_nvml(make_nvml([h100(), h100()], not_supported=(
        "nvmlDeviceGetNvLinkState", "nvmlDeviceGetTopologyCommonAncestor")))
    assert device_info().pairs[0].link_type == "unknown"


def test_every_device_call_unsupported_still_returns(use_nvml):
    names = [n for n in dir(make_nvml([])) if n.startswith("nvmlDevice") and n != "nvmlDeviceGetCount"]
    fake = use_nvml(make_nvml([h100(), h100()], not_supported=tuple(names)))
    info = device_info()
    assert [gpu.index for gpu in info.gpus] == [0, 1]
    assert info.gpus[0] == type(info.gpus[0])(index=0)
    assert info.pairs[0].link_type == "unknown"
    assert fake.calls["nvmlShutdown"] == 1


def test_sm_count_falls_back_to_torch_matched_by_pci_bus(use_nvml, monkeypatch):
    fake = use_nvml(make_nvml([h100(sms=132), h100(sms=114)], not_supported=("nvmlDeviceGetAttributes",)))
    # CUDA enumerates the GPUs in the other order: matching must go by PCI bus id, not index.
    props = [types.SimpleNamespace(multi_processor_count=114, pci_domain_id=0, pci_bus_id=0x2A, pci_device_id=0),
             types.SimpleNamespace(multi_processor_count=132, pci_domain_id=0, pci_bus_id=0x18, pci_device_id=0)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props[d])
    info = device_info()
    assert [gpu.sm_count for gpu in info.gpus] == [132, 114]
    assert fake.calls["nvmlShutdown"] == 1


def test_unexpected_error_never_raises(use_nvml, monkeypatch):
    fake = use_nvml(make_nvml(two_h100_nvlink()))
    monkeypatch.setattr(DeviceInfo, "__init__", _boom_once(DeviceInfo.__init__))
    info = device_info()
    assert info.gpus == () and "device_info failed" in (info.reason or "")
    assert fake.calls["nvmlShutdown"] == 1


def _boom_once(init):
    state = {"raised": False}

    def wrapped(self, *args, **kwargs):
        if not state["raised"]:
            state["raised"] = True
            raise RuntimeError("boom")
        init(self, *args, **kwargs)

    return wrapped


# ------------------------------------------------------------------------------------ CPU branch


def test_init_failure_gives_cpu_branch(use_nvml):
    fake = use_nvml(make_nvml([h100()], init_error=FakeNVMLError("Driver Not Loaded")))
    info = device_info()
    assert info.gpus == () and info.pairs == ()
    assert info.reason is not None and "NVML not available" in info.reason and "Driver Not Loaded" in info.reason
    assert info.cpu_count == os.cpu_count()
    assert info.interconnect == "CPU"
    assert fake.calls["nvmlShutdown"] == 0  # init failed: nothing to shut down


def test_zero_gpus_gives_cpu_branch(use_nvml):
    fake = use_nvml(make_nvml([]))
    info = device_info()
    assert info.gpus == () and "no GPUs" in (info.reason or "")
    assert fake.calls["nvmlInit"] == 1 and fake.calls["nvmlShutdown"] == 1


def test_count_failure_gives_cpu_branch(use_nvml):
    fake = use_nvml(make_nvml([h100()], count_error=FakeNVMLError("Unknown Error")))
    info = device_info()
    assert info.gpus == () and "NVML" in (info.reason or "") and "Unknown Error" in (info.reason or "")
    assert fake.calls["nvmlShutdown"] == 1


def test_pynvml_not_importable_gives_cpu_branch(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    info = device_info()
    assert info.gpus == () and "pynvml" in (info.reason or "") and "NVML" in (info.reason or "")
    assert "CPU" in info.describe()
