"""Weights reach GPU memory through pinned staging buffers (runtime/c/drv_gpu.c g_h2d), on the fake CUDA and
HIP drivers, which run a copy from pinned memory later (when something waits for it) and read its source
then, as a GPU's DMA does:

* a shard of weights larger than both staging buffers together, read by the load's chunk reader
  (`MappedWeights.chunks`) and written piece by piece, lands byte for byte;
* every byte written from the first large write on is copied from pinned memory, and none before it;
* the upload does not synchronise the stream; it waits for a staging buffer's event once per buffer
  filled, not once per write, and its last copies are still in flight when it returns (the overlap);
* a runtime that refills a staging buffer without waiting for its event uploads wrong bytes, which the
  same comparison catches; one that frees device memory with copies still landing in it is refused and
  leaks, which the same accounting catches;
* a failed pinned allocation is one clear error naming the driver call, with nothing leaked.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from runtime_helpers import Fake, runtime_variant
from v4compile.errors import DeviceError
from v4compile.runtime.c_backend import ABI_VERSION, HOST_KERNEL, load_library
from v4compile.runtime.schedule import Schedule
from v4compile.safetensors_io import write_file
from v4compile.weights_map import MappedWeights

DRIVERS = ("cuda", "hip")
STAGE_BYTES, STAGE_MIN = 16 << 20, 1 << 20  # drv_gpu.h's defaults (V4RT_STAGE_BYTES, V4RT_STAGE_MIN)
CHUNK = 8 << 20  # the reader's chunk (weights_map.CHUNK_BYTES)
# float32 element counts, in file order: small ones before the first large one (pageable copies), one
# larger than both staging buffers together, small ones between large ones, odd sizes throughout
SIZES = {"a0": 3, "a1": 70_001, "b_big": 11_000_003, "c0": 5, "c1": 400_001, "d": 2_500_000, "e": 1}


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    d = tmp_path_factory.mktemp("staged")
    g = torch.Generator().manual_seed(25)
    tensors = {n: torch.randn(k, generator=g) for n, k in SIZES.items()}
    write_file(d / "w.safetensors", tensors)
    return d, tensors


class Device:
    """A runtime on a fake driver with one weight buffer per tensor, written through the C ABI."""

    def __init__(self, driver: str, fake: Fake, tensors: dict[str, torch.Tensor], lib=None):
        self.lib, self.names = lib or load_library(), list(tensors)
        nbytes = [t.numel() * 4 for t in tensors.values()]
        table = Schedule(self.names, ["weight"] * len(nbytes), nbytes, [256] * len(nbytes), [], []).to_bytes()
        self.handle = ctypes.c_void_p()
        self.check(self.lib.v4rt_open(ABI_VERSION, driver.encode(), fake.path.encode(), table, len(table),
                                      HOST_KERNEL(), None, ctypes.byref(self.handle)), "open")

    def check(self, rc: int, what: str) -> None:
        if rc:
            raise DeviceError(f"{what}: {self.lib.v4rt_last_error().decode()}")

    def upload(self, d) -> list[int]:
        """Every tensor of the shard in `d`, in the reader's pieces (CRuntime._upload's calls); their sizes."""
        w = MappedWeights(d, {n: {"shard": "w.safetensors", "dtype": "fp32", "shape": [k]} for n, k in SIZES.items()},
                          DeviceError)
        sizes = []
        try:
            for name, off, buf, start, n in w.chunks(size=CHUNK):
                ptr = ctypes.addressof(ctypes.c_char.from_buffer(buf, start))
                self.check(self.lib.v4rt_write(self.handle, self.names.index(name), off, ptr, n), f"writing {name}")
                sizes.append(n)
        finally:
            w.close()
        return sizes

    def read(self, name: str, nbytes: int) -> torch.Tensor:
        out = torch.empty(nbytes, dtype=torch.uint8)
        self.check(self.lib.v4rt_read(self.handle, self.names.index(name), 0, out.data_ptr(), nbytes), "read")
        return out

    def wrong(self, tensors) -> list[str]:
        """The buffers whose bytes are not their tensor's."""
        return [n for n, t in tensors.items() if not torch.equal(self.read(n, t.numel() * 4), t.view(torch.uint8))]

    def close(self) -> None:
        self.lib.v4rt_close(self.handle)


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_staged_upload_lands_every_byte_with_the_copies_in_flight(driver, shard):
    d, tensors = shard
    fake = Fake(driver)
    dev = Device(driver, fake, tensors)
    sizes = dev.upload(d)
    c = fake.copies()
    first = next(i for i, n in enumerate(sizes) if n >= STAGE_MIN)
    staged = sum(sizes[first:])
    assert first > 0 and staged > 2 * STAGE_BYTES and len(sizes) > 8
    assert c["pageable_bytes"] == sum(sizes[:first]) and c["pageable"] == first
    assert c["pinned_bytes"] == staged
    assert c["stream_syncs"] == 0 and c["waited"] == 0
    assert c["event_syncs"] == -(-staged // STAGE_BYTES) - 1 < len(sizes) - first  # once per buffer filled
    assert c["queued"] > 0 and c["pinned_live"] == 2 == c["events_live"]  # the last copies still in flight
    assert dev.wrong(tensors) == []
    c = fake.copies()
    assert c["queued"] == 0 and c["stream_syncs"] == len(tensors) * 2  # each read: before and after its copy
    dev.close()
    c, n = fake.copies(), fake.counts()
    assert c["pinned_live"] == c["events_live"] == n["live"] == 0 and n["frees"] == n["allocs"]


WAIT = "            CK(g, event_sync, g->event_sync(g->stage_done[next])); /* (a failure leaves it full: no refill) */\n"
FREE = "    if (g->pending && drain(g)) return 1;\n    return g->api->mem_free(g, addr);"


@pytest.mark.parametrize("driver", DRIVERS)
def test_refilling_a_staging_buffer_without_its_event_uploads_wrong_bytes(driver, shard):
    d, tensors = shard
    fake = Fake(driver)
    dev = Device(driver, fake, tensors, lib=load_library(runtime_variant(edit=("drv_gpu.c", WAIT, ""))))
    dev.upload(d)
    assert fake.copies()["event_syncs"] == 0
    bad = dev.wrong(tensors)
    assert "b_big" in bad and "a0" not in bad, bad  # the pageable copies before staging are right
    dev.close()


def test_freeing_device_memory_under_a_landing_copy_is_refused(shard):
    """Without the drain before the first free, close finds copies still writing the buffers: the fake
    refuses those frees (a real driver may block or fault) and the buffers leak."""
    d, tensors = shard
    fake = Fake("cuda")
    dev = Device("cuda", fake, tensors, lib=load_library(runtime_variant(
        edit=("drv_gpu.c", FREE, "    return g->api->mem_free(g, addr);"))))
    dev.upload(d)
    dev.close()
    n = fake.counts()
    assert n["live"] > 0 and n["frees"] < n["allocs"]


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_failed_pinned_allocation_is_one_clear_error(driver, shard):
    d, tensors = shard
    fake = Fake(driver)
    dev = Device(driver, fake, tensors)
    fake.fail("host_alloc", 2)  # the second staging buffer
    with pytest.raises(DeviceError) as e:
        dev.upload(d)
    call = {"cuda": "cuMemHostAlloc failed with error 2 (CUDA_ERROR_OUT_OF_MEMORY)",
            "hip": "hipHostMalloc failed with error 2 (hipErrorOutOfMemory)"}[driver]
    assert f"writing b_big: {driver}: {call}" in str(e.value), str(e.value)
    assert fake.copies()["pinned_live"] == 0
    dev.close()
    assert fake.counts()["live"] == 0 and fake.copies()["events_live"] == 0


def _calls(kind: str, lib):
    """The fake driver's entry points used below, under one name for both drivers (handles as c_void_p)."""
    v, n = ctypes.c_void_p, ctypes.c_size_t
    if kind == "cuda":
        assert lib.cuCtxSetCurrent(v(1)) == 0  # the context: per thread, as CUDA's
        return dict(stream=lambda s: lib.cuStreamCreate(ctypes.byref(s), 1),
                    alloc=lambda p, k: lib.cuMemAlloc_v2(ctypes.byref(p), n(k)), free=lambda p: lib.cuMemFree_v2(p),
                    host_alloc=lambda p, k: lib.cuMemHostAlloc(ctypes.byref(p), n(k), 0),
                    host_free=lambda p: lib.cuMemFreeHost(p),
                    h2d=lambda d, s, k, st: lib.cuMemcpyHtoDAsync_v2(d, s, n(k), st),
                    sync=lambda st: lib.cuStreamSynchronize(st), event=lambda e: lib.cuEventCreate(ctypes.byref(e), 3),
                    record=lambda e, st: lib.cuEventRecord(e, st), wait=lambda e: lib.cuEventSynchronize(e),
                    begin=lambda st: lib.cuStreamBeginCapture_v2(st, 1),
                    end=lambda st, g: lib.cuStreamEndCapture(st, ctypes.byref(g)))
    return dict(stream=lambda s: lib.hipStreamCreateWithFlags(ctypes.byref(s), 1),
                alloc=lambda p, k: lib.hipMalloc(ctypes.byref(p), n(k)), free=lambda p: lib.hipFree(p),
                host_alloc=lambda p, k: lib.hipHostMalloc(ctypes.byref(p), n(k), 0),
                host_free=lambda p: lib.hipHostFree(p),
                h2d=lambda d, s, k, st: lib.hipMemcpyAsync(d, s, n(k), 1, st),
                sync=lambda st: lib.hipStreamSynchronize(st), event=lambda e: lib.hipEventCreateWithFlags(ctypes.byref(e), 3),
                record=lambda e, st: lib.hipEventRecord(e, st), wait=lambda e: lib.hipEventSynchronize(e),
                begin=lambda st: lib.hipStreamBeginCapture(st, 1),
                end=lambda st, g: lib.hipStreamEndCapture(st, ctypes.byref(g)))


@pytest.mark.parametrize("driver", DRIVERS)
def test_the_fake_drivers_run_pinned_copies_later_as_a_gpu_does(driver):
    """Called directly: a copy from pageable memory has landed when it returns; one from pinned memory lands
    when an event recorded after it is waited for (not one recorded before it) or the stream is
    synchronised, with the bytes its source holds then. Freeing pinned memory under a queued copy
    (INVALID_VALUE), an event on another stream (INVALID_HANDLE) and pinned allocation during capture
    (STREAM_CAPTURE_UNSUPPORTED) are refused."""
    fake = Fake(driver)
    f = _calls(driver, fake.lib)
    s, dev, pin, e1, e2 = (ctypes.c_void_p() for _ in range(5))
    assert f["stream"](s) == 0 and f["alloc"](dev, 64) == 0 and f["host_alloc"](pin, 64) == 0
    assert f["event"](e1) == 0 and f["event"](e2) == 0
    device = (ctypes.c_uint8 * 64).from_address(dev.value)
    ctypes.memset(device, 0, 64)
    staging = (ctypes.c_uint8 * 64).from_address(pin.value)
    pageable = (ctypes.c_uint8 * 8)(*range(1, 9))
    assert f["h2d"](dev, pageable, 8, s) == 0 and list(device[:8]) == list(range(1, 9))  # landed already
    staging[:16] = [7] * 16
    assert f["h2d"](ctypes.c_void_p(dev.value + 8), pin, 8, s) == 0 and f["record"](e1, s) == 0
    assert f["h2d"](ctypes.c_void_p(dev.value + 16), ctypes.c_void_p(pin.value + 8), 8, s) == 0
    assert f["record"](e2, s) == 0
    assert list(device[8:24]) == [0] * 16 and fake.copies()["queued"] == 2  # queued, not yet landed
    staging[:16] = [9] * 16  # refilled too early: the copies read what the buffer holds when they run
    assert f["wait"](e1) == 0 and list(device[8:24]) == [9] * 8 + [0] * 8  # e1: the first copy only
    assert f["host_free"](pin) == 1  # the second still reads it: INVALID_VALUE
    assert f["sync"](s) == 0 and list(device[16:24]) == [9] * 8 and fake.copies()["queued"] == 0
    assert f["record"](e1, ctypes.c_void_p(0)) == 400  # the legacy default stream: INVALID_HANDLE
    g, extra = ctypes.c_void_p(), ctypes.c_void_p()
    assert f["begin"](s) == 0 and f["host_alloc"](extra, 64) == 900 and f["end"](s, g) == 901
    assert f["host_free"](pin) == 0 and f["free"](dev) == 0
    assert fake.copies()["pinned_live"] == 0 and fake.copies()["stream_syncs"] == 1
