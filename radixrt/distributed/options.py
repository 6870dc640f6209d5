"""The checks of the distributed options and the rank layout over nodes; torch-free, so the HTTP process can
refuse bad options before it spawns anything."""

from __future__ import annotations

from radixrt.server_args import ServerArgs


def parse_addr(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets) to its parts; ValueError otherwise."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"dist_init_addr must be HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


def check_dist_args(args: ServerArgs) -> None:
    """ValueError for distributed options that cannot work together (the model's own checks come later)."""
    if args.dp_size != 1:  # `radixrt serve` hands dp_size > 1 to radixrt.server.dp_launch before this check
        raise ValueError(f"dp_size {args.dp_size}: replicas run as `radixrt serve --dp-size N` (behind sglang-router); "
                         "an Engine is one replica")
    if args.tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {args.tp_size}")
    if args.nnodes < 1:
        raise ValueError(f"nnodes must be >= 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"node_rank must be in [0, {args.nnodes}), got {args.node_rank}")
    if args.tp_size % args.nnodes:
        raise ValueError(f"tp_size {args.tp_size} does not split over {args.nnodes} nodes")
    if args.nnodes > 1 and not args.dist_init_addr:
        raise ValueError("several nodes need --dist-init-addr HOST:PORT (node 0's address, the same on every node)")
    if args.dist_init_addr:
        parse_addr(args.dist_init_addr)


def ranks_per_node(args: ServerArgs) -> int:
    return args.tp_size // args.nnodes


def node_ranks(args: ServerArgs) -> range:
    """The global ranks that run on ``args.node_rank``."""
    per = ranks_per_node(args)
    return range(args.node_rank * per, (args.node_rank + 1) * per)
