"""Where each parameter's gradient lies in the flat data-parallel buffer: the bucket layout.

Pure arithmetic (no torch), shared by `mlm.parallel.data_parallel.GradBuckets`, which allocates the buffer,
and the planner, which predicts its size to the element. Parameters are laid out in reverse
order (the order backward produces their gradients); a bucket closes once it holds at least
`bucket_elems` elements (or at the first parameter) and is padded to a multiple of `pad`
(lcm(dp, 128) for the distributed optimizer's reduce-scatter, else 1).
"""

from __future__ import annotations


def bucket_layout(
    numels: list[int], bucket_elems: int, pad: int = 1
) -> tuple[list[tuple[int, int]], list[tuple[int, int, list[int]]]]:
    """(range [start, end) of each parameter, buckets as (start, end, parameter indices)); the
    buffer's size is the last bucket's end."""
    ranges: list[tuple[int, int]] = [(0, 0)] * len(numels)
    buckets: list[tuple[int, int, list[int]]] = []
    offset = start = 0
    members: list[int] = []
    for i in reversed(range(len(numels))):
        ranges[i] = (offset, offset + numels[i])
        offset += numels[i]
        members.append(i)
        if offset - start >= bucket_elems or i == 0:
            end = start + -(-(offset - start) // pad) * pad
            buckets.append((start, end, members))
            offset = start = end
            members = []
    return ranges, buckets
