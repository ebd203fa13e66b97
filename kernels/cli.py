"""`moegate kernels info|bench`: show the CPU kernel backend and run the kernel benchmark."""

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


def _bench(args: argparse.Namespace) -> int:
    from evals.perf.kernel_bench import main

    rest = args.bench_args
    return main(rest[1:] if rest[:1] == ["--"] else rest)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("kernels", help="CPU MoE kernel info and benchmark")
    sub = parser.add_subparsers(dest="kernels_command", required=True)
    sub.add_parser("info", help="kernel variant, CPU features, NUMA nodes").set_defaults(func=_info)
    bench = sub.add_parser("bench", help="run evals/perf/kernel_bench.py (pass its flags after --)")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_bench)
