import copy
import json
import os

import pytest

from conftest import ENCODING_FIXTURES, fixture_file
from encoding.encoding import (
    BOS,
    EOS,
    IMAGE_PLACEHOLDER,
    PRE_RELEASE_EFFORT_TABLE,
    EncodingError,
    ParseError,
    encode_case,
    encode_messages,
    load_cases,
    parse_message_from_completion_text,
    parse_tagged_text,
    resolve_reasoning_effort,
    to_json,
)

EFFORT = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
EFFORT_75 = EFFORT.format(75)
CALLS_PREFIX = "\n\n<｜DSML｜ calls>\n"


def user(content, **kw):
    return dict(role="user", content=content, **kw)


def assistant(content, **kw):
    return dict(role="assistant", content=content, **kw)


def system(content, **kw):
    return dict(role="system", content=content, **kw)


def tool(content, call_id=""):
    return dict(role="tool", tool_call_id=call_id, content=content)


def call(name, arguments, call_id=None):
    c = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id is not None:
        c["id"] = call_id
    return c


def _manifest():
    path = os.path.join(ENCODING_FIXTURES, "manifest.json")
    if not os.path.exists(path):
        return [pytest.param(None, id="fixtures-absent")]
    with open(path, encoding="utf-8") as f:
        entries = json.load(f)
    return [pytest.param(e, id=e.get("case") or e["completion"]) for e in entries]


def _read(name):
    with open(os.path.join(ENCODING_FIXTURES, name), encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("entry", _manifest())
def test_fixture(entry):
    fixture_file(os.path.join(ENCODING_FIXTURES, "manifest.json"))
    if "case" in entry:
        (case,) = load_cases(os.path.join(ENCODING_FIXTURES, entry["case"]))
        if "error" in entry:
            with pytest.raises(EncodingError):
                encode_case(case, "chat")
        else:
            prompt, _ = encode_case(case, "chat")
            assert prompt == _read(entry["output"])
    else:
        text = _read(entry["completion"])
        if "error" in entry:
            with pytest.raises(ParseError):
                parse_message_from_completion_text(text, entry["thinking_mode"])
        else:
            parsed = parse_message_from_completion_text(text, entry["thinking_mode"])
            assert parsed == json.loads(_read(entry["parsed"]))


# ---- examples, docs/cli.md §5.5 ----------------------------------------------------------------------------


def test_examples_basic():
    assert encode_messages([user("hi")], "chat") == f"{BOS}<｜User｜>hi<｜Assistant｜></think>"
    assert encode_messages([user("hi")], "thinking") == \
        f"{BOS}<｜System｜>{EFFORT_75}<｜User｜>hi<｜Assistant｜><think>"
    assert encode_messages([system("Be brief."), user("hi")], "thinking", reasoning_effort=42) == \
        f"{BOS}<｜System｜>{EFFORT.format(42)}Be brief.<｜User｜>hi<｜Assistant｜><think>"
    msgs = [user("q1"), assistant("a1", reasoning_content="r1"), user("q2")]
    assert encode_messages(msgs, "thinking") == (
        f"{BOS}<｜System｜>{EFFORT_75}<｜User｜>q1<｜Assistant｜></think>a1{EOS}"
        "<｜User｜>q2<｜Assistant｜><think>")
    msgs = [system("A"), user("q1"), assistant("a1"), system("B"), user("q2")]
    assert encode_messages(msgs, "chat") == (
        f"{BOS}<｜System｜>A<｜User｜>q1<｜Assistant｜></think>a1{EOS}"
        "<｜System｜>B<｜User｜>q2<｜Assistant｜></think>")
    assert encode_messages([], "chat") == BOS
    assert encode_messages([user("u"), assistant("par", wo_eos=True)], "chat") == \
        f"{BOS}<｜User｜>u<｜Assistant｜></think>par"
    assert encode_messages([user("u", task="query")], "chat") == f"{BOS}<｜User｜>u<｜query｜>"
    assert encode_messages([user("u", task="action")], "thinking").endswith(
        "<｜User｜>u<｜Assistant｜><think><｜action｜>")
    assert encode_messages([assistant("a", reasoning_content="r")], "thinking", context=[user("u")]) == \
        f"r</think>a{EOS}"


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                 "parameters": {"type": "object", "properties": {}}}}


def test_example_tool_round_trip():
    msgs = [system("sys", tools=[WEATHER_TOOL]), user("w?"),
            assistant("", reasoning_content="need tool",
                      tool_calls=[call("get_weather", {"city": "Paris", "days": 3})]),
            tool("sunny")]
    prompt = encode_messages(msgs, "thinking")
    assert prompt.startswith(f"{BOS}<｜System｜>{EFFORT_75}sys\n\n## Tools\n\nYou have access to a set")
    assert "\n### Available Tool Schemas\n\n" + to_json(WEATHER_TOOL["function"]) + "\n\nYou MUST" in prompt
    assert prompt.endswith(
        "tool calls.\n<｜User｜>w?<｜Assistant｜><think>need tool</think>" + CALLS_PREFIX +
        '<｜DSML｜ invoke name="get_weather">\n'
        '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls>" + EOS +
        "<｜User｜><tool_result>sunny</tool_result><｜Assistant｜><think>")
    # An empty system content: effort line, then "\n\n## Tools" (four newlines).
    prompt = encode_messages([system("", tools=[WEATHER_TOOL]), user("w?")], "thinking")
    assert prompt.startswith(f"{BOS}<｜System｜>{EFFORT_75}\n\n## Tools\n\n")


def test_tool_results_sorted_by_call_order():
    msgs = [user("x"), assistant("", tool_calls=[call("f", "{}", "a"), call("g", "{}", "b")]),
            tool("B", "b"), tool("A", "a"), user("more")]
    assert encode_messages(msgs, "chat").endswith(
        f"</｜DSML｜ calls>{EOS}<｜User｜><tool_result>A</tool_result>\n\n<tool_result>B</tool_result>"
        "\n\nmore<｜Assistant｜></think>")
    # function.id counts too; unknown ids sort as 0 (stable).
    calls = [{"function": {"name": "f", "arguments": "{}", "id": "a"}},
             {"function": {"name": "g", "arguments": "{}", "id": "b"}}]
    msgs = [user("x"), assistant("", tool_calls=calls), tool("B", "b"), tool("?", "zz"), tool("A", "a")]
    assert encode_messages(msgs, "chat").endswith(
        "<tool_result>?</tool_result>\n\n<tool_result>A</tool_result>\n\n<tool_result>B</tool_result>"
        "<｜Assistant｜></think>")


def test_images():
    content = [{"type": "text", "text": "first"}, {"type": "image_url", "image_url": {"url": "a.png"}},
               {"type": "text", "text": "second"}, {"type": "image_url", "image_url": "b.png"},
               {"type": "image", "source": {"path": "c.png"}}]
    prompt, data = encode_messages([user(content)], "chat", return_multi_modal_data=True)
    ph = IMAGE_PLACEHOLDER
    assert prompt == f"{BOS}<｜User｜>first\n\n{ph}\n\nsecond\n\n{ph}\n\n{ph}<｜Assistant｜></think>"
    assert data == {"images": [{"type": "image", "url": "a.png"}, {"type": "image", "url": "b.png"},
                               {"type": "image", "source": {"path": "c.png"}}]}
    # Images inside a tool_result block are collected too; context images are not returned.
    nested = [{"type": "tool_result", "tool_use_id": "t",
               "content": [{"type": "image_url", "image_url": {"url": "d.png"}}, {"type": "audio"}]}]
    context = [user([{"type": "image", "url": "x"}]), assistant("a")]
    prompt, data = encode_messages([user(nested)], "chat", context=context, return_multi_modal_data=True)
    assert prompt == (f"<｜User｜><tool_result>{ph}\n\n[Unsupported audio]</tool_result>"
                      "<｜Assistant｜></think>")
    assert data["images"] == [{"type": "image", "url": "d.png"}]
    assert encode_messages([user([{"type": "video"}])], "chat") == f"{BOS}<｜User｜>[Unsupported video]" \
        "<｜Assistant｜></think>"


@pytest.mark.parametrize("msg", [
    user(f"look {IMAGE_PLACEHOLDER}"),
    assistant("a", reasoning_content=IMAGE_PLACEHOLDER),
    user([{"type": "text", "text": IMAGE_PLACEHOLDER}]),
    user([{"type": "image", "url": ""}]),
    user([{"type": "image"}]),
])
def test_image_errors(msg):
    with pytest.raises(EncodingError):
        encode_messages([msg], "chat")


# ---- quirks, docs/cli.md §5.6 ------------------------------------------------------------------------------


def test_effort_validation():
    for effort, budget in [(None, 75), ("low", 50), ("high", 75), ("max", 100), (1, 1), (100, 100), (42, 42)]:
        assert resolve_reasoning_effort(effort) == budget
        assert EFFORT.format(budget) in encode_messages([user("x")], "thinking", reasoning_effort=effort)
    rejected = ["xhigh", "minimal", "medium", "none", "HIGH", "50", "", 0, 101, -1, True, False, 1.5, 50.0,
                [1]]
    for bad in rejected:
        for mode in ("chat", "thinking"):  # validated in chat mode too
            with pytest.raises(EncodingError, match="reasoning_effort"):
                encode_messages([user("x")], mode, reasoning_effort=bad)
    # Only an empty render raises nothing.
    assert encode_messages([], "thinking", reasoning_effort="xhigh") == BOS
    assert encode_messages([], "bogus") == BOS
    with pytest.raises(EncodingError, match="thinking_mode"):
        encode_messages([user("x")], "bogus")
    # Pre-release table: xhigh exists, default 50.
    assert EFFORT.format(75) in encode_messages([user("x")], "thinking", reasoning_effort="xhigh",
                                                effort_table=PRE_RELEASE_EFFORT_TABLE)
    assert EFFORT.format(50) in encode_messages([user("x")], "thinking",
                                                effort_table=PRE_RELEASE_EFFORT_TABLE)
    # No effort line with a context, none in chat mode.
    assert "Effort" not in encode_messages([user("x")], "thinking", context=[system("s")])
    assert "Effort" not in encode_messages([user("x")], "chat", reasoning_effort=3)


def test_system_quirks():
    assert encode_messages([system("A"), system("B")], "chat") == \
        f"{BOS}<｜System｜>A<｜System｜>B<｜Assistant｜></think>"
    assert encode_messages([system("A")], "thinking") == f"{BOS}<｜System｜>{EFFORT_75}A"
    assert encode_messages([system(None), user("u")], "chat") == \
        f"{BOS}<｜System｜><｜User｜>u<｜Assistant｜></think>"
    rf = {"type": "json_object"}
    assert encode_messages([system("s", response_format=rf)], "chat") == (
        f"{BOS}<｜System｜>s\n\n## Response Format:\n\n"
        "You MUST strictly adhere to the following schema to reply:\n"
        '{"type": "json_object"}')
    # A mid-conversation system counts as a user turn for dropping.
    msgs = [user("q"), assistant("a", reasoning_content="r"), system("B")]
    assert encode_messages(msgs, "thinking").endswith(
        f"</think>a{EOS}<｜System｜>B<｜Assistant｜><think>")


def test_reminder_and_none_contents():
    reminder = {"role": "latest_reminder", "content": "r"}
    assert encode_messages([user("u"), reminder, assistant("a")], "chat") == \
        f"{BOS}<｜User｜>u<｜Assistant｜></think><｜latest_reminder｜>ra{EOS}"
    assert encode_messages([{"role": "latest_reminder", "content": None}], "chat") == \
        f"{BOS}<｜latest_reminder｜>None"
    assert encode_messages([user("u"), tool(None)], "chat") == \
        f"{BOS}<｜User｜>u\n\n<tool_result>None</tool_result><｜Assistant｜></think>"
    assert encode_messages([{"role": "user"}, assistant(None)], "chat") == \
        f"{BOS}<｜User｜><｜Assistant｜></think>{EOS}"
    with pytest.raises(EncodingError, match="content"):
        encode_messages([user(None)], "chat")


def test_roles_rejected():
    for role in ("developer", "function", None):
        with pytest.raises(EncodingError, match="role"):
            encode_messages([user("u"), {"role": role, "content": "x"}], "chat")
    with pytest.raises(EncodingError):
        encode_messages(["not a dict"], "chat")
    with pytest.raises(EncodingError):
        encode_messages("hi", "chat")


def test_reasoning_rules():
    msgs = [user("q1"), assistant("a1", reasoning_content="R1"), user("q2"),
            assistant("", reasoning_content="R2", tool_calls=[call("f", {})]), tool("res"),
            assistant("a2", reasoning_content="R3")]
    out = encode_messages(msgs, "thinking")
    # The tool result is the last user turn: the reasoning before it is dropped, the one after is kept.
    assert "R1" not in out and f"<｜User｜>q2<｜Assistant｜></think>{CALLS_PREFIX}" in out
    assert out.endswith(f"<tool_result>res</tool_result><｜Assistant｜><think>R3</think>a2{EOS}")
    # Chat mode never renders reasoning; drop_thinking=False keeps all of it.
    chat = encode_messages(msgs, "chat")
    assert all(r not in chat for r in ("R1", "R2", "R3")) and "<think>" not in chat
    assert "<｜Assistant｜><think>R1</think>a1" in encode_messages(msgs, "thinking", drop_thinking=False)
    # Tools declared anywhere (even on a later system) keep every reasoning, empty ones as <think></think>.
    msgs2 = [user("q1"), assistant("a1"), system("B", tools=[WEATHER_TOOL]), user("q2")]
    out = encode_messages(msgs2, "thinking")
    assert f"<｜User｜>q1<｜Assistant｜><think></think>a1{EOS}" in out
    # Declaring the tool keeps the tool-loop reasoning.
    out = encode_messages([system("", tools=[WEATHER_TOOL])] + msgs, "thinking")
    assert (f"<｜User｜>q2<｜Assistant｜><think>R2</think>{CALLS_PREFIX}" in out
            and "<think>R1</think>" in out)
    # An assistant right after a task message gets no reasoning part.
    out = encode_messages([user("u", task="action"), assistant("Search", reasoning_content="r")], "thinking")
    assert out.endswith(f"<｜User｜>u<｜Assistant｜><think><｜action｜>Search{EOS}")
    # `prefix` is not read; wo_eos after the last user still renders the reasoning.
    assert encode_messages([user("u"), assistant("a", prefix=True)], "chat").endswith(f"a{EOS}")
    assert encode_messages([user("u"), assistant("a", reasoning_content="r", wo_eos=True)], "thinking") \
        .endswith("<｜Assistant｜><think>r</think>a")


def test_merging_and_tasks():
    assert encode_messages([user("u"), user("v", task="query")], "chat") == \
        f"{BOS}<｜User｜>u\n\nv<｜Assistant｜></think>"
    assert encode_messages([user("u", task="query"), user("v")], "chat") == \
        f"{BOS}<｜User｜>u<｜User｜>v<｜Assistant｜></think>"
    for task, token in [("authority", "<｜authority｜>"), ("domain", "<｜domain｜>"),
                        ("title", "<｜title｜>"), ("read_url", "<｜read_url｜>")]:
        assert encode_messages([user("u", task=task)], "thinking").endswith(f"<｜User｜>u{token}")
    assert encode_messages([user("u", task="action")], "chat").endswith(
        "<｜Assistant｜></think><｜action｜>")
    with pytest.raises(EncodingError, match="task"):
        encode_messages([user("u", task="search")], "chat")
    # Context: a context list renders nothing and writes no BOS.
    assert encode_messages([user("b")], "chat", context=[user("a"), assistant("x")]) == \
        "<｜User｜>b<｜Assistant｜></think>"
    assert encode_messages([user("b")], "chat", add_default_bos_token=False) == \
        "<｜User｜>b<｜Assistant｜></think>"


def test_tool_call_arguments():
    calls = [call("f", json.dumps(json.dumps({"a": 1}))), call("g", "[1,2]"), call("h", {}),
             call("k", "not json"), call("m", {"s": "<｜DSML｜ parameter x", "n": None, "l": [1, "é"]})]
    out = encode_messages([user("x"), assistant("", tool_calls=calls)], "chat")
    assert out.endswith(
        CALLS_PREFIX +
        '<｜DSML｜ invoke name="f">\n'
        '<｜DSML｜ parameter name="a" string="false">1</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
        '<｜DSML｜ invoke name="g">\n'
        '<｜DSML｜ parameter name="arguments" string="true">[1,2]</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
        '<｜DSML｜ invoke name="h">\n\n</｜DSML｜ invoke>\n'
        '<｜DSML｜ invoke name="k">\n'
        '<｜DSML｜ parameter name="arguments" string="true">not json</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
        '<｜DSML｜ invoke name="m">\n'
        '<｜DSML｜ parameter name="s" string="true"><｜DSML｜ parameter x</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="n" string="false">null</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="l" string="false">[1, "é"]</｜DSML｜ parameter>\n'
        f"</｜DSML｜ invoke>\n</｜DSML｜ calls>{EOS}")
    # Namespaces are release-ignored: names pass through, function-level keys land in the schema.
    ns_tool = {"type": "function", "namespace": "x", "function": {"name": "ns::f", "namespace": "y"}}
    msgs = [system("", tools=[ns_tool]), user("q"), assistant("", tool_calls=[call("ns::f", {})])]
    out = encode_messages(msgs, "chat")
    assert '{"name": "ns::f", "namespace": "y"}' in out and 'invoke name="ns::f"' in out


def test_inputs_not_mutated():
    msgs = [system("s", tools=[WEATHER_TOOL]), user([{"type": "image_url", "image_url": {"url": "a"}}]),
            assistant("", reasoning_content="r", tool_calls=[call("f", "{}", "1"), call("g", "{}", "2")]),
            tool("b", "2"), tool("a", "1"), user("q")]
    ctx = [user("c")]
    before, before_ctx = copy.deepcopy(msgs), copy.deepcopy(ctx)
    encode_messages(msgs, "thinking", return_multi_modal_data=True)
    encode_messages(msgs, "thinking", context=ctx)
    assert msgs == before and ctx == before_ctx


def test_malformed_inputs_raise_encoding_error():
    bad = [
        [user("u"), assistant("", tool_calls=[{"function": {"name": "f"}}])],
        [user("u"), assistant("", tool_calls=[{"type": "function"}])],
        [user("u"), assistant("", tool_calls={"oops": 1})],
        [system("s", tools=[{"type": "function"}])],
        [user([1, 2])],
        [user([{"type": "text", "text": 3}])],
        [user("u"), assistant("", tool_calls=[call("f", {"x": object()})])],
    ]
    for msgs in bad:
        with pytest.raises(EncodingError):
            encode_messages(msgs, "chat")


# ---- parser, docs/cli.md §5.8 ------------------------------------------------------------------------------


def test_parser_spec_example():
    text = ("I think.</think>Let me check.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n"
            '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
            '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n'
            f"</｜DSML｜ invoke>\n</｜DSML｜ calls>{EOS}")
    expected = {"role": "assistant", "content": "Let me check.", "reasoning_content": "I think.",
                "tool_calls": [{"type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]}
    assert parse_message_from_completion_text(text, "thinking") == expected
    assert parse_message_from_completion_text(text[:-len(EOS)], "thinking") == expected  # EOS optional here
    empty = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="h">\n\n</｜DSML｜ invoke>\n'
             f'</｜DSML｜ calls>{EOS}')
    assert parse_message_from_completion_text(empty, "chat")["tool_calls"] == \
        [{"type": "function", "function": {"name": "h", "arguments": "{}"}}]
    # Leading newlines are kept; string="false" values are not validated.
    assert parse_message_from_completion_text(f"\n\nhi{EOS}", "chat")["content"] == "\n\nhi"
    raw = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
           '<｜DSML｜ parameter name="x" string="false">'
           f"[oops</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>{EOS}")
    assert parse_message_from_completion_text(raw, "chat")["tool_calls"][0]["function"]["arguments"] == \
        '{"x": [oops}'


CALL = ('<｜DSML｜ invoke name="f">\n'
        '<｜DSML｜ parameter name="a" string="true">1</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n")


@pytest.mark.parametrize("text,mode", [
    ("Hello there.", "chat"),                                    # missing EOS
    (f"hi{EOS}x", "chat"),                                       # text after EOS
    (f"hi{EOS}{EOS}", "chat"),
    (f"r{EOS}", "thinking"),                                     # missing </think>
    (f"a</think>b</think>c{EOS}", "thinking"),                   # second </think>
    (f"a</think>b{EOS}", "chat"),                                # </think> in chat mode
    (f"<think>a</think>b{EOS}", "thinking"),
    (f"{BOS}a{EOS}", "chat"),
    (f"a\n<｜DSML｜ calls>\n{CALL}</｜DSML｜ calls>{EOS}", "chat"),  # single newline before the block
    (f"a\n\n<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>{EOS}", "chat"),  # V4 tags
    (f"\n\n<｜DSML｜ calls>\n{CALL}</｜DSML｜ calls>junk{EOS}", "chat"),
    (f"\n\n<｜DSML｜ calls> \n{CALL}</｜DSML｜ calls>{EOS}", "chat"),
    (f"\n\n<｜DSML｜ calls>\n{CALL}", "chat"),                     # unterminated block
    ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
     '<｜DSML｜ parameter name="a" string="true">1</｜DSML｜ parameter>\n'
     '<｜DSML｜ parameter name="a" string="true">2</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
     f"</｜DSML｜ calls>{EOS}", "chat"),                          # duplicate parameter
    ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
     '<｜DSML｜ parameter name="a" string="yes">1</｜DSML｜ parameter>\n'
     f"</｜DSML｜ invoke>\n</｜DSML｜ calls>{EOS}", "chat"),
    ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke nam="f">\n</｜DSML｜ invoke>\n'
     f"</｜DSML｜ calls>{EOS}", "chat"),
    (123, "chat"),
])
def test_parser_rejects(text, mode):
    with pytest.raises(ParseError):
        parse_message_from_completion_text(text, mode)


# ---- batch input, docs/cli.md §5.7 -------------------------------------------------------------------------


def test_parse_tagged_text():
    assert parse_tagged_text("plain text") == "plain text"
    assert parse_tagged_text("a <image>x.png</image> b<image>y\n.png</image>") == [
        {"type": "text", "text": "a "}, {"type": "image_url", "image_url": {"url": "x.png"}},
        {"type": "text", "text": " b"}, {"type": "image_url", "image_url": {"url": "y\n.png"}}]
    assert parse_tagged_text("<image>p</image>") == [{"type": "image_url", "image_url": {"url": "p"}}]
    for bad in ["<image>p", "p</image>", "<image>a</image></image>", "<image></image>"]:
        with pytest.raises(EncodingError):
            parse_tagged_text(bad)


def test_load_and_encode_cases(tmp_path):
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps([user("hi")]), encoding="utf-8")
    (case,) = load_cases(str(bare))
    assert case == {"messages": [user("hi")], "context": None, "thinking_mode": None,
                    "reasoning_effort": None}
    assert encode_case(case, "chat") == (f"{BOS}<｜User｜>hi<｜Assistant｜></think>", [])
    assert encode_case(case, "thinking")[0].endswith("<think>")

    many = tmp_path / "many.json"
    many.write_text(json.dumps([
        {"messages": [system("s"), user("hi")], "tools": [WEATHER_TOOL], "reasoning_effort": 3},
        {"messages": [user([{"type": "image_url", "image_url": {"url": "a.png"}}])],
         "thinking_mode": "thinking", "context": []},
    ]), encoding="utf-8")
    first, second = load_cases(str(many))
    assert first["messages"][0]["tools"] == [WEATHER_TOOL] and first["reasoning_effort"] == 3
    assert encode_case(first, "thinking")[0].startswith(f"{BOS}<｜System｜>{EFFORT.format(3)}s\n\n## Tools")
    prompt, images = encode_case(second, "chat")
    assert prompt.endswith(f"{IMAGE_PLACEHOLDER}<｜Assistant｜><think>")
    assert images == [{"type": "image", "url": "a.png"}]

    single = tmp_path / "single.json"
    single.write_text(json.dumps({"messages": [], "tools": [WEATHER_TOOL]}), encoding="utf-8")
    with pytest.raises(EncodingError, match="tools"):
        load_cases(str(single))
    single.write_text(json.dumps({"msgs": []}), encoding="utf-8")
    with pytest.raises(EncodingError, match="messages"):
        load_cases(str(single))


def test_to_json():
    assert to_json({"a": "é", "b": [1, 2]}) == '{"a": "é", "b": [1, 2]}'
    with pytest.raises(EncodingError):
        to_json({"a": object()})
