#!/usr/bin/env python3
"""Sequential O_DIRECT writes of DiskStore-shaped records (chunk + one 4 KiB header block, into a
preallocated file, one write at a time), alone and while another process copies and hashes
memory as the DiskStore's storing thread does. Each round alternates the two, so a drifting
disk moves both alike. Prints GB/s per round and the ratio.

Usage: python3 scripts/disk-write-under-copy.py [DIR] [ROUNDS]   (DIR defaults to /tmp)
"""

import hashlib
import mmap
import multiprocessing as mp
import os
import sys
import time

MIB = 1 << 20
BLOCK = 4096
TOTAL = 1 << 30


def copy_and_hash(stop):
    """What a storing thread does to each record: copy the chunk in, checksum it."""
    src = bytes(2 * MIB)
    dst = bytearray(2 * MIB)
    while not stop.is_set():
        dst[:] = src
        hashlib.blake2b(dst).digest()


def write(path, record):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        buf = mmap.mmap(-1, record)
        buf.write(b"\x5a" * record)
        os.posix_fallocate(fd, 0, TOTAL + record + BLOCK)
        n = TOTAL // record
        offset = BLOCK
        start = time.perf_counter()
        for _ in range(n):
            os.pwrite(fd, buf, offset)
            offset += record
        os.fdatasync(fd)
        return n * record / (time.perf_counter() - start) / 1e9
    finally:
        os.close(fd)
        os.unlink(path)


def main():
    directory = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    path = os.path.join(directory, f".tierkv-write-under-copy-{os.getpid()}")
    for chunk_mib in (2, 16):
        record = chunk_mib * MIB + BLOCK
        for _ in range(rounds):
            alone = write(path, record)
            stop = mp.Event()
            busy = mp.Process(target=copy_and_hash, args=(stop,))
            busy.start()
            try:
                loaded = write(path, record)
            finally:
                stop.set()
                busy.join()
            print(
                f"{chunk_mib} MiB records: alone {alone:.2f} GB/s, "
                f"with a core copying {loaded:.2f} GB/s, ratio {loaded / alone:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
