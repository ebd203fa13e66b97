"""`moegate serve`: run the gateway (uvicorn) on the bundled demo model or --model DIR."""

from __future__ import annotations

import argparse
import logging
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="start the OpenAI-compatible gateway",
                              description="Start the gateway. With no flags: the bundled demo model, an embedded "
                                          "permissive dev policy (any API key), in-memory stores, audit and traces "
                                          "under ~/.cache/moegate.")
    p.add_argument("--model", help="checkpoint directory (default: $MOEGATE_MODEL, else the `source` of the "
                                   "policy's model, else the bundled demo model); overrides the policy's source")
    p.add_argument("--model-name", default=None,
                   help="the model id clients send: which of the policy's models to serve (default: the policy's "
                        "first model; moegate-demo without --config)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--config", help="policy file (YAML) describing the deployment: its models (and their "
                                    "sources), tenants, modes; default: the embedded dev policy")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None)
    p.add_argument("--max-queue", type=int, default=None, help="requests in flight before 429 (default 64)")
    p.add_argument("--state-dir", default=None, help="audit log and trace file directory")
    p.add_argument("--tool-format", default=None, help="tool-call format: qwen, deepseek_v31, deepseek_v3, "
                   "harmony, glm45 (default: the checkpoint's family, else qwen; docs/gateway.md)")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app
    from gateway.settings import ModelNotFound, from_env
    from policies.loader import PolicyError

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = from_env(model=args.model, model_name=args.model_name, policy_path=args.config, host=args.host,
                            port=args.port, device=args.device, max_queue=args.max_queue, state_dir=args.state_dir,
                            tool_format=args.tool_format)
    except (ModelNotFound, PolicyError, ValueError) as e:
        print(f"moegate serve: {e}", file=sys.stderr)
        return 2
    print(f"moegate: serving {settings.model_name} from {settings.model} on http://{settings.host}:{settings.port}/v1",
          file=sys.stderr)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=args.log_level.lower())
    return 0
