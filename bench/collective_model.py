"""The cost model of the flat and hierarchical 1-bit allreduce, as formulas (docs/cost_model.md).

Each phase of a call costs a latency plus bytes over a bandwidth (communication) or the bytes a
codec pass moves over a memory bandwidth. bench/cost_model.py calibrates and checks it on
measured runs; bench/allreduce_bw.py turns it into the speedups a user's links would see.
"""

from __future__ import annotations

import math

BURST = 256 * 1024  # netsim's tbf bucket: transfers below it leave at the veth's speed
FOLD_BYTES = 128 * 1024  # compcomm.agreement.FOLD_BYTES (not imported: the model runs without compcomm)
ROW_BY_ROW_BYTES = 128 * 1024  # backends.torch_dist.DIRECT_GATHER_BYTES: gloo sends wider rows one by one
HEADER_BYTES = 16  # compcomm.agreement.HEADER.itemsize: phase 0's header per peer, no folded signs
CODEC = ("scan", "werr", "server", "serr", "decode")


def chunk(numel: int, n: int) -> int:
    return math.ceil(numel / (8 * n)) * 8


def flat_bytes(numel: int, n: int) -> dict[str, float]:
    """Bytes per rank of every part of the flat call over n ranks (comm: sent; codec: moved)."""
    c = chunk(numel, n)
    m, room = c * n, min(FOLD_BYTES // n, c // 8)
    return {
        "header": (n - 1) * (16.0 + room),
        "a2a": (n - 1) * (c / 8 - room),
        "gather": (n - 1) * (4 + c / 8),
        "scan": 12.0 * numel + m / 8,  # x, the previous x' and the new x' (the x' form), the signs
        "werr": 12.0 * numel,  # only with double_buffer=False, after phase 0
        "server": n * c / 8 + 8.0 * c + c / 8,
        "serr": 8.0 * c,
        "decode": 4.0 * m + m / 8,
        "allreduce": 2 * (n - 1) / n * 4 * numel,
    }


def comm_time(p: dict, bytes_: float, steps: int, share: float, bandwidth: float, free: float | None = None) -> float:
    """A collective of `steps` peer steps: (alpha0 + alpha steps) of latency, stretched by the
    CPU share, plus the bytes beyond what the link lets through freely (`free`, by default a
    whole token bucket, p["burst"]) at its bandwidth. alpha0 (per collective, whatever the peers)
    is 0 unless calibrated on two cluster sizes."""
    free = p["burst"] if free is None else free
    return (p.get("alpha0", 0.0) + p["alpha"] * steps) * share + max(0.0, bytes_ - free) / bandwidth


def spend_bucket(bucket: float, transfers: list[float]) -> list[float]:
    """The bytes of each transfer that a link's token bucket lets through at once, the transfers
    taken in the order they leave: one bucket serves a whole call, whose later phases find it
    spent by the earlier ones (it refills at the link's rate, i.e. not within the call)."""
    free = []
    for size in transfers:
        free.append(min(bucket, size))
        bucket -= free[-1]
    return free


def flat_parts(
    p: dict,
    numel: int,
    n: int,
    share: float,
    k: int = 1,
    sharing_link: int | None = None,
    row_by_row: bool = True,
    addend: bool = False,
) -> dict[str, float]:
    """Predicted seconds of every part of the flat call over n ranks, k per host: the ranks
    share the host's link (B/k each, or B/sharing_link) for the (n-k)/(n-1) of their blocks that
    leave the host; the ring all-reduce, in rank order, sends one stream per host link.

    `call` overlaps what the schedule overlaps on a transport that sends rows one by one
    (`row_by_row`: gloo; NCCL and MPI take one collective per phase):

    * phase 1 during the scan, for rows of more than ROW_BY_ROW_BYTES (after a call as wide):
      phase 0 in two headers, the second once every row is scanned, and the rows on the wire as
      they are packed, the first after 1/n of the scan: max(scan + header, scan / n + a2a of
      every row) after the first header;
    * phase 2 over more than two ranks, messages of more than ROW_BY_ROW_BYTES: a ring of n - 1
      steps of g = gather / (n - 1) each, each arriving chunk decoded (d = decode / n) while the
      next travels, the server error update and the own chunk's decode during the first step:
      max(g, serr + d) + (n - 2) max(g, d) + d (the ring runs in lock step: the library posts a
      step once the one before has arrived, so no step starts earlier, as it would in a ring
      that pipelines its sends);
    * otherwise (and always) the server error update and this rank's own chunk's decode run
      during phase 2's collective, the other chunks' decode after it:
      max(gather, serr + decode / n) + decode (n-1) / n.

    The link's token bucket (p["burst"]): each phase measured alone finds it full, and a call's
    phases spend one bucket in turn (`spend_bucket`). Each of a host's ranks is given the whole
    bucket (dividing it among them overshot the measured calls: docs/cost_model.md).

    `addend`: the scan reads a second fp32 input (a hierarchical part's last node block)."""
    link = p["B"] / (sharing_link or k)
    b = flat_bytes(numel, n)
    if addend:
        b["scan"] += 4.0 * numel
    t = {part: b[part] / p["gamma"][part] * share for part in CODEC}
    crossing = (n - k) / (n - 1) if n > 1 else 0.0
    row = chunk(numel, n) / 8

    def sent(bytes_: float, free: float | None = None) -> float:
        return comm_time(p, bytes_ * crossing, n - 1, share, link, free) if bytes_ else 0.0

    t["header"], t["a2a"], t["gather"] = sent(b["header"]), sent(b["a2a"]), sent(b["gather"])
    t["allreduce"] = comm_time(p, b["allreduce"], 2 * (n - 1), share, p["B"])
    streamed = row_by_row and n > 1 and row > ROW_BY_ROW_BYTES
    first = [(n - 1) * HEADER_BYTES, (n - 1) * row] if streamed else [b["header"], b["a2a"]]
    free = spend_bucket(p["burst"], [crossing * x for x in (*first, b["gather"])])
    if streamed:
        header, every_row = sent(first[0], free[0]), sent(first[1], free[1])
        phase1 = header + max(t["scan"] + header, t["scan"] / n + every_row)
    else:
        phase1 = t["scan"] + sent(first[0], free[0]) + sent(first[1], free[1])
    gather = sent(b["gather"], free[2])
    if row_by_row and n > 2 and 4 + row > ROW_BY_ROW_BYTES:
        step, own = gather / (n - 1), t["decode"] / n
        phase2 = max(step, t["serr"] + own) + (n - 2) * max(step, own) + own
    else:
        phase2 = max(gather, t["serr"] + t["decode"] / n) + t["decode"] * (n - 1) / n
    t["call"] = p.get("overhead", 0.0) * share + phase1 + t["server"] + phase2
    return t


def node_time(p: dict, bytes_: float, k: int, share: float) -> float:
    """A collective among the k ranks of a host (shared memory or loopback): alpha_lo per peer
    step, stretched by the CPU share, plus the bytes at the host's own bandwidth B_lo."""
    return p["alpha_lo"] * (k - 1) * share + bytes_ / p["B_lo"]


def node_sum(p: dict, numel: int, k: int, share: float) -> float:
    """The hierarchical node step's pass summing the first k - 1 blocks of a part (k > 2; with two
    ranks the worker scan reads both blocks): k blocks of 4N/k bytes moved, at the scan's gamma."""
    return 4.0 * k * chunk(numel, k) / p["gamma"]["scan"] * share if k > 2 else 0.0


def hier_parts(p: dict, numel: int, hosts: int, k: int, share: float, row_by_row: bool = True) -> dict[str, float]:
    """The hierarchical call: the node's step (the fp32 parts exchanged inside the host, which
    B_lo is calibrated on, and for k > 2 the first k - 1 blocks summed in a pass), the flat call
    on the N/k-element part across hosts (its k ranks sharing the host's link, its scan reading
    the last block besides the first and dividing as it goes, its part decoded as its phase 2
    arrives), the parts' results shared inside the host, and the other k - 1 parts decoded.
    Phase 0 spans all ranks: one collective across hosts and two inside the host."""
    part = chunk(numel, k)
    inner = flat_parts(p, part, hosts, share, 1, sharing_link=k, row_by_row=row_by_row, addend=k > 1)
    t = {
        "rs": node_time(p, (k - 1) * 4.0 * part, k, share) + node_sum(p, numel, k, share),
        "share": node_time(p, (k - 1) * hosts * (4 + chunk(part, hosts) / 8), k, share),
        "agree": comm_time(p, 0.0, hosts - 1, share, p["B"]) + 2 * node_time(p, 0.0, k, share),
        "decode_others": (k - 1) / k * flat_bytes(numel, 1)["decode"] / p["gamma"]["decode"] * share,
    }
    t["hier"] = t["agree"] + t["rs"] + inner["call"] + t["share"] + t["decode_others"]
    return t
