"""`moegate kernels info`: show the CPU kernel backend, CPU features and NUMA nodes.

`moegate kernels bench` is registered by evals/cli.py (the benchmark lives in evals/perf; kernels import
nothing above them): it adds itself to `parser.subcommands`."""

from __future__ import annotations

import argparse


def _info(args: argparse.Namespace) -> int:
    from kernels.fused_moe import backend_summary
    from kernels.numa import assign_to_nodes, detect_topology

    topo = detect_topology()
    print(backend_summary())
    print(topo.summary())
    print(assign_to_nodes(topo, [[1] * 8]).summary())
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("kernels", help="CPU MoE kernel info and benchmark")
    sub = parser.add_subparsers(dest="kernels_command", required=True)
    sub.add_parser("info", help="kernel variant, CPU features, NUMA nodes").set_defaults(func=_info)
    parser.subcommands = sub  # higher layers add theirs (evals/cli.py: `kernels bench`)
