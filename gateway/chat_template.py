"""--chat-template FILE|TEXT (vLLM's flag): the chat template the gateway renders messages with, in place of
the model's own (or where its files carry none, as many GGUF files do)."""

from pathlib import Path

import jinja2


class ChatTemplateError(ValueError):
    """The flag's value is neither a readable file nor a template that compiles; the message says which."""


def resolve(value: str) -> str:
    """The template the flag names: the file's text when `value` is a file, else `value` itself when it reads
    as a template (it holds `{`, `}` or a line break); checked to compile."""
    path = Path(value)
    if path.is_file():
        try:
            template = path.read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise ChatTemplateError(f"--chat-template {value}: cannot read it: {err}") from None
    elif any(mark in value for mark in "{}\n"):
        template = value
    else:
        raise ChatTemplateError(
            f"--chat-template {value!r}: no such file, and not a template (a Jinja template holds {{ or {{%)"
        )
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as err:
        raise ChatTemplateError(f"--chat-template: the template does not compile: {err}") from None
    return template
