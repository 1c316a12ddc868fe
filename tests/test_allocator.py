"""The caching allocator over a fake device whose every allocation is recorded."""
from __future__ import annotations

import random
import threading

import numpy as np
import pytest

import llaisys
from llaisys.runtime import AllocatorSizes, CachingAllocator, OutOfMemoryError, get_runtime

KiB = 1024


class FakeDevice:
    """Raw device memory: hands out addresses from a counter, with an optional capacity."""

    def __init__(self, capacity: int | None = None, fail_next: int = 0):
        self.capacity = capacity
        self.fail_next = fail_next  # allocations to refuse before honouring requests
        self.next_ptr = 1 << 20
        self.live: dict[int, int] = {}  # ptr -> size
        self.allocs: list[int] = []
        self.frees: list[tuple[int, int]] = []

    def alloc(self, size: int) -> int:
        self.allocs.append(size)
        if self.fail_next or (self.capacity is not None and sum(self.live.values()) + size > self.capacity):
            self.fail_next = max(0, self.fail_next - 1)
            raise OutOfMemoryError("fake:0", "allocate", f"no room for {size} bytes")
        ptr = self.next_ptr
        self.next_ptr += size + 4096  # a gap, so that chunks are never adjacent
        self.live[ptr] = size
        return ptr

    def free(self, ptr: int, size: int) -> None:
        assert self.live.pop(ptr) == size, "freed with a size other than allocated"
        self.frees.append((ptr, size))


def make(min_chunk=256, max_chunk=64 * KiB, init=64 * KiB, realloc=32 * KiB, padding=0, cap=0, device=None):
    device = device or FakeDevice()
    sizes = AllocatorSizes(min_chunk_size=min_chunk, max_chunk_size=max_chunk, max_alloc_size=cap,
                           extra_padding_size=padding, init_alloc_size=init, realloc_size=realloc)
    return CachingAllocator(device.alloc, device.free, sizes, name="fake:0"), device


@pytest.mark.parametrize("nbytes, padding, expected", [
    (1, 0, 256), (256, 0, 256), (257, 0, 512), (0, 0, 256), (200, 56, 256), (200, 57, 512), (1000, 24, 1024),
])
def test_requests_round_up_to_min_chunk_after_padding(nbytes, padding, expected):
    alloc, _ = make(padding=padding)
    assert alloc.round_size(nbytes) == expected
    alloc.malloc(nbytes)
    assert alloc.stats().allocated == expected


def test_chunks_grow_by_init_then_realloc_size():
    alloc, dev = make(init=4 * KiB, realloc=2 * KiB, max_chunk=8 * KiB)
    a = alloc.malloc(3 * KiB)  # first chunk: init size
    b = alloc.malloc(1 * KiB)  # fits in the first chunk's rest
    c = alloc.malloc(1 * KiB)  # needs a new chunk: realloc size
    d = alloc.malloc(5 * KiB)  # bigger than realloc: a chunk of the request's size
    assert dev.allocs == [4 * KiB, 2 * KiB, 5 * KiB]
    assert b == a + 3 * KiB
    st = alloc.stats()
    assert (st.reserved, st.allocated, st.num_chunks) == (11 * KiB, 10 * KiB, 3)
    assert len({a, b, c, d}) == 4


def test_large_requests_go_straight_to_the_device():
    alloc, dev = make(max_chunk=8 * KiB)
    p = alloc.malloc(8 * KiB + 1)
    assert dev.allocs == [8 * KiB + 256] and dev.live == {p: 8 * KiB + 256}
    assert alloc.stats().reserved == 8 * KiB + 256
    alloc.free(p)
    assert dev.frees == [(p, 8 * KiB + 256)] and alloc.stats().reserved == 0


def test_freed_block_is_reused():
    alloc, dev = make()
    p = alloc.malloc(1000)
    alloc.free(p)
    assert alloc.malloc(1000) == p
    assert len(dev.allocs) == 1


def test_best_fit_picks_the_smallest_block_that_fits():
    alloc, dev = make(init=64 * KiB)
    # Free holes of 4, 2 and 3 KiB, kept apart by live blocks so they cannot merge.
    holes, keep = [], []
    for size in (4 * KiB, 2 * KiB, 3 * KiB):
        holes.append(alloc.malloc(size))
        keep.append(alloc.malloc(256))
    for p in holes:
        alloc.free(p)
    assert alloc.malloc(2 * KiB + 1) == holes[2]  # 3 KiB hole, not the first (4 KiB) one
    assert alloc.malloc(2 * KiB) == holes[1]
    assert alloc.malloc(4 * KiB) == holes[0]
    assert len(dev.allocs) == 1


def test_freed_neighbours_coalesce_and_the_chunk_can_be_returned():
    alloc, dev = make(init=4 * KiB)
    a, b, c, d = (alloc.malloc(KiB) for _ in range(4))  # fills the chunk exactly
    for p in (a, c, b):  # b merges with both neighbours
        alloc.free(p)
    assert alloc.malloc(3 * KiB) == a  # one 3 KiB block again
    assert len(dev.allocs) == 1
    alloc.free(a)
    assert alloc.empty_cache() == 0  # d is still live
    alloc.free(d)
    assert alloc.empty_cache() == 4 * KiB
    assert dev.live == {} and alloc.stats().reserved == 0


def test_stats_track_allocated_reserved_peak_and_requested():
    alloc, _ = make(init=64 * KiB)
    a = alloc.malloc(1000)
    b = alloc.malloc(3000)
    st = alloc.stats()
    assert (st.allocated, st.requested, st.reserved, st.peak_allocated) == (1024 + 3072, 4000, 64 * KiB, 4096)
    alloc.free(b)
    st = alloc.stats()
    assert (st.allocated, st.requested, st.peak_allocated) == (1024, 1000, 4096)
    alloc.reset_peak()
    assert alloc.stats().peak_allocated == 1024
    alloc.free(a)
    assert alloc.stats().allocated == 0 and alloc.stats().reserved == 64 * KiB


def test_empty_cache_releases_only_wholly_free_chunks():
    alloc, dev = make(init=4 * KiB, realloc=4 * KiB)
    first = [alloc.malloc(2 * KiB) for _ in range(2)]
    second = [alloc.malloc(2 * KiB) for _ in range(2)]
    for p in first + second[:1]:
        alloc.free(p)
    released = alloc.empty_cache()
    assert released == 4 * KiB and len(dev.frees) == 1 and len(dev.live) == 1
    assert alloc.stats().reserved == 4 * KiB
    # After emptying, the next chunk is sized like a first one again.
    alloc.free(second[1])
    alloc.empty_cache()
    alloc.malloc(1)
    assert dev.allocs[-1] == 4 * KiB


def test_out_of_memory_retry_frees_cached_chunks_first():
    dev = FakeDevice(capacity=8 * KiB)
    alloc, _ = make(init=4 * KiB, realloc=4 * KiB, device=dev)
    cached = alloc.malloc(KiB)
    alloc.free(cached)  # 4 KiB chunk, wholly free, held by the cache
    p = alloc.malloc(6 * KiB)  # 4 + 6 > 8: fails, cache emptied, retried
    assert dev.allocs == [4 * KiB, 6 * KiB, 6 * KiB]
    assert dev.frees and dev.frees[0][1] == 4 * KiB
    assert dev.live == {p: 6 * KiB}


def test_out_of_memory_is_retried_once_then_raised():
    dev = FakeDevice(fail_next=1)
    alloc, _ = make(device=dev)
    alloc.malloc(10)  # first try refused, second succeeds
    assert dev.allocs == [64 * KiB, 64 * KiB]
    dev.fail_next = 2
    with pytest.raises(OutOfMemoryError, match="fake:0: allocate failed: no room"):
        alloc.malloc(100 * KiB)
    assert dev.allocs[2:] == [100 * KiB, 100 * KiB]
    assert alloc.stats().allocated == 256  # the failed request left nothing behind


def test_max_alloc_size_caps_what_is_held():
    alloc, dev = make(init=4 * KiB, realloc=4 * KiB, cap=8 * KiB)
    alloc.malloc(3 * KiB)
    alloc.malloc(3 * KiB)
    with pytest.raises(OutOfMemoryError, match="exceed the device's max_alloc_size of 8192"):
        alloc.malloc(3 * KiB)
    assert len(dev.allocs) == 2


@pytest.mark.parametrize("bad", ["twice", "unknown"])
def test_bad_frees(bad):
    alloc, _ = make()
    p = alloc.malloc(10)
    alloc.free(p)
    with pytest.raises(ValueError, match="was not allocated here or is freed"):
        alloc.free(p if bad == "twice" else p + 8)


def test_bad_sizes():
    alloc, _ = make()
    with pytest.raises(ValueError, match="negative size"):
        alloc.malloc(-1)
    with pytest.raises(ValueError, match="min_chunk_size must be positive"):
        make(min_chunk=0)


def _check_disjoint(live: dict[int, int]) -> None:
    spans = sorted(live.items())
    for (p, n), (q, _) in zip(spans, spans[1:]):
        assert p + n <= q, f"blocks at {p:#x}+{n} and {q:#x} overlap"


def test_random_traffic_keeps_blocks_disjoint_and_inside_chunks():
    rng = random.Random(0)
    alloc, dev = make(init=16 * KiB, realloc=8 * KiB, max_chunk=12 * KiB)
    live: dict[int, int] = {}
    for step in range(2000):
        if live and rng.random() < 0.45:
            p = rng.choice(list(live))
            alloc.free(p)
            del live[p]
        else:
            n = rng.choice([1, 100, 300, 1000, 4000, 13 * KiB])
            p = alloc.malloc(n)
            live[p] = n
            assert any(c <= p and p + n <= c + size for c, size in dev.live.items())
        if step % 50 == 0:
            _check_disjoint(live)
            assert alloc.stats().allocated == sum(alloc.round_size(n) for n in live.values())
    for p in list(live):
        alloc.free(p)
    alloc.empty_cache()
    assert dev.live == {} and alloc.stats().allocated == 0 and alloc.stats().reserved == 0


def test_concurrent_threads():
    alloc, dev = make(init=64 * KiB)
    errors: list[BaseException] = []
    all_live: list[dict[int, int]] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        live: dict[int, int] = {}
        try:
            for _ in range(500):
                if live and rng.random() < 0.5:
                    p = rng.choice(list(live))
                    del live[p]
                    alloc.free(p)
                else:
                    n = rng.choice([64, 512, 2048])
                    live[alloc.malloc(n)] = n
            all_live.append(live)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    merged = {p: n for live in all_live for p, n in live.items()}
    assert len(merged) == sum(len(live) for live in all_live)
    _check_disjoint(merged)


def test_cpu_tensors_use_the_caching_allocator():
    allocator = get_runtime("cpu").allocator
    before = allocator.stats()
    t = llaisys.Tensor.empty((100,), "f32")
    after = allocator.stats()
    assert after.allocated - before.allocated == allocator.round_size(400)
    assert after.num_allocs == before.num_allocs + 1
    del t
    assert allocator.stats().allocated == before.allocated
    t2 = llaisys.Tensor.empty((100,), "f32")
    assert allocator.stats().num_device_allocs == after.num_device_allocs  # served from the cache
    np.testing.assert_array_equal(t2.load(np.arange(100, dtype=np.float32)).numpy(), np.arange(100))


def test_cpu_out_of_memory_is_a_clear_error():
    allocator = get_runtime("cpu").allocator
    before = allocator.stats().allocated
    with pytest.raises(llaisys.runtime.OutOfMemoryError, match="cpu:0: allocate failed: no host memory for"):
        llaisys.Tensor.empty((1 << 62,), "u8")  # more than any address space
    assert allocator.stats().allocated == before


def test_a_free_from_inside_malloc_waits_for_it_instead_of_deadlocking():
    """The garbage collector may run a tensor's finalizer inside malloc, on the same thread,
    and that finalizer frees: the free is done when malloc is, with the lists left whole."""
    alloc, device = make()
    held = [alloc.malloc(1000) for _ in range(4)]
    inner = device.alloc
    freed_inside = []

    def alloc_and_collect(size: int) -> int:  # the device call malloc makes, a finalizer running in it
        if held:
            ptr = held.pop()
            alloc.free(ptr)
            freed_inside.append(ptr)
        return inner(size)

    alloc._raw_alloc = alloc_and_collect
    done = []
    worker = threading.Thread(target=lambda: done.append(alloc.malloc(200 * KiB)))  # past max_chunk: a device call
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "malloc deadlocked on a free from inside it"
    assert freed_inside and done
    stats = alloc.stats()
    assert stats.allocated == 3 * alloc.round_size(1000) + alloc.round_size(200 * KiB)  # the inner free counted
    for ptr in [*done, *held]:
        alloc.free(ptr)
    assert alloc.stats().allocated == 0
