"""llama.cpp's native tools as the performance peer: build `llama-bench` and `llama-quantize` once from the
package registry's llama-cpp-python sdist (its vendor/llama.cpp), quantize GGUF files, run `llama-bench` and
parse its JSON output.

The build goes into a cache directory (default ~/.cache/moegate/llama.cpp, or $MOEGATE_LLAMA_CPP_DIR): cmake,
native CPU flags (GGML_NATIVE), no curl, only the two targets. Usage:
    python -m evals.perf.llama_cpp build [--jobs 2]     # prints the build's SIMD flags when done
    python -m evals.perf.llama_cpp bench FILE.gguf [-p 128 -n 64 -t 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
from dataclasses import asdict, dataclass
from pathlib import Path

CACHE = Path(os.environ.get("MOEGATE_LLAMA_CPP_DIR", Path.home() / ".cache" / "moegate" / "llama.cpp"))
TARGETS = ("llama-bench", "llama-quantize")


def _log(msg: str) -> None:
    print(f"[llama.cpp] {msg}", file=sys.stderr, flush=True)


def source_dir(cache: Path = CACHE) -> Path:
    """vendor/llama.cpp of the llama-cpp-python sdist, downloaded (pip) and unpacked into `cache` once."""
    found = sorted(cache.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if found:
        return found[-1]
    cache.mkdir(parents=True, exist_ok=True)
    tarballs = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    if not tarballs:
        _log("downloading the llama-cpp-python sdist (pip download --no-binary :all:)")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        "llama-cpp-python", "-d", str(cache)], check=True)
        tarballs = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    _log(f"unpacking {tarballs[-1].name}")
    with tarfile.open(tarballs[-1]) as tar:
        tar.extractall(cache, filter="data")
    return sorted(cache.glob("llama_cpp_python-*/vendor/llama.cpp"))[-1]


def binary(name: str, cache: Path = CACHE) -> Path:
    return cache / "build" / "bin" / name


def build(cache: Path = CACHE, jobs: int = 2) -> Path:
    """Configure and build the native tools once; returns the bin directory. cmake's own [n%] lines show
    progress."""
    if all(binary(t, cache).exists() for t in TARGETS):
        return binary(TARGETS[0], cache).parent
    src, out = source_dir(cache), cache / "build"
    _log(f"configuring {src} -> {out}")
    subprocess.run(["cmake", "-S", str(src), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_OPENMP=ON"], check=True)
    _log(f"building {' '.join(TARGETS)} with -j{jobs} (several minutes on 2 cores)")
    subprocess.run(["cmake", "--build", str(out), "--target", *TARGETS, f"-j{jobs}"], check=True)
    return binary(TARGETS[0], cache).parent


def simd_flags(cache: Path = CACHE) -> dict:
    """The instruction sets the build targets: the ggml-cpu compile flags, the GGML_* switches from the
    cmake cache (the per-ISA ones only matter without GGML_NATIVE) and the compiler's macros for
    -march=native (what a native build compiles for)."""
    flags: dict = {}
    cmake_cache = cache / "build" / "CMakeCache.txt"
    values = dict(line.split(":", 1)[0:1] + line.split("=", 1)[1:] for line in cmake_cache.read_text().splitlines()
                  if "=" in line and ":" in line.split("=", 1)[0]) if cmake_cache.exists() else {}
    native = values.get("GGML_NATIVE") == "ON"
    for name, value in values.items():
        if name in ("GGML_NATIVE", "GGML_OPENMP", "GGML_BLAS", "GGML_LLAMAFILE") or (
                not native and name.startswith(("GGML_AVX", "GGML_AMX", "GGML_FMA", "GGML_F16C", "GGML_BMI2"))):
            flags[name] = value
    for flags_make in sorted((cache / "build" / "ggml" / "src" / "CMakeFiles").glob("ggml-cpu*.dir/flags.make"))[:1]:
        flags["ggml_cpu_cflags"] = " ".join(
            w for line in flags_make.read_text().splitlines() if line.startswith("C_FLAGS") for w in line.split()
            if w.startswith(("-m", "-O")))
    macros = subprocess.run(["cc", "-march=native", "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True,
                            text=True).stdout
    wanted = ("__AVX2__", "__FMA__", "__F16C__", "__AVX512F__", "__AVX512BW__", "__AVX512VL__", "__AVX512VNNI__",
              "__AVX512BF16__", "__AVXVNNI__", "__AMX_TILE__", "__AMX_INT8__", "__AMX_BF16__")
    flags["march_native"] = [m.strip("_") for m in wanted if f"#define {m} " in macros]
    return flags


def run_bench(gguf: Path | str, prompt: int = 128, decode: int = 64, threads: int = 2, reps: int = 3,
              cache: Path = CACHE, repack: bool = True) -> list[dict]:
    """`llama-bench -o json` on one file: one record per test (pp<prompt>, tg<decode>; tg starts at an empty
    context, llama-bench's default depth 0). `repack=False`: `--repack 0`, no extra weight buffers (llama.cpp's
    AMX and repacked CPU layouts)."""
    cmd = [str(binary("llama-bench", cache)), "-m", str(gguf), "-p", str(prompt), "-n", str(decode),
           "-t", str(threads), "-r", str(reps), "-o", "json", "--progress", *([] if repack else ["--repack", "0"])]
    _log(" ".join(["llama-bench", *cmd[1:]]))
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout  # progress on stderr
    return parse_bench_json(out)


def parse_bench_json(text: str) -> list[dict]:
    """llama-bench's JSON (a list of test records) -> one dict per test: kind ("prefill" for n_prompt>0
    and n_gen==0, "decode" for the reverse), tokens, tok_s (avg_ts), stddev, and the build/CPU facts."""
    rows = []
    for rec in json.loads(text):
        n_prompt, n_gen = int(rec.get("n_prompt", 0)), int(rec.get("n_gen", 0))
        if n_prompt and n_gen:
            continue  # pp+tg combined tests are not measured here
        rows.append({"kind": "prefill" if n_prompt else "decode", "tokens": n_prompt or n_gen,
                     "tok_s": float(rec["avg_ts"]), "stddev_tok_s": float(rec.get("stddev_ts", 0.0)),
                     "best_tok_s": max(float(t) for t in rec.get("samples_ts") or [rec["avg_ts"]]),
                     "type": rec.get("model_type", ""), "threads": int(rec.get("n_threads", 0)),
                     "build": f"{rec.get('build_commit', '')} ({rec.get('build_number', '')})",
                     "cpu": rec.get("cpu_info", ""), "backends": rec.get("backends", "")})
    return rows


def quantize(src: Path, dst: Path, qtype: str, pure: bool = False, cache: Path = CACHE) -> Path:
    """`llama-quantize [--pure] src dst qtype` (skipped when dst exists; written to a temporary name first)."""
    if not dst.exists():
        tmp = dst.with_suffix(".part")
        cmd = [str(binary("llama-quantize", cache))] + (["--pure"] if pure else []) + [str(src), str(tmp), qtype]
        _log(" ".join(cmd[1:]))
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        tmp.rename(dst)
    return dst


def convert(model: Path, dst: Path, cache: Path = CACHE) -> Path:
    """The checkpoint as a BF16 GGUF through the sdist's own convert_hf_to_gguf.py and gguf-py (the source of
    every quantized file; the bench checkpoint is bf16, so this is lossless)."""
    if not dst.exists():
        src, tmp = source_dir(cache), dst.with_suffix(".part")
        dst.parent.mkdir(parents=True, exist_ok=True)
        _log(f"convert_hf_to_gguf.py {model} -> {dst} (bf16)")
        env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
        subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(model), "--outtype", "bf16",
                        "--outfile", str(tmp)], check=True, env=env, stdout=subprocess.DEVNULL)
        tmp.rename(dst)
    return dst


# The peer's files: name -> (llama-quantize type, --pure); None is the converted BF16 file itself.
# Default Q4_0 keeps the output tensor (lm_head) at Q6_K; --pure quantizes every tensor to the type.
PEERS: dict[str, tuple[str, bool] | None] = {"BF16": None, "Q8_0": ("Q8_0", False), "Q4_0": ("Q4_0", False),
                                             "Q4_0-pure": ("Q4_0", True)}


def peer_files(model: Path, out: Path, peers: list[str], cache: Path = CACHE) -> dict[str, Path]:
    """The GGUF of each peer, converted and quantized once under `out` (named after the checkpoint)."""
    bf16 = convert(model, out / f"{model.name}-BF16.gguf", cache)
    files = {}
    for name in peers:
        spec = PEERS[name]
        files[name] = bf16 if spec is None else quantize(bf16, out / f"{model.name}-{name}.gguf", *spec, cache=cache)
    return files


def tensor_types(gguf: Path) -> dict[str, str]:
    """GGML type per part of a GGUF (experts, attention, lm_head, embedding, router, norms): what the
    peer's file really holds, e.g. default Q4_0's Q6_K output tensor. Several types in one part are joined."""
    import gguf as gguf_py

    from engine.gguf_file import open_gguf

    parts: dict[str, set[str]] = {}
    for name, info in open_gguf(gguf).tensors.items():
        part = ("experts" if "_exps" in name else "router" if "ffn_gate_inp" in name else "attention"
                if name.split(".")[-2].startswith("attn_") and "norm" not in name else "lm_head"
                if name.startswith("output.") else "embedding" if name.startswith("token_embd") else "norms")
        parts.setdefault(part, set()).add(gguf_py.GGMLQuantizationType(info.qtype).name)
    return {k: "+".join(sorted(v)) for k, v in sorted(parts.items())}


def bench_peer(gguf: str, prompt: int, decode: int, threads: int, reps: int = 3, cache: Path = CACHE) -> dict:
    """One peer file through `llama-bench`: best and mean tok/s of prefill (pp<prompt>) and decode (tg<decode>).
    "best" (the fastest repetition) pairs with moegate's best-of-3 timing.

    Where llama.cpp's default run dies of an illegal instruction (its AMX matmul, on CPUs and VMs where that
    path faults: ggml-org/llama.cpp#20824, #28756), the file runs again with `--repack 0` (llama.cpp's plain
    CPU path, its fastest working configuration there) and the record says so (`repack`, `default_failed`)."""
    repack, failed = True, None
    try:
        found = run_bench(gguf, prompt, decode, threads, reps, cache)
    except subprocess.CalledProcessError as exc:
        if exc.returncode != -signal.SIGILL:
            raise
        failed = "SIGILL in llama.cpp's default run (extra weight buffers: AMX / repack)"
        _log(f"{failed}; running {Path(gguf).name} again with --repack 0")
        repack, found = False, run_bench(gguf, prompt, decode, threads, reps, cache, repack=False)
    rows = {r["kind"]: r for r in found}
    pre, dec = rows["prefill"], rows["decode"]
    return {"prefill_tok_s": pre["best_tok_s"], "decode_tok_s": dec["best_tok_s"],
            "prefill_mean_tok_s": pre["tok_s"], "decode_mean_tok_s": dec["tok_s"], "llama_bench": [pre, dec],
            "tensor_types": tensor_types(Path(gguf)), "file_bytes": Path(gguf).stat().st_size,
            "repack": repack, "default_failed": failed}


# --- the rows: moegate precision profiles beside the peer file of the nearest precision ---


@dataclass(frozen=True)
class MatchedRow:
    """One moegate configuration beside the llama.cpp file of the nearest precision (llama_cpp.PEERS)."""

    label: str
    peer: str  # key of evals.perf.llama_cpp.PEERS
    precision: str  # how the two compare, part by part
    fmt: str | None  # routed experts; None: execution mode with the dev policy's profiles
    attention: str | None = None  # exploration attention projections (fast_dense); None: the model's weights
    lm_head: str | None = None  # exploration lm_head; None: the model's (with attention None too)

    @property
    def run(self) -> str:
        if self.fmt is None:
            return "moegate-execution"
        extra = f"+fast-lmhead-{self.lm_head}-attn-{self.attention}" if self.lm_head else ""
        return f"moegate-{self.fmt}{extra}"


# int4 is W4A8: Q4_0's weights (w = (u - 8)·s, fp16 s per 32) and int8 activations per 32 like the Q8_0
# activations llama.cpp's Q4_0 dot uses. int8_a8 is W8A8: Q8_0's weights and int8 activations per 32, as
# llama.cpp's Q8_0 dot. bf16_a16 is BF16's arithmetic: bf16 weights times bf16-rounded activations, fp32 sums
# (AMX tdpbf16ps where the CPU has it, else vdpbf16ps, as llama.cpp's BF16). int8 and bf16 weights meet fp32
# activations here, where llama.cpp quantizes activations to Q8_0 / rounds them to bf16: moegate the higher precision.
MATCHED = (
    MatchedRow("int4 experts + int4 attention + int8 lm_head", "Q4_0",
               "experts and attention matched; lm_head int8 vs Q6_K (moegate 1.26x the lm_head bytes)",
               "int4", "int4", "int8"),
    MatchedRow("int4 everything", "Q4_0-pure", "matched (lm_head int4 vs Q4_0 too)", "int4", "int4", "int4"),
    MatchedRow("int8 everything", "Q8_0", "weights int8 per 64 vs Q8_0 per 32; moegate fp32 activations vs int8",
               "int8", "int8", "int8"),
    MatchedRow("int8_a8 everything (W8A8)", "Q8_0", "matched: int8 weights and int8 activations, both per 32",
               "int8_a8", "int8_a8", "int8_a8"),
    MatchedRow("bf16_a16 everything (bf16 activations)", "BF16",
               "matched: bf16 weights and bf16-rounded activations, fp32 sums", "bf16_a16", "bf16_a16", "bf16_a16"),
    MatchedRow("bf16 everything (fp32 activations)", "BF16",
               "weights matched; moegate higher precision: fp32 activations vs bf16", "bf16", "bf16", "bf16"),
    MatchedRow("int4 experts, default fp32 attention + lm_head", "Q4_0",
               "moegate higher: fp32 attention and lm_head vs Q4_0 and Q6_K", "int4"),
    MatchedRow("execution mode (dev policy: bf16 experts, the checkpoint's bf16 attention + lm_head)", "BF16",
               "weights matched; moegate fp32 activations vs bf16, batch-invariant fused path", None),
)


def pair_rows(summary: dict[str, dict], rows=MATCHED) -> list[dict]:
    """Each row's moegate and llama.cpp figures and the ratios moegate / llama.cpp (rows whose runs failed
    carry no ratios)."""
    out = []
    for row in rows:
        ours, peer = summary.get(row.run, {}), summary.get(f"llama.cpp-{row.peer}", {})
        entry = {**asdict(row), "run": row.run, "peer_run": f"llama.cpp-{row.peer}",
                 "peer_types": peer.get("tensor_types"), "moegate_precision": ours.get("precision")}
        for key in ("prefill_tok_s", "decode_tok_s"):
            if key in ours and key in peer:
                phase = key.split("_")[0]
                entry[f"moegate_{phase}"], entry[f"llama_cpp_{phase}"] = ours[key], peer[key]
                entry[f"{phase}_ratio"] = ours[key] / peer[key]
        out.append(entry)
    return out


def format_matched(matched: list[dict]) -> str:
    """The matched rows as a markdown table (moegate / llama.cpp tok/s and ratios)."""
    lines = ["| moegate | llama.cpp | prefill tok/s | decode tok/s | prefill ratio | decode ratio |", "|---|---|---|---|---|---|"]
    for m in matched:
        if "decode_ratio" not in m:
            lines.append(f"| {m['label']} | {m['peer']} | — | — | not measured | not measured |")
            continue
        lines.append(f"| {m['label']} | {m['peer']} | {m['moegate_prefill']:.1f} / {m['llama_cpp_prefill']:.1f} | "
                     f"{m['moegate_decode']:.1f} / {m['llama_cpp_decode']:.1f} | {m['prefill_ratio']:.2f}x | "
                     f"{m['decode_ratio']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--jobs", type=int, default=2)
    r = sub.add_parser("bench")
    r.add_argument("gguf")
    r.add_argument("-p", type=int, default=128)
    r.add_argument("-n", type=int, default=64)
    r.add_argument("-t", type=int, default=2)
    args = ap.parse_args()
    if args.cmd == "build":
        print(build(jobs=args.jobs))
        print(json.dumps(simd_flags(), indent=1))
    else:
        print(json.dumps(run_bench(args.gguf, args.p, args.n, args.t), indent=1))


if __name__ == "__main__":
    main()
