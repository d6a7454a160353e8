"""`reuse_freed_memory`: a process that frees a state's worth of large blocks gets the same,
already mapped pages back for the next one (page faults counted by the kernel), where glibc's
defaults map and fault them in again each time. `BlockPool`: a block comes back once nothing
views it (JAX included), as it was left, never to two holders at once, and without faults."""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from prfaas_jax.engine.host_memory import BlockPool, size_class

CYCLES = """
import json, resource, sys
import numpy as np
from prfaas_jax.engine.host_memory import reuse_freed_memory
took = reuse_freed_memory() if sys.argv[1] == "reuse" else None

def cycle():  # ten 16 MiB blocks, each page touched, then all freed: one state's arrival
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [np.empty(16 * 2**20, np.uint8) for _ in range(10)]
    for block in blocks:
        block[::4096] = 1
    del blocks
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

print(json.dumps({"took": took, "faults": [cycle() for _ in range(4)]}))
"""


def faults(mode: str) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", CYCLES, mode], capture_output=True, text=True, check=True
    )
    return json.loads(run.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_blocks_come_back_without_page_faults():
    reused, default = faults("reuse"), faults("default")
    assert reused["took"] is True
    # The first cycle maps its memory either way; 160 MiB of 4 KiB pages is 40,960 pages, fewer
    # faults where the kernel maps a huge page at once.
    assert reused["faults"][0] > 1000 and default["faults"][0] > 1000
    assert max(reused["faults"][1:]) < 100  # the same pages again (a stray few: Python's own)
    # The control: with glibc's defaults every later cycle faults its pages in again.
    assert min(default["faults"][1:]) > 1000


# `BlockPool`: the blocks a state's large fields are written into.


def test_size_classes_are_four_per_power_of_two_in_whole_pages():
    mib = 2**20
    # Hand-computed: the classes above 1 MiB are 1, 1.25, 1.5, 1.75 and 2 MiB.
    assert [size_class(n) for n in (mib, mib + 1, 5 * mib // 4 + 1, 7 * mib // 4, 2 * mib)] == [
        mib,
        5 * mib // 4,
        3 * mib // 2,
        7 * mib // 4,
        2 * mib,
    ]
    assert size_class(3 * 2**30 + 5) == 7 * 2**29  # 3 GiB and a bit: the 3.5 GiB class
    for n in np.random.default_rng(0).integers(2**20, 2**34, 500):
        c = size_class(int(n))
        assert n <= c <= 1.25 * n and c % mmap.PAGESIZE == 0


def test_a_block_comes_back_when_its_last_view_dies_as_it_was_left():
    pool = BlockPool()
    block = pool.take(3 * 2**20)
    assert block.nbytes == 3 * 2**20 and block.flags.writeable
    assert block.ctypes.data % mmap.PAGESIZE == 0
    block[:] = 7
    address, view = block.ctypes.data, block[4096:].view(np.uint16)
    del block
    other = pool.take(3 * 2**20)  # the first block is still viewed: a new one
    assert other.ctypes.data != address and not other.any()  # new blocks are zeros
    del view
    again = pool.take(3 * 2**20 - 100)  # the same size class
    assert again.ctypes.data == address and (again == 7).all()  # not zeroed: as it was left
    assert (pool.taken, pool.reused) == (3, 1)


def test_jax_holds_a_block_it_adopted_until_it_lets_the_array_go():
    pool = BlockPool()
    block = pool.take(2**21)
    block.view(np.float32)[:] = np.arange(2**19, dtype=np.float32)
    address = block.ctypes.data
    array = jax.device_put(block.view(np.float32).reshape(1, -1))
    assert array.unsafe_buffer_pointer() == address  # adopted, not copied
    del block
    jax.device_put(np.zeros(1)).block_until_ready()  # a later JAX call
    for _ in range(3):  # the same class, written over: never the adopted block
        assert pool.take(2**21).ctypes.data != address
    np.testing.assert_array_equal(np.asarray(array)[0], np.arange(2**19, dtype=np.float32))
    del array
    jax.device_put(np.zeros(1)).block_until_ready()  # JAX lets go of dead arrays in its calls
    assert address in {pool.take(2**21).ctypes.data for _ in range(4)}


def test_the_newest_free_blocks_are_kept_up_to_keep_bytes():
    pool = BlockPool(keep_bytes=2 * 2**20)
    first, second, third = (pool.take(2**20) for _ in range(3))
    kept = {second.ctypes.data, third.ctypes.data}
    newest = third.ctypes.data
    del first, second, third  # freed in this order: the first is let go
    assert pool.free_bytes == 2 * 2**20
    one, two = pool.take(2**20), pool.take(2**20)
    assert one.ctypes.data == newest  # the most recently freed first
    assert {one.ctypes.data, two.ctypes.data} == kept
    assert pool.reused == 2 and pool.free_bytes == 0
    del one, two
    pool.keep_bytes = 2**20  # lowering the limit lets the oldest go at once
    assert pool.free_bytes == 2**20
    pool.keep_bytes = 0
    assert pool.free_bytes == 0
    with pytest.raises(ValueError, match="keep_bytes must be ≥ 0"):
        pool.keep_bytes = -1
    with pytest.raises(ValueError, match="a pooled block is ≥"):
        pool.take(2**20 - 1)


def test_threads_never_hold_the_same_block_at_once():
    pool, clashes = BlockPool(), []

    def work(tag: int) -> None:
        rng = np.random.default_rng(tag)
        for step in range(150):
            block = pool.take(int(rng.choice([2**20, 5 * 2**18, 2**21])))
            stamp = np.uint64(tag << 32 | step)
            words = block.view(np.uint64)
            words[:] = stamp
            time.sleep(0)  # let the others take and give back meanwhile
            if not (words == stamp).all():
                clashes.append((tag, step))

    threads = [threading.Thread(target=work, args=(tag,)) for tag in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not clashes
    assert pool.taken == 600 and pool.reused > 500  # blocks did go round


POOL_CYCLES = """
import json, resource, threading
import numpy as np
from prfaas_jax.engine.host_memory import BlockPool, reuse_freed_memory
reuse_freed_memory()

def cycle(take):  # four 96 MiB blocks, each page touched, then all freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [take(96 * 2**20) for _ in range(4)]
    for block in blocks:
        block[::4096] = 1
    del blocks
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults = {}
def run():  # on a thread, as a gRPC handler decodes a push
    pool = BlockPool()
    faults["pool"] = [cycle(pool.take) for _ in range(3)]
    faults["malloc"] = [cycle(lambda n: np.empty(n, np.uint8)) for _ in range(3)]
thread = threading.Thread(target=run)
thread.start()
thread.join()
print(json.dumps(faults))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux page faults")
def test_pooled_blocks_above_glibcs_ceiling_come_back_without_page_faults():
    run = subprocess.run(
        [sys.executable, "-c", POOL_CYCLES], capture_output=True, text=True, check=True
    )
    faults = json.loads(run.stdout)
    # The first cycle faults its 384 MiB in: 192 faults at the least (2 MiB huge pages).
    assert faults["pool"][0] >= 192
    assert max(faults["pool"][1:]) < 100  # the same pages again (a stray few: Python's own)
    # The control: a thread's malloc maps blocks this large afresh every time, even with
    # `reuse_freed_memory`.
    assert min(faults["malloc"][1:]) >= 192
