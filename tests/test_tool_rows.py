"""MiniMind's tool-call SFT rows (roles system / user / assistant / tool; `tools` and `tool_calls` as JSON text or
objects, decoded as MiniMind's SFTDataset decodes them) render through the tokenizer's chat template, with labels on
the assistant's turns and their tool calls (counted against a hand-labelled row), train under pp2 as in one process,
and a template that would drop the tool calls names the row before launch."""

import json
from pathlib import Path

import pytest
import torch

from parallel.grid import ParallelGrid
from tests.data_helpers import data_section, make_cfg
from tests.equivalence import EMU, assert_equivalent, baseline, compose_run_config, run_training
from tests.test_data_chat import labelled_text
from training.data import synthetic_corpus, train_bpe_tokenizer
from training.data.encode import encode_conversations, render_chat
from training.data.rows import TASKS, read_row
from training.data.validate import data_problem

# A chat template that renders tools and tool calls in MiniMind's text format (its model/tokenizer_config.json):
# tools in the system turn, `<tool_call>{"name": ..., "arguments": ...}</tool_call>` in the assistant's, tool results
# as a user turn of `<tool_response>` blocks.
TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}"
    "{{- messages[0].content + '\\n\\n' }}{%- endif %}{{- '# Tools\\n<tools>' }}{%- for tool in tools %}"
    "{{- '\\n' + (tool | tojson) }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + m.content }}"
    "{%- for call in m.tool_calls or [] %}{%- set f = call.function if call.function else call %}"
    "{%- if m.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
    "{{- f.arguments if f.arguments is string else f.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"city": "string"}}}]
ROW = [  # as in MiniMind's sft files: tools and tool_calls are JSON text
    {"role": "system", "content": "you help.", "tools": json.dumps(TOOLS)},
    {"role": "user", "content": "the weather in paris?"},
    {"role": "assistant", "content": "", "tool_calls": json.dumps([{"name": "get_weather",
                                                                     "arguments": {"city": "paris"}}])},
    {"role": "tool", "content": "{\"temp\": 21}"},
    {"role": "assistant", "content": "it is 21 in paris."}]
# Hand-labelled: what the assistant says, its tool call included, through each <|im_end|>\n; nothing else.
LABELLED = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call><|im_end|>\n',
            "it is 21 in paris.<|im_end|>\n"]
PLAIN = [{"role": "user", "content": "the cat?"}, {"role": "assistant", "content": "the cat sat."}]
RUN = ["model=tiny", "train.task=sft", "data=jsonl", "data.format=chat", "train.seq_len=256", "train.steps=3",
       "schedule.n_microbatches=2"]


def tokenizer_folder(root: Path, template: str | None) -> Path:
    tokenizer = train_bpe_tokenizer(synthetic_corpus(80, seed=0), vocab_size=400)
    if template is not None:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def tool_data(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tools")
    rows = [ROW, PLAIN, [{**t, "tool_calls": json.loads(t["tool_calls"])} if "tool_calls" in t else t for t in ROW]]
    path = root / "sft_tools.jsonl"
    path.write_text("".join(json.dumps({"conversations": r}) + "\n" for r in rows * 12))
    return path, tokenizer_folder(root / "tokenizer", TOOL_TEMPLATE)


def test_a_tool_row_labels_the_assistant_and_its_tool_calls(tool_data):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tool_data[1]))
    payload, problem = read_row({"conversations": ROW}, TASKS["chat"])
    assert problem is None
    text = render_chat(tokenizer, payload)
    assert '"name": "get_weather"' in text and "<tool_response>\n{\"temp\": 21}\n</tool_response>" in text
    [(ids, mask)] = encode_conversations(tokenizer, [payload])
    labels = torch.where(torch.from_numpy(mask).bool(), torch.from_numpy(ids), -100)
    assert labelled_text(tokenizer, torch.from_numpy(ids), labels) == LABELLED
    want = sum(len(tokenizer(part, add_special_tokens=False).input_ids) for part in LABELLED)
    assert int(mask.sum()) == want


@pytest.mark.parametrize("row, problem", [
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": "[{oops"}],
     'message 1: "tool_calls" is not JSON'),
    ([{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}],
     "message 1 has role 'robot'; use one of system, user, assistant, tool")])
def test_a_bad_tool_row_is_named(row, problem):
    assert read_row({"conversations": row}, TASKS["chat"])[1].startswith(problem)


def test_a_template_that_drops_tool_calls_names_the_row_before_launch(tool_data, tmp_path):
    chatml = tokenizer_folder(tmp_path / "chatml", None)  # the embedded ChatML renders content only
    cfg = make_cfg(data_section(name="jsonl", path=str(tool_data[0]), tokenizer=str(chatml), format="chat",
                                cache_dir=str(tmp_path / "cache")), seq_len=128)
    line = data_problem(cfg)
    assert line.startswith(f"data.path: {tool_data[0]}:1: the chat template of data.tokenizer fails on it ")
    assert "renders no tool calls (the call to 'get_weather' is missing" in line


def test_tool_rows_train_under_pp2_as_in_one_process(tool_data, tmp_path):
    path, tokenizer = tool_data
    run = [*RUN, f"data.path={path}", f"data.tokenizer={tokenizer}"]
    assert data_problem(compose_run_config(run, tmp_path / "cache")) is None
    reference = baseline(run, tmp_path / "cache", tmp_path / "one", dp=1)
    cfg = compose_run_config([*run, "parallel.pp=2", EMU], tmp_path / "cache")
    pp2 = run_training(cfg, ParallelGrid.single(torch.device("cpu")), tmp_path / "pp2")
    assert_equivalent([pp2], reference)


def test_open_thinking_reaches_the_template(tool_data):
    from transformers import AutoTokenizer

    from training.data.chat_rules import ChatRules

    tokenizer = AutoTokenizer.from_pretrained(str(tool_data[1]))
    tokenizer.chat_template = "{{ 'open' if open_thinking is defined and open_thinking is true else 'shut' }}"
    rules = ChatRules("keep", (), 0.2, 0, open_thinking=True)
    assert render_chat(tokenizer, rules.conversation(0, PLAIN)) == "open" and rules.identity()["open_thinking"]
    assert render_chat(tokenizer, PLAIN) == "shut"


def test_a_tool_row_past_the_head_is_named_before_launch(tool_data, tmp_path):
    chatml = tokenizer_folder(tmp_path / "chatml", None)
    path = tmp_path / "late_tools.jsonl"
    path.write_text("".join(json.dumps({"conversations": PLAIN}) + "\n" for _ in range(150)) +
                    json.dumps({"conversations": ROW}) + "\n")
    cfg = make_cfg(data_section(name="jsonl", path=str(path), tokenizer=str(chatml), format="chat",
                                cache_dir=str(tmp_path / "cache")), seq_len=128)
    assert data_problem(cfg).startswith(f"data.path: {path}:151: the chat template of data.tokenizer fails on it ")
    bad = tmp_path / "bad_tools.jsonl"
    bad.write_text(path.read_text().replace(json.dumps(ROW[2]["tool_calls"]), json.dumps("[{oops")))
    cfg = make_cfg(data_section(name="jsonl", path=str(bad), tokenizer=str(tool_data[1]), format="chat",
                                cache_dir=str(tmp_path / "cache")), seq_len=128)
    assert data_problem(cfg).startswith(f'data.path: {bad}:151: message 2: "tool_calls" is not JSON')
