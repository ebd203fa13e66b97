"""Which project files one chat request runs code in: the demo model behind the app, one warm-up request,
then the counted one (every thread profiled: the event loop, the engine thread, worker threads).

    python tools/request_files.py [--kind free|tools|json] [--model DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "kernels", "gateway", "policies", "modeltools", "evals")

QUOTE = {"type": "function", "function": {"name": "get_quote", "parameters": {
    "type": "object", "properties": {"symbol": {"type": "string"}}, "required": ["symbol"]}}}
BODIES = {
    "free": {"messages": [{"role": "user", "content": "What moves bond prices?"}], "max_tokens": 24},
    "tools": {"messages": [{"role": "user", "content": "quote AAPL"}], "tools": [QUOTE], "max_tokens": 48,
              "temperature": 0},
    "json": {"messages": [{"role": "user", "content": "order 10 AAPL"}], "max_tokens": 48, "response_format": {
        "type": "json_schema", "json_schema": {"name": "order", "schema": {
            "type": "object", "properties": {"symbol": {"type": "string"}, "qty": {"type": "integer"}},
            "required": ["symbol", "qty"]}}}},
}


def project_file(filename: str) -> str | None:
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    return str(rel) if rel.parts and rel.parts[0] in PACKAGES else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=sorted(BODIES), default="tools")
    ap.add_argument("--model", default=str(ROOT / "engine" / "assets" / "demo-moe"))
    args = ap.parse_args()
    seen: set[str] = set()
    recording = threading.Event()

    def profile(frame, event, arg):
        if recording.is_set() and event == "call":
            f = project_file(frame.f_code.co_filename)
            if f is not None:
                seen.add(f)

    sys.setprofile(profile)
    threading.setprofile(profile)
    from fastapi.testclient import TestClient

    from gateway.app import create_app
    from gateway.settings import Settings

    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(model=args.model, model_name="moegate-demo", state_dir=Path(tmp), trace_file=False)
        with TestClient(create_app(settings)) as client:
            body = {"model": "moegate-demo", **BODIES[args.kind]}
            headers = {"Authorization": "Bearer dev"}
            assert client.post("/v1/chat/completions", json=body, headers=headers).status_code == 200
            recording.set()
            r = client.post("/v1/chat/completions", json=body, headers=headers)
            recording.clear()
            assert r.status_code == 200, r.text
    sys.setprofile(None)
    threading.setprofile(None)
    print(f"{len(seen)} files ({args.kind} chat request)")
    for f in sorted(seen):
        print("   ", f)


if __name__ == "__main__":
    main()
