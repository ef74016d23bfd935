"""A constraint applied to the answer after the reasoning: the request's grammar behind a reasoning block
of free text, so that the model reasons as it likes and the constraint (a schema, a forced tool call) holds
from the end tag on."""

import json

from gateway import harmony
from gateway.reasoning.formats import ReasoningFormat
from gateway.structured.lark import Tags
from gateway.structured.spec import Spec

# The blanks a model writes between its reasoning and its answer (a few: a constraint gives no room to loop).
BLANK = r"BLANK: /[ \t\r\n]{0,4}/"


def after_reasoning(spec: Spec, fmt: ReasoningFormat, opened: bool, tags: Tags, headed: bool = False) -> Spec:
    """The grammar of an optional reasoning block (a required rest of one, its start tag optional, when the
    prompt `opened` it), then `spec`'s. The block's text is any text without the end tag: with the end tag an
    added token, any text (the grammar engine reads no added token as text) then that token; else text up to
    the tag's string. Harmony (`fmt.channels`): the block is an analysis message, and `spec` the body of the
    next assistant message, a final one unless `headed` (a harmony call, which writes its own header)."""
    if tags.token(fmt.end) is not None:
        reasoning = f"reasoning: TEXT {tags.literal(fmt.end)}\nTEXT: /(?s:.*)/"
    else:
        reasoning = f"reasoning: text\ntext[stop={json.dumps(fmt.end)}]: /(?s:.*)/"
    start = tags.literal(fmt.start)
    if fmt.channels:
        then = tags.literal(harmony.START + "assistant")
        head = f"reasoning {then}" if opened else f"({start} reasoning {then})?"
        final = "" if headed else tags.literal(harmony.CHANNEL + "final" + harmony.MESSAGE)
        lark = f"start: {head} {final} @answer\n{reasoning}\n"
    else:
        head = f"{start}? reasoning" if opened else f"({start} reasoning)?"
        lark = f"start: {head} BLANK @answer\n{reasoning}\n{BLANK}\n"
    answer = {**_grammar(spec.grammar()), "name": "answer"}
    return Spec("top", json.dumps({"grammars": [{"name": "reasoned", "lark_grammar": lark}, answer]}))


def _grammar(text: str) -> dict:
    """The one grammar of an llguidance grammar text (a Lark grammar, or a top-level grammar as JSON)."""
    if not text.lstrip().startswith("{"):
        return {"lark_grammar": text}
    (grammar,) = json.loads(text)["grammars"]
    return {key: value for key, value in grammar.items() if key != "name"}
