"""`moegate generate`: run the engine once from the command line."""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt with a local checkpoint")
    p.add_argument("--model", required=True, help="checkpoint directory (config.json, *.safetensors, tokenizer)")
    p.add_argument("--prompt", required=True, help="prompt text (use --chat to wrap it in the chat template)")
    p.add_argument("--chat", action="store_true", help="render the prompt as one user message via the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--json", action="store_true", help="print one JSON object with text and token_ids")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.llm_engine import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device, progress=not args.json)
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed,
    )
    out = llm.generate([prompt], params)[0]
    if args.json:
        json.dump({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason}, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(out.text)
    return 0
