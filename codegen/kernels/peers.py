"""The symmetric region of the one-shot all-reduce (`allreduce.py`) and its peer table: their byte layout, read by
the kernel family, the launch schedule (`runtime/schedule.py`: the region and the table are buffers of their own)
and the runtime (`runtime/c_backend.py`: the status words after a step). No @triton.jit here (`SUPPORT`)."""

from __future__ import annotations

from dataclasses import dataclass

# One tile is TILE_BYTES of a slot whatever the value's element type (4 KB: 2048 bf16 or 1024 fp32 elements, one
# program step): tile t is bytes [t TILE_BYTES, (t + 1) TILE_BYTES) of a slot in every call on the region, so its
# counter and flags guard the same bytes in an fp32 call as in a bf16 one (with tiles of a fixed element count, an
# fp32 tile covered two bf16 tiles' bytes, and a fast rank's next bf16 call overwrote a slot a slow peer was still
# reading: the slots' argument of `allreduce.py` holds per tile only).
TILE_BYTES = 4096
ELEMENT_BYTES = {"fp32": 4, "bf16": 2}


def tile_elements(dtype: str) -> int:
    """A tile's elements in a value of `dtype` (the calls' TILE constexpr)."""
    return TILE_BYTES // ELEMENT_BYTES[dtype]
WORD = 8  # int64 flags, counters, status words and table entries (2^63 all-reduces: never wraps)
STATUS_WORDS = 2  # late peer + 1, its sequence number: at offset 0 (the runtime reads them after a step)
HEADER = 256  # the status words' room, before the slots


@dataclass(frozen=True)
class Region:
    """The layout (byte offsets) of a rank's symmetric region, the same on every rank of a group of `group` ranks
    for all-reduces of up to `max_bytes` bytes: status words [2] (late peer + 1, its sequence number), two data
    slots, flags [group][tiles], counters [tiles]."""
    group: int
    max_bytes: int

    @property
    def slot_bytes(self) -> int:
        return (self.max_bytes + 255) // 256 * 256

    @property
    def tiles(self) -> int:  # the most tiles a value can have
        return max(1, -(-self.max_bytes // TILE_BYTES))

    @property
    def slots_at(self) -> int:
        return HEADER

    @property
    def flags_at(self) -> int:
        return self.slots_at + 2 * self.slot_bytes

    @property
    def counts_at(self) -> int:
        return self.flags_at + self.group * self.tiles * WORD

    @property
    def nbytes(self) -> int:
        return (self.counts_at + self.tiles * WORD + 255) // 256 * 256

    @property
    def table_bytes(self) -> int:
        """The peer table: each rank's region base as mapped in this process, then this rank's index."""
        return (self.group + 1) * WORD


def late_peer_error(status: tuple[int, int], rank: int, group: int, spin: int) -> str | None:
    """The error a region's status words (late peer + 1, sequence number) stand for; None when clear."""
    peer, seq = status
    if peer == 0:
        return None
    return (f"rank {rank}: peer rank {peer - 1} of its group of {group} did not reach one-shot all-reduce "
            f"{seq} within {spin} polls")
