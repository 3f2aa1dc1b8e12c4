"""Property tests: rendered assistant turns parse back unchanged; the parser only ever raises ParseError."""
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from encoding.encoding import (
    BOS,
    DSML,
    EOS,
    IMAGE_PLACEHOLDER,
    THINK_END,
    THINK_START,
    ParseError,
    encode_messages,
    parse_message_from_completion_text,
    to_json,
)

SETTINGS = settings(max_examples=300, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

# Pieces that look like the format's own tags, so the generators hit the parser's corner cases.
FRAGMENTS = ["<", ">", "/", "\n", "\n\n", '"', "=", " ", "｜", "▁", "DSML", DSML, "<think", "think>", "</",
             "<tool_result>", "<｜User｜>", "<｜Assistant｜>", "<｜DSML", " calls>", " invoke",
             " parameter", 'name="', '" string="true">', 'string="false">', '">\n', "</｜DSML｜ invoke>",
             "</｜DSML｜ calls>", "end▁of▁sentence", "🙂", "世界", "é", "{", "}", "\\", "\t"]
SPECIAL = (BOS, EOS, THINK_START, THINK_END, DSML, IMAGE_PLACEHOLDER)


def _text(max_pieces=8):
    piece = st.one_of(st.text(max_size=6), st.sampled_from(FRAGMENTS))
    return st.lists(piece, max_size=max_pieces).map("".join)


# Reasoning and content may not contain the special strings (the parser rejects them by design).
plain_text = _text().filter(lambda s: not any(t in s for t in SPECIAL))
# A tool name or parameter key may not contain DSML tags; a key may not fake the `string=` attribute.
names = _text(5).filter(lambda s: DSML not in s)
keys = names.filter(lambda s: '" string="' not in s)
# String values end at the first `/｜DSML｜ parameter`; everything else goes through raw.
value_text = _text().filter(lambda s: "/" + DSML + " parameter" not in s)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | value_text,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(value_text, children, max_size=3),
    max_leaves=8)
arguments = st.dictionaries(keys, json_values, max_size=4)


@st.composite
def tool_calls(draw):
    calls = []
    for args in draw(st.lists(arguments, max_size=3)):
        form = draw(st.sampled_from(["dict", "json", "double"]))
        encoded = {"dict": args, "json": to_json(args), "double": json.dumps(to_json(args))}[form]
        calls.append((draw(names), args, encoded))
    return calls


@SETTINGS
@given(mode=st.sampled_from(["chat", "thinking"]), content=plain_text, reasoning=plain_text,
       calls=tool_calls())
def test_render_parse_round_trip(mode, content, reasoning, calls):
    msg = {"role": "assistant", "content": content, "reasoning_content": reasoning,
           "tool_calls": [{"type": "function", "function": {"name": n, "arguments": encoded}}
                          for n, _, encoded in calls]}
    context = [{"role": "user", "content": "q"}]
    text = encode_messages([msg], mode, context=context)

    parsed = parse_message_from_completion_text(text, mode)
    assert parsed["content"] == content
    assert parsed["reasoning_content"] == (reasoning if mode == "thinking" else "")
    assert [c["function"]["name"] for c in parsed["tool_calls"]] == [n for n, _, _ in calls]
    for parsed_call, (_, args, _) in zip(parsed["tool_calls"], calls):
        assert parsed_call["function"]["arguments"] == to_json(args)
        assert json.loads(parsed_call["function"]["arguments"]) == args
    # Re-encoding the parsed message after the same context reproduces the text.
    assert encode_messages([parsed], mode, context=context) == text


GRAMMAR = FRAGMENTS + [EOS, BOS, THINK_END, THINK_START, "\n\n<｜DSML｜ calls>\n",
                       '<｜DSML｜ invoke name="f">\n', '<｜DSML｜ parameter name="a" string="true">',
                       "</｜DSML｜ parameter>\n", "</｜DSML｜ invoke>\n"]
grammar_text = st.lists(st.one_of(st.sampled_from(GRAMMAR), st.text(max_size=4)), max_size=20).map("".join)


@SETTINGS
@given(text=grammar_text, mode=st.sampled_from(["chat", "thinking"]))
def test_parser_only_raises_parse_error(text, mode):
    try:
        parsed = parse_message_from_completion_text(text, mode)
    except ParseError:
        return
    for token in (BOS, EOS, THINK_START, THINK_END, DSML):
        assert token not in parsed["content"] and token not in parsed["reasoning_content"]
    for c in parsed["tool_calls"]:
        assert isinstance(c["function"]["name"], str) and c["function"]["arguments"].startswith("{")
