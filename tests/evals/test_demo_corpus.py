"""The demo corpus is deterministic and its structured answers are valid; the shipped demo model is trained."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jsonschema
import pytest
import torch

from evals.demo.chat_format import SPECIAL_TOKENS, render
from evals.demo.corpus import (
    FAMILIES,
    FAMILY_NAMES,
    assistant_spans,
    conversation,
    conversations,
    extract_sql,
    heldout_tasks,
    rendered_set,
    wants_fenced_sql,
)
from evals.demo.schemas import REPORT_SCHEMAS, TOOLS
from evals.demo.trading_db import create_trading_db

CHECKPOINT = Path(__file__).resolve().parents[2] / "engine" / "assets" / "demo-moe"
N_PER_FAMILY = 60


@pytest.fixture(scope="module")
def db():
    return create_trading_db()


def _family(name: str, split: str = "train"):
    return [conversation(split, i, family=name) for i in range(N_PER_FAMILY)]


def test_corpus_is_deterministic_per_seed_and_split():
    first = [c.render() for c in conversations("train", 50, seed=3)]
    assert first == [c.render() for c in conversations("train", 50, seed=3)]
    assert first != [c.render() for c in conversations("train", 50, seed=4)]
    assert first != [c.render() for c in conversations("heldout", 50, seed=3)]
    assert create_trading_db(7).execute("SELECT * FROM positions").fetchall() == \
        create_trading_db(7).execute("SELECT * FROM positions").fetchall()


def test_mixture_covers_every_family():
    kinds = {c.kind for c in conversations("train", 400)}
    assert kinds == {name for name, weight, _ in FAMILIES if weight > 0}
    assert {name for name in FAMILY_NAMES if not name.endswith("_brief") and not name.startswith("adhoc_")} == kinds


def test_brief_report_families_keep_the_schema_out_of_the_prompt_and_out_of_the_default_mixture():
    """A brief report chat names the report (a client's response_format carries the schema); its answer still
    matches the schema."""
    for name in ("order_ticket", "position_summary", "risk_report"):
        for i in range(5):
            brief, full = conversation("train", i, 0, name + "_brief"), conversation("train", i, 0, name)
            system = brief.messages[0]["content"]
            assert "JSON Schema" not in system and name.replace("_", " ") in system
            assert brief.kind == name and brief.schema == full.schema
            jsonschema.validate(json.loads(brief.messages[brief.answer_index]["content"]), brief.schema)
    assert all(weight == 0.0 for name, weight, _ in FAMILIES if name.endswith("_brief"))


def test_every_sql_answer_runs_on_the_trading_db(db):
    non_empty = 0
    for conv in _family("sql") + _family("sql", "heldout"):
        sql = extract_sql(conv.messages[conv.answer_index]["content"])
        rows = db.execute(sql).fetchall()  # raises sqlite3.Error on a bad query
        non_empty += bool(rows) and rows[0] != (None,)
    assert non_empty >= 0.8 * 2 * N_PER_FAMILY, "most questions should have an answer in the data"


def test_sql_answers_follow_the_format_their_system_prompt_asks_for():
    fenced = [wants_fenced_sql(c.messages) for c in _family("sql")]
    assert 0.25 < sum(fenced) / len(fenced) < 0.75  # both the ```sql block and the bare response_format style
    for conv, want_fence in zip(_family("sql"), fenced, strict=True):
        answer = conv.messages[conv.answer_index]["content"]
        assert answer.startswith("```sql\n") == want_fence
        assert extract_sql(answer) == (answer[7:-4] if want_fence else answer)
    with pytest.raises(ValueError, match="no ```sql block or bare query"):
        extract_sql("The answer is 42.")


@pytest.mark.parametrize("family", sorted(REPORT_SCHEMAS))
def test_every_json_answer_validates_against_its_schema(family):
    for conv in _family(family) + _family(family, "heldout"):
        text = conv.messages[conv.answer_index]["content"]
        answer = json.loads(text)
        assert text == json.dumps(answer, separators=(",", ":"))  # compact, as the gateway's JSON grammar emits
        assert conv.schema is REPORT_SCHEMAS[family]
        jsonschema.validate(answer, conv.schema)
        assert json.dumps(conv.schema) in conv.messages[0]["content"]


def test_every_tool_call_names_a_declared_tool_with_valid_arguments():
    families = ["quote", "history", "positions", "order", "risk_order", "risk_check"]
    calls = 0
    for family in families:
        for conv in _family(family):
            declared = {t["function"]["name"]: t["function"]["parameters"] for t in conv.tools}
            for message in conv.messages:
                for call in message.get("tool_calls", []):
                    fn = call["function"]
                    assert fn["name"] in declared, f"{fn['name']} not among {sorted(declared)}"
                    jsonschema.validate(fn["arguments"], declared[fn["name"]])
                    calls += 1
    assert calls > len(families) * N_PER_FAMILY


def test_heldout_tasks_carry_prompt_constraint_and_a_checkable_answer(db):
    tasks = heldout_tasks(60)
    assert {t.kind for t in tasks} == {"tool_call", "json", "sql"}
    for task in tasks:
        assert task.messages[-1]["role"] in ("user", "tool")
        if task.kind == "tool_call":
            params = {t["function"]["name"]: t["function"]["parameters"] for t in task.tools}
            jsonschema.validate(task.expected["arguments"], params[task.expected["name"]])
        elif task.kind == "json":
            jsonschema.validate(task.expected, task.schema)
        else:
            rows = [list(r) for r in db.execute(task.expected["sql"]).fetchall()]
            assert rows == task.expected["rows"]
            assert "CREATE TABLE positions" in task.db_schema
    assert heldout_tasks(10) == tasks[:10]


def test_heldout_tasks_can_exclude_conversations_seen_in_training():
    seen = rendered_set("train", 3000, (0,))
    novel = heldout_tasks(40, kinds=("sql",), exclude=seen)

    def full_chat(task):
        sql = task.expected["sql"]
        answer = f"```sql\n{sql}\n```" if wants_fenced_sql(task.messages) else sql
        return render(task.messages + [{"role": "assistant", "content": answer}])

    assert len(novel) == 40 and not any(full_chat(t) in seen for t in novel)
    # without the filter, short SQL chats recur verbatim across the seed streams
    assert any(full_chat(t) in seen for t in heldout_tasks(40, kinds=("sql",)))


def test_assistant_spans_cover_exactly_the_assistant_turns():
    conv = conversation("train", 0, family="order")
    text = conv.render()
    spans = [text[a:b] for a, b in assistant_spans(text)]
    assert len(spans) == 2
    assert spans[0].startswith("<tool_call>\n{\"name\": \"place_order\"") and spans[0].endswith("<|im_end|>")
    assert spans[1].startswith("Done: your") and "<|im_start|>" not in "".join(spans)


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(CHECKPOINT))


def test_chat_template_renders_identically_with_transformers(tokenizer):
    for conv in list(conversations("heldout", 40)) + [conversation("train", 1, family="risk_order")]:
        assert tokenizer.apply_chat_template(conv.messages, tools=conv.tools, tokenize=False) == conv.render()
    prompt = [{"role": "user", "content": "Quote AAPL"}]
    rendered = tokenizer.apply_chat_template(prompt, tools=list(TOOLS.values()), tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == render(prompt, list(TOOLS.values()), add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n") and "<tools>" in rendered
    # OpenAI wire format (arguments as a JSON string) renders like the dict form
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_quote", "arguments": '{"symbol": "AAPL"}'}}]}
    as_dict = {**call, "tool_calls": [{"type": "function", "function": {"name": "get_quote",
                                                                          "arguments": {"symbol": "AAPL"}}}]}
    assert tokenizer.apply_chat_template(prompt + [call], tokenize=False) == \
        tokenizer.apply_chat_template(prompt + [as_dict], tokenize=False)


def test_a_ticker_is_its_letters_and_the_same_tokens_in_prose_json_and_sql(tokenizer):
    """Copying a ticker from the user's words into arguments must be the identity, as it is for digits: the shipped
    tokenizer (`--split-capitals`) spells it one capital per token, wherever it appears."""
    from evals.demo.trading_db import INSTRUMENTS

    for inst in INSTRUMENTS:
        alone = tokenizer.encode(inst.symbol, add_special_tokens=False)
        assert tokenizer.convert_ids_to_tokens(alone) == list(inst.symbol), inst.symbol
        for text in (f"Buy 10 {inst.symbol} now", f'{{"symbol": "{inst.symbol}"}}', f'{{"symbol":"{inst.symbol}"}}',
                     f"WHERE i.symbol = '{inst.symbol}'", f"({inst.symbol})"):
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert any(ids[i:i + len(alone)] == alone for i in range(len(ids))), (
                text, tokenizer.convert_ids_to_tokens(ids))
    # words with lower-case letters keep Qwen2's split (the space stays on the word)
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode(" shares", add_special_tokens=False)) == ["Ġshares"]


def test_special_tokens_are_single_ids_and_end_generation(tokenizer):
    for token in SPECIAL_TOKENS:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token
    gen = json.loads((CHECKPOINT / "generation_config.json").read_text())
    assert set(gen["eos_token_id"]) == set(tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    assert tokenizer.eos_token == "<|im_end|>"


def test_shipped_checkpoint_is_small_bf16_and_trained(tokenizer):
    transformers = pytest.importorskip("transformers")
    from evals.demo.train import IGNORE, tokenize_with_mask

    size_mb = (CHECKPOINT / "model.safetensors").stat().st_size / 2**20
    assert size_mb < 60
    model = transformers.AutoModelForCausalLM.from_pretrained(str(CHECKPOINT))
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.dtype == torch.bfloat16
    assert model.config.num_experts >= 16
    model = model.float().eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for conv in conversations("heldout", 6, seed=11):
            ids, labels, _ = tokenize_with_mask(tokenizer, conv.render())
            labels_t = torch.tensor([labels])
            out = model(input_ids=torch.tensor([ids]), labels=labels_t)
            n = int((labels_t[:, 1:] != IGNORE).sum())
            total, count = total + float(out.loss) * n, count + n
    heldout = total / count
    assert heldout < 0.5 * math.log(len(tokenizer)), f"held-out loss {heldout:.3f} vs ln(V) {math.log(len(tokenizer)):.3f}"


def test_shipped_model_copies_tickers_accounts_quantities_and_sides_from_the_prompt(tokenizer):
    """Teacher-forced on held-out tool calls and reports: every token of each ticker, account number,
    quantity and order side in the answer is the model's top choice. These are drawn at random per conversation, so only copying
    from the user turn (or a tool result) gets them right; a prior-driven model scores about 1/30 on tickers."""
    transformers = pytest.importorskip("transformers")
    from evals.demo.probes import copy_probe

    model = transformers.AutoModelForCausalLM.from_pretrained(str(CHECKPOINT)).float().eval()
    for kind, (right, n) in copy_probe(model, tokenizer, n=80, seed=13).items():
        assert n >= 15 and right >= 0.9 * n, (kind, right, n)


def test_shipped_model_card_renders_its_shipped_metrics(tmp_path):
    """The committed README is exactly what `evals.demo.card_text` makes of the committed metrics (no hand edits)."""
    from evals.demo.card_text import write_card
    from evals.demo.model_card import training_metric_files

    card = json.loads((CHECKPOINT / "card_metrics.json").read_text())
    phases = [json.loads(p.read_text()) for p in training_metric_files(CHECKPOINT)]
    write_card(tmp_path, card, phases)
    assert (tmp_path / "README.md").read_text() == (CHECKPOINT / "README.md").read_text()


def test_shipped_model_has_a_head_that_reads_the_order_side_from_the_user_turn(tokenizer):
    """The circuit behind the side: from the slot that predicts `buy`/`sell`, heads look at the user's verb (the shipped
    model: 0.45 and 0.41 of two last-layer heads' attention), where an untrained model's heads do not (under 0.01)."""
    transformers = pytest.importorskip("transformers")
    from evals.demo.probes import side_attention

    model = transformers.AutoModelForCausalLM.from_pretrained(str(CHECKPOINT), attn_implementation="eager").float().eval()
    attention = side_attention(model, tokenizer, n=40, seed=13)  # [L, H]
    random_model = transformers.Qwen3MoeForCausalLM(model.config).float().eval()  # same config, untrained
    untrained = side_attention(random_model, tokenizer, n=40, seed=13).max()
    assert untrained < 0.05 and attention.max() > max(0.25, 20 * untrained), (attention, untrained)


def test_card_notes_the_curriculum_and_the_document_mask_only_for_runs_that_used_them():
    from evals.demo.card_text import _curriculum_note, _document_note

    phases = [{"config": {"boost_share": 1.0, "boost_family": "order_ticket_brief", "document_mask": True},
               "steps": 166, "train_seconds": 150.0},
              {"config": {"boost_share": 0.3, "boost_family": "order", "document_mask": True}, "steps": 2039,
               "train_seconds": 1741.0}]
    note = _curriculum_note(phases)
    assert "phase 1 trained only on `order_ticket_brief` (166 steps, 2.5 minutes)" in note and "phase 2" not in note
    assert "--document-mask" in _document_note(phases)
    assert _curriculum_note(phases[1:]) == ""
    assert _document_note(phases + [{"config": {}}]) == ""


def test_split_capitals_tokenizer_spells_tickers_in_letters_everywhere_and_keeps_other_words():
    """`tokenizer_build --split-capitals`: an all-capitals word is one token per letter in prose, JSON and SQL alike
    (copying it is then the digit-like copy of frequent letters); capitalised and lower-case words split as before."""
    from evals.demo.tokenizer_build import train_tokenizer

    tok = train_tokenizer([c.render() for c in conversations("train", 300)], 4096, split_capitals=True)
    for text in ("Buy 10 AAPL now", '{"symbol": "AAPL"}', '{"symbol":"AAPL"}', "WHERE i.symbol = 'AAPL'", "(AAPL)"):
        pieces = tok.encode(text).tokens
        start = next(i for i, p in enumerate(pieces) if p == "A" and pieces[i + 1:i + 4] == ["A", "P", "L"])
        assert pieces[start:start + 4] == ["A", "A", "P", "L"], (text, pieces)
    assert tok.encode("Buy 10 AAPL").tokens[0] == "Buy"
    assert tok.encode(" shares").tokens == ["Ġshares"]
    assert tok.encode("ACC-1012").tokens == ["A", "C", "C", "-", "1", "0", "1", "2"]
    words = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("SELECT symbol FROM t WHERE qty IS NOT NULL")]
    assert [p for p in words if p.isalpha() and p.upper() == p and p != "Ġ"] == ["SELECT", "FROM", "WHERE", "IS", "NOT", "NULL"]
    assert tok.encode("SELECT").tokens == ["SELECT"]
    assert tok.encode("XIN").tokens == ["X", "I", "N"]  # a keyword inside a ticker is still letters


def test_card_describes_the_tokenizer_the_checkpoint_has(tmp_path):
    """A checkpoint whose tokenizer splits capitals (the shipped one) gets the letter-split paragraph and
    `--split-capitals` in its recipe; one with whole-ticker tokens gets neither."""
    from evals.demo.card_text import write_card
    from evals.demo.model_card import splits_capitals, training_metric_files
    from evals.demo.tokenizer_build import train_tokenizer

    card = json.loads((CHECKPOINT / "card_metrics.json").read_text())
    phases = [json.loads(p.read_text()) for p in training_metric_files(CHECKPOINT)]
    assert splits_capitals(CHECKPOINT) and card["split_capitals"]
    train_tokenizer(["Buy 10 AAPL"], 300, split_capitals=False).save(str(tmp_path / "tokenizer.json"))
    assert not splits_capitals(tmp_path)
    shipped = (CHECKPOINT / "README.md").read_text()
    assert "tokenizer_build --out /tmp/demo_tok --vocab-size 4096 --split-capitals\n" in shipped
    assert "`AAPL` is `A`, `A`, `P`, `L`" in shipped and "each ticker is one token" not in shipped
    write_card(tmp_path, {**card, "split_capitals": False}, phases)
    text = (tmp_path / "README.md").read_text()
    assert "--split-capitals" not in text and "each ticker is one token" in text


def test_card_recipe_commands_parse_back_to_each_phase_config():
    """Every `evals.demo.train` command in the shipped card is accepted by the trainer's own parser and gives the
    phase's recorded settings (switches written as `--document-mask`, not `--document-mask True`)."""
    import shlex
    from dataclasses import asdict

    from evals.demo.card_text import RECIPE_OMITS
    from evals.demo.model_card import training_metric_files
    from evals.demo.train import TrainConfig, arg_parser

    text = (CHECKPOINT / "README.md").read_text()
    recipe = text.split("## Recipe", 1)[1].split("```")[1].replace("\\\n", " ")
    commands = [line for line in recipe.splitlines() if "evals.demo.train " in line]
    phases = [json.loads(p.read_text()) for p in training_metric_files(CHECKPOINT)]
    assert len(commands) == len(phases)
    for command, phase in zip(commands, phases, strict=True):
        args = vars(arg_parser().parse_args(shlex.split(command.split("evals.demo.train", 1)[1])))
        for key in asdict(TrainConfig()):
            if key not in RECIPE_OMITS and key in phase["config"]:
                assert args[key] == phase["config"][key], (key, args[key], phase["config"][key])
