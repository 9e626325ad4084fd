"""Lab 08, part 1: ``shard_bounds(numel, rank, world_size, element_size)``, its check and the
diagnosis of its wrong answers.

``check_shard_bounds`` runs in this process on nine (numel, world size, element size) cases,
from an even split to more ranks than numbers, with numbers of 1, 2, 4 and 8 bytes. Every
rank's piece must be equally long (the collectives move equal pieces), in rank order,
touching, together cover the numbers, start on an ``ALIGN_BYTES`` (16-byte) boundary of the
vector, and be as short as those allow — the part's design decision: what to round, and to
what. Its sentences name the rule broken, with the numbers, never the formula. It names: the
smallest equal pieces left unaligned (lesson 08's rounding), the whole vector padded to 16
bytes and then cut (its end aligned, its pieces not), pieces rounded to 16 *numbers* rather
than 16 bytes, any other misaligned or longer-than-needed piece, the size rounded down (the
last numbers belong to nobody), an exclusive end taken as inclusive (gaps), overlapping
pieces, a last piece clipped at ``numel``, (start, length) returned instead of (start, end),
pieces out of rank order, a first piece that does not start at 0, a return value that is not
two integers.

Kept apart from :mod:`dpcourse.checks.lab08` (which re-exports the check and ``ALIGN_BYTES``)
because part 1 runs in this process on plain numbers and shares nothing with the ZeroTwo
check's ranks but the alignment, ``ALIGN_BYTES``.
"""

from __future__ import annotations

from . import fail, passed, recorded, require_answer

ALIGN_BYTES = 16     # every rank's piece starts on a 16-byte boundary of its bucket's vector


def _piece_numel(numel: int, world_size: int, element_size: int) -> int:
    """The length of every rank's piece of a bucket of ``numel`` numbers: equal pieces that
    cover it, each a whole number of ``ALIGN_BYTES`` units, as short as those allow."""
    unit = max(1, ALIGN_BYTES // element_size)
    return -(-numel // (world_size * unit)) * unit


def _bounds_problem(got, numel, world_size, element_size, sixteen: bool = False) -> None:
    """Name what is wrong with every rank's (start, end) for one (numel, world size, element
    size): the rule it breaks, with the numbers, never the formula. ``sixteen``: on every case
    the pieces were the smallest equal ones rounded up to 16 *numbers*."""
    __tracebackhide__ = True
    size = _piece_numel(numel, world_size, element_size)
    unit = max(1, ALIGN_BYTES // element_size)
    where = (f"for numel={numel} numbers of {element_size} B on {world_size} ranks you gave "
             f"{got}")
    expected = [(r * size, (r + 1) * size) for r in range(world_size)]
    if got == expected:
        return
    first = got[0][1] - got[0][0]
    if world_size > 1 and all(s == r * got[0][1] and e == got[0][1]
                              for r, (s, e) in enumerate(got)):
        fail(f"{where}: that is (start, length), so every rank's second number is the same "
             f"{got[0][1]}.", fix="return (start, end), end exclusive.")
    if sorted(got) != got and all(e - s == first for s, e in got) and \
            sorted(got) == [(r * first, (r + 1) * first) for r in range(world_size)]:
        fail(f"{where}: rank r must own the r-th piece — all_gather_single puts rank r's "
             f"piece at position r.")
    if world_size > 1 and got[:-1] == [(r * first, (r + 1) * first)
                                       for r in range(world_size - 1)] and \
            got[-1] == ((world_size - 1) * first, numel) and numel < world_size * first:
        fail(f"{where}: the last piece is clipped at numel, so it is shorter than the others — "
             f"a reduce-scatter and an all-gather move pieces of one size, one per rank (the "
             f"padding is what a piece may run into).")
    floor = numel // world_size
    if numel % world_size and got == [(r * floor, (r + 1) * floor) for r in range(world_size)]:
        fail(f"{where}: the pieces are equal but too short — together they cover "
             f"{floor * world_size} of the {numel} numbers, and the last {numel % world_size} "
             f"belong to no rank: every number must have an owner.")
    for r in range(world_size - 1):
        if got[r][1] < got[r + 1][0]:
            fail(f"{where}: numbers {got[r][1]}..{got[r + 1][0] - 1} between rank {r} and rank "
                 f"{r + 1} belong to no rank — end is exclusive, and rank {r}'s end stops short "
                 f"of rank {r + 1}'s start.", fix="rank r ends where rank r + 1 starts.")
        if got[r][1] > got[r + 1][0]:
            fail(f"{where}: rank {r} and rank {r + 1} both own numbers {got[r + 1][0]}.."
                 f"{got[r][1] - 1} — pieces must not overlap.")
    if got[0][0] != 0:
        fail(f"{where}: numbers 0..{got[0][0] - 1} belong to no rank (the first piece starts at "
             f"{got[0][0]}).", fix="rank 0 starts at 0.")
    sizes = sorted({e - s for s, e in got})
    if len(sizes) > 1:
        fail(f"{where}: piece sizes {sizes} — a reduce-scatter and an all-gather move pieces of "
             f"one size, one per rank.")
    n = sizes[0]
    if n * world_size < numel:
        fail(f"{where}: pieces of {n} cover {n * world_size} of the {numel} numbers — the last "
             f"belong to no rank: every number must have an owner.")
    if n % unit:
        at = f"rank 1's piece starts at number {n}, byte {n * element_size}" if world_size > 1 \
            else f"the next bucket's piece in self.shard would start at byte {n * element_size}"
        if n == -(-numel // world_size) and world_size > 1:
            fail(f"{where}: the pieces are equal, touch and own every number, but {at} of the "
                 f"vector, which is not on a {ALIGN_BYTES}-byte boundary — the smallest equal "
                 f"pieces are not yet pieces that all start on one.",
                 fix=f"make each piece's length a whole number of {ALIGN_BYTES}-byte units.")
        vector = -(-numel // unit) * unit
        if n == -(-vector // world_size):
            fail(f"{where}: you padded the vector to {vector} numbers ({vector * element_size} B, "
                 f"a whole number of {ALIGN_BYTES}-byte units), but cut in {world_size} its "
                 f"pieces are {n} numbers ({n * element_size} B) each, so rank 1's piece "
                 f"starts at byte {n * element_size} — not on a {ALIGN_BYTES}-byte boundary: it "
                 f"is where each piece starts that must be on one, not where the vector ends.",
                 fix=f"make each piece's length a whole number of {ALIGN_BYTES}-byte units.")
        fail(f"{where}: pieces of {n} numbers of {element_size} B: {at}, which is not on a "
             f"{ALIGN_BYTES}-byte boundary — every piece must start on one.",
             fix=f"make each piece's length a whole number of {ALIGN_BYTES}-byte units.")
    if n > size:
        shorter, smallest = n - unit, -(-numel // world_size)
        if sixteen and element_size > 1 and n == -(-smallest // ALIGN_BYTES) * ALIGN_BYTES:
            fail(f"{where}: every piece starts on a {ALIGN_BYTES}-byte boundary and every number "
                 f"is owned, but each piece is a multiple of {ALIGN_BYTES} *numbers* "
                 f"({ALIGN_BYTES * element_size} B) — the boundary is in bytes, and pieces "
                 f"{n - size} numbers shorter would start on it too: that padding is sent by "
                 f"every collective, in every step.")
        fail(f"{where}: every piece starts on a {ALIGN_BYTES}-byte boundary and every number is "
             f"owned, but pieces {unit} numbers shorter ({shorter}) would be too — each extra "
             f"number per piece is padding sent by every collective, in every step.")
    fail(f"{where}: rank r's piece must be the r-th of {world_size} equal pieces that start at "
         f"0, touch, cover all {numel} numbers and each start on a {ALIGN_BYTES}-byte boundary.")


# (numel, world size, element size): sizes that divide and sizes that do not, more ranks than
# numbers, and fp32, bf16, fp64 and one-byte numbers
_BOUNDS_CASES = ((53, 2, 4), (53, 3, 4), (12, 3, 4), (10, 4, 4), (3, 4, 4), (1_000_003, 8, 4),
                 (53, 3, 2), (41, 2, 8), (7, 3, 1))


@recorded
def check_shard_bounds(shard_bounds) -> None:
    """Every rank's [start, end) on nine (numel, world size, element size) cases."""
    __tracebackhide__ = True
    require_answer(shard_bounds, "shard_bounds")
    answers = []
    for numel, world_size, element_size in _BOUNDS_CASES:
        got = []
        for rank in range(world_size):
            out = shard_bounds(numel, rank, world_size, element_size)
            try:
                start, end = (int(v) for v in out)
            except (TypeError, ValueError):
                fail(f"shard_bounds({numel}, {rank}, {world_size}, {element_size}) returned "
                     f"{out!r}, which is not two integers.",
                     fix="return (start, end), two integers.")
            got.append((start, end))
        answers.append(got)
    # pieces rounded up to 16 numbers rather than 16 bytes, on every case: named as such
    sixteen = all(got[0] == (0, -(-(-(-numel // world_size)) // 16) * 16)
                  for got, (numel, world_size, _) in zip(answers, _BOUNDS_CASES))
    for got, (numel, world_size, element_size) in zip(answers, _BOUNDS_CASES):
        _bounds_problem(got, numel, world_size, element_size, sixteen)
    passed(f"shard_bounds: on {len(_BOUNDS_CASES)} cases, from an even split to more ranks than "
           f"numbers, numbers of 1 to 8 bytes, every rank's piece is as long as every other's, "
           f"starts on a {ALIGN_BYTES}-byte boundary and is no longer than that requires, in "
           f"rank order, touching, every number owned")
