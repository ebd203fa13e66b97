"""The README's API tour, run as printed against a real `moegate serve` on the bundled demo model.

The Python block is read from README.md and executed unchanged (only the port differs), twice: the
answers must be right (the tool call quotes AAPL, the order says 10 AAPL, the SQL runs on a `prices`
table) and identical across tries.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sqlite3
from pathlib import Path

import pytest
import sqlglot

from gateway.settings import DEMO_MODEL_DIR
from tests.gateway.conftest import serve_process

ROOT = Path(__file__).resolve().parents[2]
README_URL = "http://127.0.0.1:8000/v1"

pytestmark = pytest.mark.skipif(not (DEMO_MODEL_DIR / "config.json").is_file(), reason="demo model not installed")


def tour_block() -> str:
    text = (ROOT / "README.md").read_text()
    tour = text[text.index("## A short tour"):]
    block = re.search(r"```python\n(.*?)```", tour, re.S)
    assert block and README_URL in block.group(1), "the README's tour has no openai-client block"
    return block.group(1)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    env = {**os.environ, "MOEGATE_STATE_DIR": str(tmp_path_factory.mktemp("readme"))}
    env.pop("MOEGATE_MODEL", None)
    proc, url = serve_process(["--log-level", "warning"], env, timeout_s=180)
    try:
        yield url + "/v1"
    finally:
        proc.terminate()
        proc.wait(30)


def run_tour(url: str) -> tuple[list, str]:
    """Executes the README block against `url` -> (every chat completion it made, what it printed)."""
    import openai

    made = []

    class RecordingOpenAI(openai.OpenAI):
        def __init__(self, **kw):
            super().__init__(**kw)
            create = self.chat.completions.create

            def recorded(*a, **k):
                made.append(create(*a, **k))
                return made[-1]

            self.chat.completions.create = recorded

    namespace = {"__name__": "readme_tour"}
    code = tour_block().replace(README_URL, url).replace("from openai import OpenAI",
                                                           "OpenAI = RecordingOpenAI")
    namespace["RecordingOpenAI"] = RecordingOpenAI
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), namespace)
    return made, printed.getvalue()


def test_readme_tour_answers_right_every_try(served):
    first, printed = run_tour(served)
    assert len(first) == 3, printed
    tool, order, sql = first

    call = tool.choices[0].message.tool_calls[0].function
    assert call.name == "get_quote" and json.loads(call.arguments) == {"symbol": "AAPL"}

    assert json.loads(order.choices[0].message.content) == {"symbol": "AAPL", "qty": 10}

    query = sql.choices[0].message.content
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE prices (ticker TEXT, ts TEXT, price REAL)")
    db.executemany("INSERT INTO prices VALUES (?, ?, ?)",
                   [("AAPL", "2026-01-02", 190.5), ("AAPL", "2026-01-03", 191.25), ("MSFT", "2026-01-03", 410.0)])
    rows = db.execute(sqlglot.transpile(query, read="postgres", write="sqlite")[0]).fetchall()
    assert rows, f"the README's SQL returned nothing: {query}"
    assert "moegate" in sql.model_extra and "{" in printed.splitlines()[-1]

    again, printed_again = run_tour(served)  # execution mode is greedy by default: every try the same
    assert printed_again == printed
    assert [_answer(r) for r in again] == [_answer(r) for r in first]


def _answer(completion) -> dict:
    """A reply without its random tool-call ids."""
    message = completion.choices[0].message.model_dump()
    for call in message.get("tool_calls") or []:
        call.pop("id")
    return message
